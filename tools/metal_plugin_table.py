"""Write tfmx's table of the open Metal plugin (``tensorflow-metal-plugin``) from its sdist.

The sdist carries the plugin's whole source. Its kernels are registered through TensorFlow's
kernel C API (``TF_NewKernelBuilder``, ``TF_KernelBuilder_TypeConstraint``,
``TF_RegisterKernelBuilder``), in one ``RegisterMetal*Kernels`` function per source file,
mostly through a file-local helper called over tables and dtype arrays. One regular expression
cannot read that, so this script reads the small subset of C++ the registrations are written
in: it strips comments, splits functions into statements with regular expressions and bracket
matching, and runs ``RegisterAllMetalKernels`` symbolically (declarations, ``for`` loops over
counts and tables, ``if`` on the helpers' flags, calls with default arguments), recording each
registration with its type constraints and whether a ``ResourceVariableApiAvailable()`` check
guarded it. What it cannot evaluate it lists in the notes and the summary; it never guesses:
an op whose constraints it could not read gets ``[]``.

It writes ``tfmx/data/tensorflow-metal-plugin-<version>.json``:

- ``ops``: op -> the dtypes of its value type: per registration the first type constraint on
  an attribute that is not an index, shape or count type (``Tidx``, ``Tindices``, ...), the
  union over the op's registrations; ``[]`` where a registration leaves it unconstrained.
- ``type_constraints``: op -> attribute -> dtypes, every constraint, every registration.
- ``fused_ops``: per fused op, the ``fused_ops`` lists its kernel accepts (the names its attr
  parser takes: the bias, then at most one activation; any other name is refused).
- ``graph_pass_fused_ops``: the lists the plugin's own graph pass emits.
- ``host_only_before``: the ops it registers only behind that check, which TensorFlow 2.20
  and 2.21 fail (tensorflow/tensorflow#126374, fixed for 2.22 by #126377).

Usage, from the repository root (the second form has pip download the sdist)::

    python tools/metal_plugin_table.py path/to/tensorflow_metal_plugin-0.4.1.tar.gz
    python tools/metal_plugin_table.py --version 0.4.1

The library never imports this file; ``tfmx.metal_plugins`` reads what it writes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

DIST = "tensorflow-metal-plugin"
ROOT = Path(__file__).resolve().parent.parent
KERNEL_DIR = "src/tensorflow/core/common_runtime/metal/kernels/"
GRAPH_PASS = "src/tensorflow/core/common_runtime/metal/metal_graph.mm"
ENTRY = "RegisterAllMetalKernels"
GATE = "ResourceVariableApiAvailable"
# The first release that exports the gate's entry points again (tensorflow/tensorflow#126377).
# The source only looks the symbols up at load, so the version is stated here.
FIXED_IN = "2.22"
INDEX_ATTRS = frozenset({"Tidx", "Tindices", "Tperm", "Tpaddings", "Tshift", "Tlen", "Index",
                         "TI", "index_type", "Tsegmentids", "Tlabels"})
TF_DTYPES = {
    "TF_FLOAT": "float32", "TF_HALF": "float16", "TF_BFLOAT16": "bfloat16",
    "TF_DOUBLE": "float64", "TF_INT8": "int8", "TF_INT16": "int16", "TF_INT32": "int32",
    "TF_INT64": "int64", "TF_UINT8": "uint8", "TF_UINT16": "uint16", "TF_UINT32": "uint32",
    "TF_UINT64": "uint64", "TF_BOOL": "bool", "TF_COMPLEX64": "complex64",
    "TF_COMPLEX128": "complex128", "TF_STRING": "string", "TF_RESOURCE": "resource",
    "TF_VARIANT": "variant",
}


class DType(str):
    """A ``TF_DataType`` constant, as TensorFlow's dtype name."""


class Opaque:
    """A value this reader does not evaluate (a status, a computed name, an unknown call)."""

    def __init__(self, text: str = "") -> None:
        self.text = text


class Gate:
    """The value of the ``ResourceVariableApiAvailable()`` check."""


@dataclass(frozen=True)
class FuncRef:
    name: str


@dataclass
class Builder:
    op: object
    device: object
    create: object
    constraints: list = field(default_factory=list)


@dataclass
class Function:
    name: str
    source: str
    params: list  # [(name, default expression or None)]
    body: str


class _Break(Exception):
    pass


class _Return(Exception):
    pass


# ---- reading C++ ------------------------------------------------------------------------------

_LITERAL = re.compile(r'"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'')
_LITERAL_OR_COMMENT = re.compile(_LITERAL.pattern + r"|//[^\n]*|/\*.*?\*/", re.S)
_PAIRS = {"(": ")", "[": "]", "{": "}"}


def strip_comments(text: str) -> str:
    return _LITERAL_OR_COMMENT.sub(
        lambda m: m.group(0) if m.group(0)[0] in "\"'" else " ", text)


def _scan(text: str, i: int = 0):
    """``(index, character)`` of ``text`` from ``i`` on, string and character literals
    skipped."""
    while i < len(text):
        literal = _LITERAL.match(text, i)
        if literal:
            i = literal.end()
            continue
        yield i, text[i]
        i += 1


def _close(text: str, i: int) -> int:
    """The index just past the bracket that closes the one at ``text[i]``."""
    stack = []
    for k, c in _scan(text, i):
        if c in _PAIRS:
            stack.append(_PAIRS[c])
        elif c in ")]}":
            if not stack or stack.pop() != c:
                raise SyntaxError(f"unbalanced {c!r}")
            if not stack:
                return k + 1
    raise SyntaxError("unclosed bracket")


def split_top(text: str, sep: str = ",") -> list[str]:
    """``text`` split at ``sep`` outside brackets and literals."""
    parts, depth, start = [], 0, 0
    for k, c in _scan(text):
        depth += c in "([{"
        depth -= c in ")]}"
        if c == sep and depth == 0:
            parts.append(text[start:k].strip())
            start = k + 1
    parts.append(text[start:].strip())
    return [p for p in parts if p]


_FUNC = re.compile(r"^(?:template\s*<[^>\n]*>\s*)?(?:static\s+|inline\s+)*"
                   r"[A-Za-z_][\w:<>]*[\s*&]+(\w+)\s*\(", re.M)


def functions(text: str, source: str) -> dict[str, Function]:
    """The functions defined at the top level of ``text`` (declarations skipped)."""
    found = {}
    for m in _FUNC.finditer(text):
        try:
            after = _close(text, m.end() - 1)
            rest = text[after:].lstrip()
            if not rest.startswith("{"):
                continue
            start = len(text) - len(rest)
            body = text[start + 1:_close(text, start) - 1]
        except SyntaxError:
            continue
        found[m.group(1)] = Function(m.group(1), source,
                                     _params(text[m.end():after - 1]), body)
    return found


def _params(text: str) -> list:
    out = []
    for p in split_top(text):
        if p == "void":
            continue
        decl, _, default = p.partition("=")
        pointer = re.search(r"\(\s*\*\s*(\w+)\s*\)", decl)
        out.append((pointer.group(1) if pointer else re.findall(r"\w+", decl)[-1],
                    default.strip() or None))
    return out


def statements(text: str) -> list:
    """``text`` as nodes: ("if", cond, then, else), ("for", header, body), ("block", body),
    ("stmt", text); other loops are kept as ("loop", header, body) and not followed."""
    nodes, i = [], 0
    while True:
        while i < len(text) and text[i] in " \t\r\n;":
            i += 1
        if i >= len(text):
            return nodes
        node, i = _statement(text, i)
        nodes.append(node)


def _statement(text: str, i: int):
    word = re.compile(r"(if|for|while|switch)\b\s*(?=\()").match(text, i)
    if word:
        end = _close(text, word.end())
        header = text[word.end() + 1:end - 1]
        then, k = _body(text, end)
        if word.group(1) != "if":
            return ("for" if word.group(1) == "for" else "loop", header, then), k
        other = re.compile(r"\s*else\b\s*").match(text, k)
        if other:
            orelse, k = _body(text, other.end())
            return ("if", header, then, orelse), k
        return ("if", header, then, []), k
    if text[i] == "{":
        end = _close(text, i)
        return ("block", statements(text[i + 1:end - 1])), end
    j = i
    while j < len(text) and text[j] != ";":
        literal = _LITERAL.match(text, j)
        if literal:
            j = literal.end()
        else:
            j = _close(text, j) if text[j] in _PAIRS else j + 1
    return ("stmt", text[i:j].strip()), j + 1


def _body(text: str, i: int):
    while text[i] in " \t\r\n":
        i += 1
    if text[i] == "{":
        end = _close(text, i)
        return statements(text[i + 1:end - 1]), end
    node, k = _statement(text, i)
    return [node], k


_TOKEN = re.compile(r'\s*(?:"(?:\\.|[^"\\])*"|\d+|[A-Za-z_]\w*(?:::\w+)*|->|==|!=|&&|\|\||\S)')


def tokens(text: str) -> list[str]:
    return [m.group(0).strip() for m in _TOKEN.finditer(text) if m.group(0).strip()]


def _skip_call(t: list, i: int) -> int:
    depth = 0
    for k in range(i, len(t)):
        depth += t[k] == "("
        depth -= t[k] == ")"
        if depth == 0:
            return k + 1
    raise SyntaxError("unclosed call")


def _truth(v) -> bool:
    return bool(v) and not isinstance(v, Opaque)


# ---- running the registrations ----------------------------------------------------------------

class Evaluator:
    """Runs registration functions; ``registrations`` collects what they register."""

    def __init__(self, files: dict[str, dict[str, Function]], constants: dict) -> None:
        self.files = files
        self.constants = constants
        self.registrations: list[dict] = []
        self.unparsed: list[str] = []
        self.called: set[tuple[str, str]] = set()

    def lookup(self, name: str, source: str) -> Function | None:
        if name in self.files.get(source, {}):
            return self.files[source][name]
        hits = [fs[name] for fs in self.files.values() if name in fs]
        return hits[0] if len(hits) == 1 else None

    def run(self, fn: Function, args: list, gated: bool) -> None:
        self.called.add((fn.source, fn.name))
        env = {}
        for k, (name, default) in enumerate(fn.params):
            env[name] = (args[k] if k < len(args)
                         else self.value(default, {}) if default else Opaque(name))
        try:
            self.block(statements(fn.body), env, fn, gated)
        except (_Break, _Return):
            pass

    def block(self, nodes: list, env: dict, fn: Function, gated: bool) -> None:
        for node in nodes:
            if node[0] == "stmt":
                self.statement(node[1], env, fn, gated)
            elif node[0] == "block":
                self.block(node[1], dict(env), fn, gated)
            elif node[0] == "if":
                cond = self.value(node[1], env)
                if isinstance(cond, Gate):
                    self.block(node[2], dict(env), fn, True)
                elif isinstance(cond, Opaque):
                    self.unparsed.append(f"{fn.source}: {fn.name}: condition {node[1]!r} "
                                         "not evaluated, both branches read")
                    self.block(node[2], dict(env), fn, gated)
                    self.block(node[3], dict(env), fn, gated)
                else:
                    self.block(node[2] if cond else node[3], dict(env), fn, gated)
            elif node[0] == "for":
                self.loop(node[1], node[2], env, fn, gated)
            elif self.registers(node):
                self.unparsed.append(f"{fn.source}: {fn.name}: a loop not followed")

    def registers(self, nodes) -> bool:
        """True if ``nodes`` may register or constrain a kernel (directly or by a call)."""
        text = repr(nodes)
        return bool(re.search(r"TF_(?:NewKernelBuilder|KernelBuilder_TypeConstraint|"
                              r"RegisterKernelBuilder)\b", text)) or any(
            name in fs for name in re.findall(r"\b(\w+)\s*\(", text)
            for fs in self.files.values())

    def loop(self, header: str, body: list, env: dict, fn: Function, gated: bool) -> None:
        counted = re.fullmatch(r"\s*(?:int|size_t)\s+(\w+)\s*=\s*(\d+)\s*;\s*\1\s*<\s*(\w+)\s*;"
                               r"\s*(?:\+\+\1|\1\+\+)\s*", header)
        ranged = re.fullmatch(r"(.*?)\b(\w+)\s*:(?!:)\s*(.+)", header, re.S)
        if counted:
            var, stop = counted.group(1), self.value(counted.group(3), env)
            items = list(range(int(counted.group(2)), stop)) if isinstance(stop, int) else None
        elif ranged:
            var, items = ranged.group(2), self.value(ranged.group(3), env)
        else:
            var, items = "", None
        if not isinstance(items, list):
            if not self.registers(body):
                return
            self.unparsed.append(f"{fn.source}: {fn.name}: loop ({header}) not followed")
            return
        for item in items:
            try:
                self.block(body, {**env, var: item}, fn, gated)
            except _Break:
                break

    def statement(self, text: str, env: dict, fn: Function, gated: bool) -> None:
        if text == "break":
            raise _Break
        if re.match(r"return\b", text):
            raise _Return
        if text.startswith("struct"):
            self.struct(text, env)
            return
        decl = re.fullmatch(r"(?:static\s+)?(?:constexpr\s+)?(?:const\s+)?([\w:<>*\s&]+?)"
                            r"\s*\b(\w+)\s*(?:\[\s*\w*\s*\])?\s*=\s*(.+)", text, re.S)
        if decl:
            env[decl.group(2)] = self.initial(decl.group(1).strip(), decl.group(3), env)
            return
        call = re.fullmatch(r"([A-Za-z_]\w*)\s*\((.*)\)", text, re.S)
        if not call:
            return
        name, args = call.group(1), split_top(call.group(2))
        if name == "TF_KernelBuilder_TypeConstraint":
            builder = env.get(args[0])
            if isinstance(builder, Builder):
                builder.constraints.append((self.value(args[1], env),
                                            self.value(args[2], env)))
        elif name == "TF_RegisterKernelBuilder":
            builder = env.get(args[1])
            if isinstance(builder, Builder):
                self.registrations.append({"op": builder.op, "device": builder.device,
                                           "create": builder.create,
                                           "constraints": list(builder.constraints),
                                           "gated": gated, "file": fn.source})
            else:
                self.unparsed.append(f"{fn.source}: {fn.name}: a registration of an "
                                     "unknown builder")
        else:
            target = self.lookup(name, fn.source)
            if target is not None:
                self.run(target, [self.value(a, env) for a in args], gated)

    def initial(self, type_name: str, text: str, env: dict):
        new = re.fullmatch(r"TF_NewKernelBuilder\s*\((.*)\)", text.strip(), re.S)
        if new:
            args = split_top(new.group(1))
            return Builder(*(self.value(args[k], env) for k in range(3)))
        v = self.value(text, env)
        fields = env.get(("struct", type_name))
        if fields and isinstance(v, list):
            return [dict(zip(fields, row)) if isinstance(row, list) else row for row in v]
        return v

    def struct(self, text: str, env: dict) -> None:
        m = re.match(r"struct\s*(\w*)\s*(?=\{)", text)
        if not m:
            return
        end = _close(text, m.end())
        fields = []
        for member in split_top(text[m.end() + 1:end - 1], ";"):
            pointer = re.search(r"\(\s*\*\s*(\w+)\s*\)", member)
            fields.append(pointer.group(1) if pointer else re.findall(r"\w+", member)[-1])
        if m.group(1):
            env[("struct", m.group(1))] = fields
        table = re.fullmatch(r"\s*(\w+)\s*\[\s*\w*\s*\]\s*=\s*(.+)", text[end:], re.S)
        if table:  # an anonymous struct's table
            rows = self.value(table.group(2), env)
            env[table.group(1)] = ([dict(zip(fields, r)) for r in rows]
                                   if isinstance(rows, list) else rows)

    # expressions: || && == != + ! & [] . () {} and literals
    def value(self, text: str, env: dict):
        toks = tokens(text)
        if not toks:
            return Opaque()
        try:
            result, pos = self._binary(toks, 0, env, 0)
        except (IndexError, KeyError, TypeError, ValueError, SyntaxError):
            return Opaque(text)
        return result if pos == len(toks) else Opaque(text)

    _LEVELS = (("||",), ("&&",), ("==", "!="), ("+",))

    def _binary(self, t: list, i: int, env: dict, level: int):
        if level == len(self._LEVELS):
            return self._unary(t, i, env)
        left, i = self._binary(t, i, env, level + 1)
        while i < len(t) and t[i] in self._LEVELS[level]:
            op = t[i]
            right, i = self._binary(t, i + 1, env, level + 1)
            left = _combine(op, left, right)
        return left, i

    def _unary(self, t: list, i: int, env: dict):
        if t[i] == "!":
            v, i = self._unary(t, i + 1, env)
            return (v if isinstance(v, Opaque) else not _truth(v)), i
        if t[i] == "&":
            name, i = t[i + 1], i + 2
            if i < len(t) and t[i] == "<":  # a template's arguments
                i = t.index(">", i) + 1
            return FuncRef(name.split("::")[-1]), i
        v, i = self._primary(t, i, env)
        while i < len(t) and t[i] in ("[", "."):
            if t[i] == "[":
                index, i = self._binary(t, i + 1, env, 0)
                i += 1
                v = v[index] if isinstance(v, list) and isinstance(index, int) else Opaque()
            else:
                name, i = t[i + 1], i + 2
                if i < len(t) and t[i] == "(":  # a method: c_str() keeps the string
                    i = _skip_call(t, i)
                    v = v if name == "c_str" else Opaque()
                else:
                    v = v.get(name, Opaque()) if isinstance(v, dict) else Opaque()
        return v, i

    def _primary(self, t: list, i: int, env: dict):
        tok = t[i]
        if tok.startswith('"'):
            s = ""
            while i < len(t) and t[i].startswith('"'):
                s, i = s + json.loads(t[i]), i + 1
            return s, i
        if tok.isdigit():
            return int(tok), i + 1
        if tok == "(":
            v, i = self._binary(t, i + 1, env, 0)
            return v, i + 1
        if tok == "{":
            items, i = [], i + 1
            while t[i] != "}":
                item, i = self._binary(t, i, env, 0)
                items.append(item)
                i += t[i] == ","
            return items, i + 1
        if i + 1 < len(t) and t[i + 1] == "(":
            end = _skip_call(t, i + 1)
            if tok == "TF_GetCode":
                return "TF_OK", end  # every status this reader follows is OK
            if tok == GATE:
                return Gate(), end
            if tok == "std::string":
                return self._binary(t, i + 2, env, 0)[0], end
            return Opaque(tok), end
        literals = {"true": True, "false": False, "nullptr": None, "TF_OK": "TF_OK"}
        if tok in literals:
            return literals[tok], i + 1
        if tok in TF_DTYPES:
            return DType(TF_DTYPES[tok]), i + 1
        return env.get(tok, self.constants.get(tok, Opaque(tok))), i + 1


def _combine(op: str, left, right):
    if op == "||":
        return _truth(left) or _truth(right)
    if op == "&&":
        return _truth(left) and _truth(right)
    if isinstance(left, Opaque) or isinstance(right, Opaque):
        return Opaque()
    if op == "+":
        return left + right if isinstance(left, str) and isinstance(right, str) else Opaque()
    return (left == right) == (op == "==")


# ---- the table --------------------------------------------------------------------------------

def read_sdist(path: Path) -> dict[str, str]:
    """The sdist's text files, by their path below its top folder."""
    out = {}
    with tarfile.open(path) as tar:
        for member in tar.getmembers():
            if member.isfile():
                name = member.name.split("/", 1)[1] if "/" in member.name else member.name
                out[name] = tar.extractfile(member).read().decode("utf-8", "replace")
    return out


def _function_text(files: dict[str, dict[str, Function]], source: str, name: str) -> str:
    fn = files.get(source, {}).get(name)
    return fn.body if fn else ""


def fused_lists(files: dict[str, dict[str, Function]], registrations: list) -> dict:
    """Per fused op, the fused_ops lists its kernel's attr parser accepts: the name that sets
    the bias, alone and followed by each name that sets the activation. Only a parser that
    refuses any other name (it sets TF_UNIMPLEMENTED) makes a closed list."""
    out = {}
    for reg in registrations:
        op, create = reg["op"], reg["create"]
        if not isinstance(op, str) or not isinstance(create, FuncRef) or op in out:
            continue
        body = _function_text(files, reg["file"], create.name)
        parsers = [create.name] if '"fused_ops"' in body else [
            n for n in re.findall(r"\b(\w+)\s*\(", body)
            if '"fused_ops"' in _function_text(files, reg["file"], n)]
        parser = _function_text(files, reg["file"], parsers[0]) if parsers else ""
        if "TF_UNIMPLEMENTED" not in parser:
            continue
        names = re.findall(r'==\s*"(\w+)"\s*\)\s*\{\s*\w+\s*->\s*(\w+)', parser)
        bias = [n for n, member in names if "bias" in member]
        acts = [n for n, member in names if "activation" in member]
        out[op] = [bias] + [[*bias, a] for a in acts] if bias else [[a] for a in acts]
    return dict(sorted(out.items()))


def graph_pass(text: str) -> tuple[dict, list[str]]:
    """The fused_ops lists the plugin's graph pass emits, and notes on what else it does."""
    text = strip_comments(text)
    acts = [a for fn in functions(text, GRAPH_PASS).values() if fn.name.startswith("IsFusable")
            for a in re.findall(r'==\s*"(\w+)"', fn.body)]
    emitted = re.findall(r'\.op\s*=\s*\w+\s*\?\s*"(\w+)"\s*:\s*"(\w+)"', text)
    contractions = re.findall(r'=\s*\w+\.op\s*==\s*"(\w+)"', text)
    anchors = re.findall(r'\.op\s*!=\s*"(\w+)"', text)[:1]
    lists = [anchors] + [[*anchors, a] for a in acts] if anchors else []
    out = {op: lists for pair in emitted for op in pair}
    notes = []
    if re.search(r"layout_optimizer\s*=\s*TF_TriState_Off", text):
        notes.append("its graph pass turns Grappler's layout optimizer off")
    if out:
        notes.append(f"its graph pass fuses {' or '.join(contractions)} + {anchors[0]} + one of "
                     f"{', '.join(acts)} into {' / '.join(sorted(out))} (graph_pass_fused_ops)")
    return dict(sorted(out.items())), notes


def readme_gated(readme: str) -> set[str]:
    """The op names of the table its README gives for the missing entry points."""
    section = readme.split("## What a released TensorFlow cannot do", 1)[-1].split("\n## ")[0]
    return {name for line in section.splitlines() if line.startswith("|")
            for name in re.findall(r"`(\w+)`", line)}


def gate_symbols(texts: dict[str, str]) -> list[str]:
    """The entry points the gate looks up."""
    for path, text in sorted(texts.items()):
        text = strip_comments(text)
        fn = functions(text, path).get(GATE) if path.startswith(KERNEL_DIR) else None
        if fn is not None:
            return re.findall(r'"(TF_\w+)"', fn.body)
    return []


def run_registrations(texts: dict[str, str]) -> tuple[Evaluator, list[str]]:
    """``RegisterAllMetalKernels`` run; the problems it met."""
    files = {Path(p).name: functions(strip_comments(t), Path(p).name)
             for p, t in sorted(texts.items())
             if p.startswith(KERNEL_DIR) and p.endswith((".mm", ".cc", ".cpp"))}
    constants = {name: value for path, text in sorted(texts.items()) if path.startswith("src/")
                 for name, value in re.findall(r'constexpr\s+char\s+(\w+)\[\]\s*=\s*"([^"]*)"',
                                               text)}
    evaluator = Evaluator(files, constants)
    entry = evaluator.lookup(ENTRY, "")
    if entry is None:
        raise SystemExit(f"{ENTRY} not found in {KERNEL_DIR}")
    evaluator.run(entry, [], False)
    problems = list(evaluator.unparsed)
    for source, fns in sorted(files.items()):
        for fn in fns.values():
            if "TF_RegisterKernelBuilder" in fn.body and (source, fn.name) not in evaluator.called:
                problems.append(f"{source}: {fn.name} registers kernels but is never reached "
                                f"from {ENTRY}")
    for path, text in sorted(texts.items()):
        if path.startswith("src/") and "REGISTER_KERNEL_BUILDER(" in strip_comments(text):
            problems.append(f"{path}: REGISTER_KERNEL_BUILDER registrations are not read")
    return evaluator, problems


def tabulate(registrations: list, problems: list[str]) -> tuple[dict, dict, list[str]]:
    """Per op its constraints (attr -> dtypes) and value dtypes (None: unconstrained), and the
    ops every registration of which is gated."""
    constraints: dict[str, dict[str, set]] = {}
    values: dict[str, set | None] = {}
    gated_only: dict[str, bool] = {}
    for reg in registrations:
        op = reg["op"]
        if not isinstance(op, str):
            problems.append(f"{reg['file']}: a registration whose op name was not evaluated")
            continue
        per_op = constraints.setdefault(op, {})
        primary, readable = None, True
        for attr, dtype in reg["constraints"]:
            if not isinstance(attr, str) or not isinstance(dtype, DType):
                readable = False
                problems.append(f"{reg['file']}: {op}: a type constraint not evaluated")
                continue
            per_op.setdefault(attr, set()).add(str(dtype))
            if primary is None and attr not in INDEX_ATTRS:
                primary = str(dtype)
        if op not in values or values[op] is not None:
            values[op] = (None if primary is None or not readable
                          else (values.get(op) or set()) | {primary})
        gated_only[op] = gated_only.get(op, True) and reg["gated"]
    return constraints, values, sorted(op for op, gated in gated_only.items() if gated)


def build(sdist: Path) -> dict:
    """The table of the plugin whose sdist is at ``sdist``."""
    texts = read_sdist(sdist)
    meta = texts.get("PKG-INFO", "")
    requires = re.findall(r"^Requires-Dist:\s*(tensorflow\b.*)$", meta, re.M)
    evaluator, problems = run_registrations(texts)
    registrations = evaluator.registrations
    constraints, values, host_only = tabulate(registrations, problems)
    fused = fused_lists(evaluator.files, registrations)
    pass_lists, pass_notes = graph_pass(texts.get(GRAPH_PASS, ""))
    if GRAPH_PASS in texts and not pass_lists:
        problems.append(f"{GRAPH_PASS}: the lists its graph pass emits")

    devices = sorted({r["device"] for r in registrations if isinstance(r["device"], str)})
    notes = [
        f"{len(registrations)} kernel registrations of {len(values)} ops, all through "
        "TensorFlow's kernel C API (TF_NewKernelBuilder, TF_KernelBuilder_TypeConstraint, "
        f"TF_RegisterKernelBuilder), for device type {' and '.join(devices) or '(not read)'}",
        "ops: each op's value dtypes (the first type constraint of a registration on an "
        f"attribute other than {', '.join(sorted(INDEX_ATTRS))}); [] where a registration "
        "leaves the value type unconstrained; every constraint is under type_constraints",
    ]
    if host_only:
        symbols = ", ".join(gate_symbols(texts)) or "the kernel C API entry points"
        notes.append(f"host_only_before: {len(host_only)} ops it registers only when {GATE}() "
                     f"finds {symbols} (dlsym); TensorFlow 2.20 and 2.21 export none of them "
                     f"(tensorflow/tensorflow#126374, fixed in {FIXED_IN} by #126377), and "
                     "there TensorFlow's own kernels run these ops")
        if any("TF_METAL_SYNCHRONOUS" in t for t in texts.values()):
            notes.append("while the check fails every Metal kernel waits for the GPU before "
                         "returning (SynchronousMode; TF_METAL_SYNCHRONOUS overrides)")
    listed = readme_gated(texts.get("README.md", ""))
    for op in sorted(listed - set(host_only)) if listed else ():
        where = "registers it unconditionally" if op in values else "does not register it"
        notes.append(f"its README lists {op} among the ops the missing entry points keep out; "
                     f"the source {where}")
    for op in sorted(set(host_only) - listed) if listed else ():
        notes.append(f"its README's list of the ops the missing entry points keep out leaves "
                     f"{op} out; the source gates it too")
    if fused:
        notes.append("fused_ops: the names the fused kernels' attr parser takes (the bias, then "
                     "at most one activation); it refuses any other name at kernel construction "
                     "(Unimplemented)")
    notes.extend(pass_notes)
    notes.extend(f"not read: {p}" for p in dict.fromkeys(problems))
    return {
        "plugin": DIST,
        "version": re.search(r"^Version:\s*(\S+)", meta, re.M).group(1),
        "source_sha256": hashlib.sha256(sdist.read_bytes()).hexdigest(),
        "tensorflow": texts.get("TF_SUPPORTED_VERSION", "").strip(),
        "tensorflow_requires": requires[0] if requires else None,
        "kernel_registrations": len(registrations),
        "ops": {op: sorted(values[op] or ()) for op in sorted(values)},
        "type_constraints": {op: {a: sorted(d) for a, d in sorted(constraints[op].items())}
                             for op in sorted(constraints)},
        "fused_ops": fused,
        "graph_pass_fused_ops": pass_lists,
        "host_only_before": {FIXED_IN: host_only} if host_only else {},
        "notes": notes,
    }


def dumps(obj, indent: int = 0) -> str:
    """JSON with one op a line: lists of scalars and small dicts of them stay on one line."""
    pad, inner = " " * indent, " " * (indent + 2)
    flat = json.dumps(obj)
    if len(flat) + indent <= 98 and (not isinstance(obj, (dict, list)) or indent):
        return flat
    if isinstance(obj, dict):
        items = [f"{inner}{json.dumps(k)}: {dumps(v, indent + 2)}" for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + f"\n{pad}}}" if items else "{}"
    if isinstance(obj, list) and obj:
        return "[\n" + ",\n".join(inner + dumps(v, indent + 2) for v in obj) + f"\n{pad}]"
    return flat


def summary(table: dict) -> str:
    """A few lines on what ``table`` holds."""
    ops = table["ops"]
    by_dtype: dict[str, int] = {}
    for dtypes in ops.values():
        for d in dtypes or ["(unconstrained)"]:
            by_dtype[d] = by_dtype.get(d, 0) + 1
    lines = [
        f"{table['plugin']} {table['version']} (sha256 {table['source_sha256'][:16]}...), "
        f"built against TensorFlow {table['tensorflow']} ({table['tensorflow_requires']})",
        f"{len(ops)} ops in {table['kernel_registrations']} kernel registrations; ops per "
        "value dtype: " + ", ".join(f"{d} {n}" for d, n in sorted(by_dtype.items())),
    ]
    for op, lists in table["fused_ops"].items():
        lines.append(f"{op}: " + "; ".join("+".join(x) for x in lists))
    for before, host in table["host_only_before"].items():
        lines.append(f"registered only from TensorFlow {before} on ({len(host)}; "
                     f"{len(ops) - len(host)} ops before it): " + ", ".join(host))
    unread = [n for n in table["notes"] if n.startswith("not read:")]
    lines.append(f"{len(table['notes'])} notes, {len(unread)} about source not read")
    return "\n".join(lines + unread)


def download_command(version: str, into: Path) -> list[str]:
    """pip's command that downloads the sdist of ``version`` into ``into`` (its metadata is
    prepared with the setuptools installed here: the plugin's setup.py needs nothing else for
    that)."""
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
            "--no-build-isolation", f"{DIST}=={version}", "-d", str(into)]


def download(version: str, into: Path) -> Path:
    """The sdist of ``version``, downloaded by pip into ``into``."""
    subprocess.run(download_command(version, into), check=True, stdout=subprocess.DEVNULL)
    found = sorted(into.glob("*.tar.gz"))
    if not found:
        raise SystemExit(f"pip downloaded no sdist of {DIST}=={version}")
    return found[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sdist", nargs="?", type=Path, help=f"the {DIST} .tar.gz")
    parser.add_argument("--version", help="download this version's sdist with pip instead")
    parser.add_argument("--output", type=Path,
                        help="where to write (default tfmx/data/tensorflow-metal-plugin-"
                             "<version>.json)")
    args = parser.parse_args(argv)
    if (args.sdist is None) == (args.version is None):
        parser.error("give the sdist's path or --version")
    with tempfile.TemporaryDirectory() as tmp:
        sdist = args.sdist or download(args.version, Path(tmp))
        table = build(sdist)
    output = args.output or ROOT / "tfmx" / "data" / f"{DIST}-{table['version']}.json"
    output.write_text(dumps(table) + "\n")
    print(summary(table))
    print(f"wrote {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Families: the one registry of what tfmx fuses, each family one declared object.

A :class:`Family` is what users name in ``tfmx.enable(patterns=[...], exclude=[...])``. It has
a graph pass (a function from a :class:`~fusion.graph.GraphView` to itself, run on the traced
step's GraphDef after differentiation, written as rules: :mod:`fusion.rule`), stage hooks
(Keras methods routed while the step is traced, before differentiation: :mod:`fusion.stage`),
or both. A stage family's emitted units are found in the traced graph and reported by one
generic observer (:class:`Forms`: the name scope its forms are emitted under and the ops that
show each form's kernel), not by a pass of its own.

The pipeline's order comes from the declarations: each family names the families it runs
after (``after``, ``"*"``: after every family that does not itself run after this one) and
says why (``order``); :func:`families` sorts them so, ties broken by declaration order (the
built-in families first, then any a user or a test declares).

Example:
    >>> from fusion import family
    >>> names = [f.name for f in family.families()]
    >>> names.index("reshaped_bias") < names.index("contraction") < names.index("conv_bn_fold")
    True
    >>> names[-2:]
    ['dedupe', 'onednn']
    >>> family.resolve(None, exclude=["onednn"])[-1]
    'dedupe'
"""

from __future__ import annotations

import dataclasses
import importlib
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from fusion.graph import GraphView
from fusion.pattern import PassFn, RewriteContext
from fusion.platform import Platform

BUILT_IN = ("fusion.graphs", "fusion.calls")
"""The packages whose modules declare the built-in families (imported on first need)."""

GRADIENT_SCOPES = ("gradient_tape/", "gradients/")

OBSERVED_AFTER = ("contraction",)
OBSERVED_ORDER = ("it observes the stage's units with their kernels as the contraction family "
                  "left them (a MatMul may be a _FusedMatMul by then)")
"""Where an observed stage family's observer runs, and why."""


@dataclasses.dataclass(frozen=True)
class Form:
    """One form a stage family emits in place of Keras's call, or Keras's call itself (the
    ``conservative`` form): its ``name`` (unique in the family: the tuner's and the tuning
    cache's name for it), its ``label`` (the report counts a call rewritten to it under it;
    for the conservative form, the words the report uses when a call keeps it), the ``marks``
    (ops, one of which is its kernel: how its units show in a traced graph; none: the
    family's own graph pass finds them), the ``emits`` (the ops it emits in the call's compute
    dtype, ``"Op:float32"`` for one in a fixed dtype, that a backend's kernel table decides:
    a target without one of them never gets the form) and ``build`` (what the family calls to
    emit it, where it is one function; its arguments are the family's).

    >>> fast = Form("fast path", "x: the fast form", marks=frozenset({"MatMul"}))
    >>> fast.scope_name("tfmx_x")
    'tfmx_x_fast_path'
    >>> fast.extended(" row", "x: the fast form, one row more", frozenset({"ConcatV2"})).name
    'fast path row'
    """

    name: str
    label: str
    marks: frozenset[str] = frozenset()
    emits: frozenset[str] = frozenset()
    build: Callable[..., Any] | None = dataclasses.field(default=None, compare=False)
    conservative: bool = False

    def scope_name(self, family_scope: str) -> str:
        """The name scope a unit of this form is emitted under in the family's
        ``family_scope``."""
        return f"{family_scope}_{self.name.replace(' ', '_')}"

    def extended(self, suffix: str, label: str, emits: frozenset[str] = frozenset(),
                 build: Callable[..., Any] | None = None) -> Form:
        """This form with one more step (a contributed product, ``fusion.forms.AffineForm``):
        named ``name + suffix``, reported under ``label``, its marks this form's, emitting this
        form's ops and ``emits``."""
        return Form(self.name + suffix, label, self.marks, self.emits | emits, build)


def conservative(name: str, kept: str) -> Form:
    """The form that is Keras's own call: the tuner keeps it unless another measures faster,
    the report says ``"<call>: <kept> kept: measured faster"``.

    >>> conservative("composite", "Keras's composite").conservative
    True
    """
    return Form(name, kept, conservative=True)


@dataclasses.dataclass(frozen=True)
class Forms:
    """The forms of a stage family: the name ``scope`` each is emitted under (a form's
    :meth:`Form.scope_name`; empty: the family's own graph pass names its units), the family's
    own ``declared`` forms (one of them conservative: what Keras runs), and where another
    module contributes forms to the family's (``fusion.forms.AffineForm``), the contributed
    ones as they are when read (``contributed(forms)``, given the declared forms).

    >>> from tensorflow.core.framework.node_def_pb2 import NodeDef
    >>> forms = Forms("tfmx_x", (conservative("composite", "Keras's composite"),
    ...                          Form("fast", "x: fast", marks=frozenset({"MatMul"}))))
    >>> forms.conservative.name, forms["fast"].label
    ('composite', 'x: fast')
    >>> [(unit, form.name) for unit, form in forms.units(GraphView([
    ...     NodeDef(name="a/tfmx_x_fast/m", op="MatMul"),
    ...     NodeDef(name="gradients/tfmx_x_fast/m", op="MatMul")]))]
    [('a/tfmx_x_fast/', 'fast')]
    """

    scope: str
    declared: tuple[Form, ...]
    contributed: Callable[[tuple[Form, ...]], tuple[Form, ...]] | None = dataclasses.field(
        default=None, compare=False)

    def __post_init__(self) -> None:
        names = [form.name for form in self.declared]
        if len(set(names)) != len(names):
            raise ValueError(f"forms {names}: a name given twice")
        if sum(form.conservative for form in self.declared) < 1:
            raise ValueError(f"forms {names}: none is conservative (Keras's own call)")

    def all(self) -> tuple[Form, ...]:
        """Every form: the declared ones, then the contributed ones."""
        extra = self.contributed(self.declared) if self.contributed is not None else ()
        return self.declared + tuple(extra)

    def __getitem__(self, name: str) -> Form:
        for form in self.all():
            if form.name == name:
                return form
        raise KeyError(name)

    def __contains__(self, name: object) -> bool:
        return any(form.name == name for form in self.all())

    @property
    def conservative(self) -> Form:
        """The family's conservative form (the first declared one): what Keras runs."""
        return next(form for form in self.declared if form.conservative)

    def scope_of(self, form: Form) -> str | None:
        """The name scope ``form`` is emitted under, None where the family has no scope."""
        return form.scope_name(self.scope) if self.scope else None

    def units(self, view: GraphView) -> list[tuple[str, Form]]:
        """(scope, form) of every unit the stage emitted in ``view``: a node under one of its
        forms' scopes (or that scope uniquified, ``_<n>``) whose op is one of that form's
        marks; the gradient's copies are not units."""
        marked = {form.scope_name(self.scope): form for form in self.all() if form.marks}
        if not self.scope or not marked:
            return []
        names = "|".join(re.escape(name) for name in sorted(marked, key=len, reverse=True))
        unit = re.compile(r"(?:^|/)(?P<scope>" + names + r")(?:_\d+)?/")
        marks = frozenset().union(*(form.marks for form in marked.values()))
        units: dict[str, Form] = {}
        for node in view.nodes():
            if node.op not in marks:  # no form's mark: no unit, whatever its name
                continue
            found = None if node.name.startswith(GRADIENT_SCOPES) else unit.search(node.name)
            form = marked[found.group("scope")] if found else None
            if form is not None and node.op in form.marks:
                units[node.name[: found.end()]] = form
        return sorted(units.items(), key=lambda item: item[0])

    def observe(self, view: GraphView, ctx: RewriteContext) -> None:
        """The graph pass of an observed family: each unit counted as observed."""
        for _, form in self.units(view):
            ctx.stats.observe(form.label)

    @property
    def observed(self) -> bool:
        """Whether the family's units are found by :meth:`observe` (a scope, and marks)."""
        return bool(self.scope) and any(form.marks for form in self.declared)


@dataclasses.dataclass(frozen=True)
class Family:
    """One family: its name and description, its graph pass, its stage hooks
    (``fusion.stage.Hook``), the forms its stage emits (:class:`Forms`: how they are named,
    observed and reported, the conservative one), the families its graph part
    runs after (``"*"``: every family not after it) and why, and the ops a match of its
    graph pass starts from (``anchors``: where those sit in a function XLA must compile, it
    says it left them to XLA), and what a backend runs for it (``capability``: a
    :class:`~fusion.platform.Platform` -> the family's own dataclass, which its passes and
    stages read back with ``target.capability(ThatClass)``, or None where it runs nothing)."""

    name: str
    description: str
    graph_pass: PassFn | None = None
    hooks: tuple[Any, ...] = ()
    forms: Forms | None = None
    after: tuple[str, ...] = ()
    order: str = ""
    anchors: frozenset[str] = frozenset()
    capability: Callable[[Platform], Any | None] | None = None

    @property
    def run(self) -> PassFn | None:
        """What runs on the traced graph: the graph pass, else the observer, else None."""
        if self.graph_pass is not None:
            return self.graph_pass
        return self.forms.observe if self.forms is not None and self.forms.observed else None


_FAMILIES: dict[str, Family] = {}
_loaded = False


def declare(family: Family) -> Family:
    """Add ``family`` to the registry (a module-level call in the module that defines it); a
    family declared in two parts (a stage and a graph pass) is one family: the parts merge,
    and two parts may not both set the same field.

    >>> from fusion import family as f
    >>> toy = f.declare(f.Family("toy_demo", "a demo", graph_pass=lambda view, ctx: None))
    >>> f.get("toy_demo").run is toy.graph_pass
    True
    >>> f.forget("toy_demo")
    """
    known = _FAMILIES.get(family.name)
    if known is not None:
        family = _merged(known, family)
    _FAMILIES[family.name] = family
    return family


def _merged(known: Family, part: Family) -> Family:
    blank = Family(known.name, "")
    changes = {}
    for field in dataclasses.fields(Family):
        new, old = getattr(part, field.name), getattr(known, field.name)
        if field.name in ("name", "description") or new == getattr(blank, field.name):
            continue
        if old != getattr(blank, field.name) and old != new:
            raise ValueError(f"family {known.name!r}: {field.name} declared twice")
        changes[field.name] = new
    if part.description and part.description not in known.description:
        changes["description"] = "; ".join(filter(None, (known.description, part.description)))
    return dataclasses.replace(known, **changes)


def register(name: str, description: str, *, after: tuple[str, ...] = (), order: str = "",
             anchors: frozenset[str] = frozenset()) -> Callable[[PassFn], PassFn]:
    """Declare the graph pass of family ``name`` (decorator): its description, the families
    it runs after and why (``after``, ``order``), the ops its matches start from.

    >>> @register("toy_pass", "a demo pass", after=("contraction",), order="reads its output")
    ... def toy(view, ctx):
    ...     pass
    >>> names = [f.name for f in families()]
    >>> names.index("contraction") < names.index("toy_pass"), get("toy_pass").run is toy
    (True, True)
    >>> forget("toy_pass")
    """

    def wrap(fn: PassFn) -> PassFn:
        declare(Family(name, description, graph_pass=fn, after=tuple(after), order=order,
                       anchors=frozenset(anchors)))
        return fn

    return wrap


def passes(names: Iterable[str] | str | None = None) -> list[Family]:
    """The families named (all when None) that run on the traced graph (a graph pass or an
    observed stage), in pipeline order; ValueError on an unknown name.

    >>> [f.name for f in passes(["contraction"])]
    ['contraction']
    """
    chosen = resolve(names)
    return [f for f in families() if f.run is not None and (chosen is None or f.name in chosen)]


def forget(name: str) -> None:
    """Remove family ``name`` from the registry (a family a test declared)."""
    _FAMILIES.pop(name, None)


def _load() -> None:
    global _loaded
    if not _loaded:
        _loaded = True
        for package in BUILT_IN:
            importlib.import_module(package)


def get(name: str) -> Family:
    """The family called ``name`` (KeyError if none)."""
    _load()
    return _FAMILIES[name]


def families() -> list[Family]:
    """Every declared family, in pipeline order (see the module doc).

    >>> [f.name for f in families()][:1] != []
    True
    """
    _load()
    return [_FAMILIES[name] for name in _ordered(_FAMILIES)]


def _ordered(declared: Mapping[str, Family]) -> list[str]:
    names = list(declared)
    edges: dict[str, set[str]] = {n: set() for n in names}  # n -> what must run before n
    for name, fam in declared.items():
        edges[name].update(a for a in fam.after if a in declared)
    for name, fam in declared.items():
        if "*" in fam.after:
            later = _descendants(name, edges)
            edges[name].update(n for n in names if n != name and n not in later)
    order: list[str] = []
    done: set[str] = set()
    while len(order) < len(names):
        ready = [n for n in names if n not in done and edges[n] <= done]
        if not ready:
            stuck = sorted(set(names) - done)
            raise ValueError(f"the families' order declarations form a cycle among {stuck}")
        order.append(ready[0])
        done.add(ready[0])
    return order


def _descendants(name: str, edges: Mapping[str, set[str]]) -> set[str]:
    """The families that run after ``name`` by the explicit declarations."""
    found: set[str] = set()
    frontier = {name}
    while frontier:
        frontier = {n for n, before in edges.items() if before & frontier} - found
        found |= frontier
    return found


def resolve(names: Iterable[str] | str | None,
            exclude: Iterable[str] | str | None = None) -> tuple[str, ...] | None:
    """The families ``names`` (all when None) without ``exclude``, in pipeline order; None
    when that is every family. ValueError on a name no family has.

    >>> resolve(["onednn", "contraction"])
    ('contraction', 'onednn')
    >>> resolve(None) is None
    True
    >>> try:
    ...     resolve(["contraktion"])
    ... except ValueError as e:
    ...     print(str(e).split(";")[0])
    unknown family 'contraktion' (did you mean 'contraction'?)
    """
    known = [f.name for f in families()]
    chosen = list(known) if names is None else _names(names)
    dropped = _names(exclude)
    for name in chosen + dropped:
        if name not in known:
            raise ValueError(_unknown(name, known))
    picked = tuple(n for n in known if n in chosen and n not in dropped)
    return None if picked == tuple(known) else picked


def _names(names: Iterable[str] | str | None) -> list[str]:
    if names is None:
        return []
    return [names] if isinstance(names, str) else list(names)


def _unknown(name: str, known: list[str]) -> str:
    import difflib

    close = difflib.get_close_matches(name, known, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"unknown family {name!r}{hint}; choose from {', '.join(sorted(known))}"


__all__ = ["BUILT_IN", "GRADIENT_SCOPES", "OBSERVED_AFTER", "OBSERVED_ORDER", "Family",
           "Form", "Forms", "conservative", "declare", "families", "forget", "get", "passes",
           "register", "resolve"]

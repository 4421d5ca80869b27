"""MkDocs hook of the documentation site (mkdocs.yml): docstring examples shown as code.

The docstrings hold doctest examples (``>>>`` lines and their output) outside any Markdown code
block; Markdown would read ``>>>`` as nested quotes and ``['float32']`` as a link. This hook
adds a Markdown preprocessor, before mkdocstrings builds its own Markdown from the site's
extensions, that fences each run of lines starting at ``>>>`` (up to the next blank line) as a
``pycon`` block (lines inside fenced blocks are left alone), and writes a Sphinx role
(``:func:`x` ``) as the code span it names.
"""

from __future__ import annotations

import re
from typing import Any

from markdown import Extension
from markdown.preprocessors import Preprocessor
from mkdocs.plugins import event_priority

_FENCE = re.compile(r"^\s*(```|~~~)")
_ROLE = re.compile(r":(?:class|func|mod|data|meth|attr|exc|obj):`~?([^`]+)`")


def fence_doctests(lines: list[str]) -> list[str]:
    """``lines`` with each doctest run (from a line starting ``>>>`` to the next blank line)
    in a fenced ``pycon`` block.

    >>> fence_doctests(["see :func:`f`", ">>> 1 + 1", "2", "", "more"])
    ['see `f`', '', '```pycon', '>>> 1 + 1', '2', '```', '', '', 'more']
    """
    out: list[str] = []
    fenced = False
    run: list[str] = []
    for line in [*lines, ""]:
        if run:
            if line.strip():
                run.append(line)
                continue
            out += ["", "```pycon", *run, "```", ""]
            run = []
        if _FENCE.match(line):
            fenced = not fenced
        elif not fenced and line.startswith(">>>"):
            run = [line]
            continue
        elif not fenced:
            line = _ROLE.sub(r"`\1`", line)
        out.append(line)
    return out[:-1]


class _Doctests(Preprocessor):
    def run(self, lines: list[str]) -> list[str]:
        return fence_doctests(lines)


class DoctestExtension(Extension):
    """The preprocessor, before ``fenced_code`` (priority 25) reads the fences."""

    def extendMarkdown(self, md: Any) -> None:  # noqa: N802 - Markdown's name
        md.preprocessors.register(_Doctests(md), "tfmx_doctests", 30)


@event_priority(100)  # before mkdocstrings copies the site's extensions
def on_config(config: Any) -> Any:
    config.markdown_extensions.append(DoctestExtension())
    return config

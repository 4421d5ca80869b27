"""A pytest plugin for running Keras's own test files: records each test's outcome, and with
``--tfmx`` runs every test with tfmx switched on.

Loaded by name in a child pytest (``-p tfmx_keras_plugin``, this directory on ``PYTHONPATH``;
see ``tests/test_keras_own.py``):

- ``--keras-outcomes PATH``: one JSON line per test, appended as each test finishes (a crash
  of the process leaves the lines written so far): ``{"nodeid", "outcome", "message",
  "seconds"}``, the outcome one of ``passed``, ``failed``, ``skipped``, ``xfailed``,
  ``xpassed``, ``error`` (its setup or teardown raised), the message the last lines of the
  failure or the skip reason, the seconds its setup, call and teardown took.
- ``--tfmx``: an autouse fixture calls ``tfmx.enable()`` (its defaults: what a user gets)
  before each test and ``tfmx.disable()`` after it; the test's line gets a ``"tfmx"`` entry,
  what ``tfmx.report()`` says tfmx did in it (:func:`tfmx_summary`).

Each test file of Keras's source tree (``keras/src/...`` under pytest's rootdir, the unpacked
source distribution) is imported under its own name in the installed package
(``keras.src.layers.rnn.rnn_test``), as in Keras's own checkout: the tests run against the
installed Keras, and what they save names its classes by the module Keras finds them in again.

It imports neither TensorFlow nor tfmx unless ``--tfmx`` is given, so the stock run is Keras's
tests exactly as Keras runs them.
"""

from __future__ import annotations

import importlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("tfmx-keras", "Keras's own tests with and without tfmx")
    group.addoption("--tfmx", action="store_true", default=False,
                    help="call tfmx.enable() before every test and tfmx.disable() after it")
    group.addoption("--keras-outcomes", default=None, metavar="PATH",
                    help="append one JSON line per test (nodeid, outcome, message) to PATH")


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("--tfmx"):
        config.pluginmanager.register(_TfmxEachTest(), "tfmx-each-test")
    path = config.getoption("--keras-outcomes")
    if path is not None:
        config.pluginmanager.register(_Recorder(path), "tfmx-keras-outcomes")


class KerasTestModule(pytest.Module):
    """A test file of Keras's tree, imported as the module of the installed package it belongs
    to: its directory goes first on that package's ``__path__`` for the import (pytest's
    assertion rewriting still applies), then the package is as it was."""

    def _getobj(self) -> Any:
        rel = self.path.relative_to(self.config.rootpath).with_suffix("")
        name = ".".join(rel.parts)
        package = importlib.import_module(name.rpartition(".")[0])
        sys.modules.pop(name, None)  # a copy the installed package imported for another test
        package.__path__.insert(0, str(self.path.parent))
        try:
            module = importlib.import_module(name)
        except ImportError as e:
            raise self.CollectError(
                f"ImportError while importing test module '{self.path}' as {name}:\n"
                f"{type(e).__name__}: {e}") from e
        finally:
            package.__path__.remove(str(self.path.parent))
        self.config.pluginmanager.consider_module(module)
        return module


def pytest_pycollect_makemodule(module_path: Path, parent: pytest.Collector
                                ) -> pytest.Module | None:
    """Keras's test files (under ``keras/src`` of the rootdir) as :class:`KerasTestModule`."""
    try:
        rel = module_path.relative_to(parent.config.rootpath)
    except ValueError:
        return None
    if rel.parts[:2] != ("keras", "src") or module_path.name == "__init__.py":
        return None
    return KerasTestModule.from_parent(parent, path=module_path)


class _TfmxEachTest:
    """Holds the autouse fixture, registered only under ``--tfmx``."""

    @pytest.fixture(autouse=True)
    def _tfmx_enabled(self, request: pytest.FixtureRequest) -> Iterator[None]:
        import tfmx

        tfmx.enable()
        try:
            yield
        finally:
            request.node.user_properties.append(("tfmx", tfmx_summary(tfmx.report(reset=True))))
            tfmx.disable()


def tfmx_summary(report: Any) -> dict[str, Any]:
    """What tfmx did in one test, from its ``tfmx.report()``: functions traced, rewritten,
    chains fused, and the errors its stages and passes recorded (each left its part of the
    graph as it was)."""
    return {"traced": len(report.traces),
            "rewritten": sum(t.status == "rewritten" for t in report.traces),
            "fused": report.fused(),
            "errors": sorted({e for t in report.traces for e in t.errors})}


def _message(report: pytest.TestReport | pytest.CollectReport, lines: int = 12) -> str:
    """The skip reason, or the tail of the failure: its crash line and the last frames."""
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2])
    text = report.longreprtext or ""
    return "\n".join(text.splitlines()[-lines:])


class _Recorder:
    """Folds each test's setup, call and teardown reports into one outcome, written as a JSON
    line once the test has finished."""

    def __init__(self, path: str) -> None:
        self.pending: dict[str, dict[str, Any]] = {}
        self.path = path

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        entry = self.pending.setdefault(report.nodeid,
                                        {"outcome": "", "message": "", "seconds": 0.0})
        entry["seconds"] = round(entry["seconds"] + report.duration, 3)
        entry.update((k, v) for k, v in report.user_properties if k == "tfmx")
        xfail = hasattr(report, "wasxfail")
        if report.when == "call":
            if entry["outcome"] == "error":
                return
            if xfail:
                outcome = "xfailed" if report.skipped else "xpassed"
            else:
                outcome = report.outcome
            entry.update(outcome=outcome,
                         message="" if outcome == "passed" else _message(report))
        elif report.failed:  # setup or teardown raised
            entry.update(outcome="error", message=_message(report))
        elif report.skipped and report.when == "setup":
            entry.update(outcome="xfailed" if xfail else "skipped", message=_message(report))

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        """A file that fails to import reports no test: record the file itself as an error."""
        if report.failed:
            self._write(report.nodeid, {"outcome": "error", "message": _message(report)})

    def pytest_runtest_logfinish(self, nodeid: str, location: Any) -> None:
        entry = self.pending.pop(nodeid, None)
        if entry is not None:
            self._write(nodeid, entry)

    def _write(self, nodeid: str, entry: dict[str, Any]) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"nodeid": nodeid, **entry}) + "\n")

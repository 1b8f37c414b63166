"""Read a run directory back and report on it: ``stepwatch report RUN_DIR``.

Names load on first use: the ``stepwatch`` command imports ``report.cli`` to build its parser,
and that must not pull in numpy and rich for every other subcommand.
"""

from __future__ import annotations

import importlib

_WHERE = {
    "ReportError": "load", "Run": "load", "load_run": "load",
    "Stats": "summary", "Summary": "summary", "compare": "summary", "summarize": "summary",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    mod = _WHERE.get(name)
    if mod is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{mod}", __name__), name)

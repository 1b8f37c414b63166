"""Passing an uncaught exception on from one of stepwatch's ``sys.excepthook`` s (the session's,
for ``run.json``'s ``ended_by``; the memory feature's, for OOM forensics) to the hook it replaced.

Called by a hook installed after stepwatch's that has printed the traceback already -- W&B's
(``wandb.init()`` after ``import stepwatch.auto``; its ``ExitHooks.exc_handler``,
wandb/sdk/lib/exit_hooks.py, prints, then calls the hook it replaced) -- Python's default printer
is not called a second time; a replaced hook that is not the default printer still is. Any other
hook on top may pass the exception on without printing it (sentry_sdk's does): the default
printer runs then, as before -- a traceback twice rather than never.
"""

from __future__ import annotations

import sys
from typing import Any, Callable


def pass_on(own: Callable[..., Any], prev: Callable[..., Any] | None, t: Any, v: Any, tb: Any) -> None:
    """Call ``prev`` (the hook ``own`` replaced; Python's printer when None) with the exception,
    unless it is the printer and a hook known to have printed already called ``own``."""
    prev = prev or sys.__excepthook__
    if prev is sys.__excepthook__ and _printed_by_wrapper(own):
        return
    prev(t, v, tb)


def _printed_by_wrapper(own: Callable[..., Any]) -> bool:
    try:
        top = sys.excepthook
        return top != own and type(getattr(top, "__self__", None)).__module__.split(".")[0] == "wandb"
    except Exception:  # noqa: BLE001 - unsure: print it (twice rather than never)
        return False

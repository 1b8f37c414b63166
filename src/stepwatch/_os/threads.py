"""Starting a thread the interpreter may refuse.

Python 3.12.0-3.12.2 raise ``RuntimeError: can't create new thread at interpreter shutdown`` for a
thread started in an atexit hook (CPython gh-113964, fixed in 3.12.3), and stepwatch's exit
shutdown runs there: its exporters' workers, the straggler exchange's last window and an OTLP
flush each start one to bound a wait. Where the thread is refused, the caller goes on without it
(the work runs on the calling thread, bounded by its own timeouts, or is left off)."""

from __future__ import annotations

import threading


def start(t: threading.Thread) -> bool:
    """Start ``t``: False where the interpreter refuses a new thread."""
    try:
        t.start()
    except RuntimeError:
        if t.ident is not None:  # it did start: a misuse, not a refusal
            raise
        return False
    return True

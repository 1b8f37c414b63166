"""stepwatch's own replays of the user's modules (a FLOP count runs their forward and backward):
their hooks fire during it, and every stepwatch hook must leave it alone.

The flag lives here, in the hooks' layer, so that the hooks need nothing from the features that
replay (``metrics/flops.py`` sets it)."""

from __future__ import annotations

import threading

_STATE = threading.local()


def is_counting() -> bool:
    """True while this thread is replaying a forward/backward to count FLOPs."""
    return getattr(_STATE, "active", False)


def set_counting(active: bool) -> None:
    _STATE.active = active

"""stepwatch's own replays of the user's modules (a FLOP count runs their forward and backward):
their hooks fire during it, and every stepwatch hook must leave it alone.

The flag lives here, in the hooks' layer, so that the hooks need nothing from the features that
replay (``metrics/flops.py`` sets it). Hot paths read ``REPLAY.active`` (an attribute, no call);
it is per thread, False unless this thread is replaying."""

from __future__ import annotations

import threading


class _Replay(threading.local):
    # A class attribute: a thread that never set it reads False without the AttributeError that
    # ``getattr(local, "active", False)`` raises and catches inside (~0.7 us a read).
    active = False


REPLAY = _Replay()


def is_counting() -> bool:
    """True while this thread is replaying a forward/backward to count FLOPs."""
    return REPLAY.active


def set_counting(active: bool) -> None:
    REPLAY.active = active

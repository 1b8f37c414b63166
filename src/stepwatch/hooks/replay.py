"""stepwatch's own replays of the user's modules (a FLOP count runs their forward and backward):
their hooks fire during it, and every stepwatch hook must leave it alone.

The flag lives here, in the hooks' layer, so that the hooks need nothing from the features that
replay (``metrics/flops.py`` sets it). It is per thread: a hook on another thread goes on while
one thread replays. Hot paths read ``REPLAY.active`` first, a plain attribute that is True only
while some thread replays (almost never), and only then ask ``REPLAY.mine()``: a
``threading.local`` attribute costs ~540 instructions a read, and the hooks read it ~4 times a
step."""

from __future__ import annotations

import threading


class _Replay:
    __slots__ = ("active", "_threads", "_lock")

    def __init__(self) -> None:
        self.active = False  # some thread is replaying now
        self._threads: set[int] = set()
        self._lock = threading.Lock()

    def mine(self) -> bool:
        """This thread is replaying."""
        return threading.get_ident() in self._threads


REPLAY = _Replay()


def is_counting() -> bool:
    """True while this thread is replaying a forward/backward to count FLOPs."""
    return REPLAY.active and REPLAY.mine()


def set_counting(active: bool) -> None:
    me = threading.get_ident()
    with REPLAY._lock:
        if active:
            REPLAY._threads.add(me)
        else:
            REPLAY._threads.discard(me)
        REPLAY.active = bool(REPLAY._threads)


def replay_module(cls: type) -> type:
    """Class decorator for stepwatch's own ``nn.Module`` classes (the replay's wrapper, which holds
    the user's model as its child while it runs): the root scan skips them (``is_replay_module``),
    so one is never a root, and the model it holds stays one, even when another thread scans."""
    cls._stepwatch_replay_module = True  # type: ignore[attr-defined]
    return cls


def is_replay_module(module: object) -> bool:
    return getattr(type(module), "_stepwatch_replay_module", False) is True


"""stepwatch's logger and the 'count it, log it once' helper for internal failures."""

from __future__ import annotations

import logging
import threading

logger = logging.getLogger("stepwatch")
if not logger.handlers:
    _h = logging.StreamHandler()
    _h.setFormatter(logging.Formatter("[stepwatch] %(levelname)s: %(message)s"))
    logger.addHandler(_h)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def retried_note(short: bool = False) -> str:
    """What happens to a part that failed but goes on (an exporter: the next batch is tried)."""
    return "tried again with the next batch" if short else "tried again with the next batch; failures counted in run.json"


class FailureLog:
    """Counts internal failures per place; logs the first one of each place with its traceback
    (an ``OSError``, the machine's failure, in one line without it)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counts: dict[str, int] = {}

    def record(self, where: str, exc: BaseException, *, retried: bool = False) -> bool:
        """Count a failure; return True the first time this place fails. ``retried``: the part
        goes on (an exporter gets the next batch), and the log line says so, not "disabled"."""
        with self._lock:
            n = self.counts.get(where, 0) + 1
            self.counts[where] = n
        fate = retried_note(True) if retried else "disabled"
        if n == 1 and isinstance(exc, OSError):
            # The machine's, not stepwatch's: a full disk, a path that is a file, no permission.
            # One line that says which part and why; a traceback would point at stepwatch.
            logger.warning("%s cannot go on (%s; training continues): %s", where, fate, exc)
        elif n == 1:
            logger.warning(
                "internal error in %s (%s; training continues): %s: %s",
                where,
                fate,
                type(exc).__name__,
                exc,
                exc_info=(type(exc), exc, exc.__traceback__),
            )
        return n == 1

    @property
    def total(self) -> int:
        return sum(self.counts.values())


_warned: set[str] = set()
_warned_lock = threading.Lock()


def warn_once(key: str, msg: str, *args: object, level: int = logging.WARNING, log: logging.Logger | None = None) -> bool:
    """Log ``msg`` the first time ``key`` is seen in this process (every part of stepwatch says
    a repeated condition once through here). Returns whether it was logged."""
    with _warned_lock:
        if key in _warned:
            return False
        _warned.add(key)
    (log or logger).log(level, msg, *args)
    return True

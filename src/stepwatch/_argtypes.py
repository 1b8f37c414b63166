"""argparse types the commands share. argparse's message already names the option ("argument
--timeout: ..."): these say what is valid."""

from __future__ import annotations

import argparse
import math
import re
from typing import Any, Callable


def positive(kind: type = float, most: float | None = None) -> Callable[[str], Any]:
    """An int > 0, or a finite float > 0 (``inf`` as a timeout was a traceback, as an SLO an alert
    that can never fire; ``nan`` compares false with everything), and at most ``most`` when given
    (a timeout past what a wait takes: ``dump --timeout 1e9`` was a traceback from ``poll``)."""
    what = "an integer" if kind is int else "a finite number"
    valid = f"{what} > 0" + (f" and <= {most:g}" if most is not None else "")

    def parse(s: str) -> Any:
        try:
            v = kind(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {valid}, got {s!r}") from None
        if kind is float and not math.isfinite(v) or not v > 0 or most is not None and v > most:
            raise argparse.ArgumentTypeError(f"expected {valid}, got {s!r}")
        return v

    return parse


_UID = re.compile(r"[A-Za-z0-9_-]{1,40}")


def grafana_uid(s: str) -> str:
    """A Grafana dashboard uid: 1-40 letters, digits, '-' or '_' (Grafana refuses others)."""
    if not _UID.fullmatch(s):
        raise argparse.ArgumentTypeError(f"expected 1-40 letters, digits, '-' or '_' (Grafana's uid), got {s!r}")
    return s


def non_empty(s: str) -> str:
    if not s.strip():
        raise argparse.ArgumentTypeError(f"expected a non-empty text, got {s!r}")
    return s

"""A table as plain data: the report, the trace analysis and the terminal share it."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Table:
    title: str
    headers: list[str]
    rows: list[list[str]]
    # Per row: "" or a tag the renderers style ("warn", "bad", "good", "critical", "info").
    tags: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # Trailing columns a narrow renderer (the terminal) folds into the column before them.
    fold_last: int = 0

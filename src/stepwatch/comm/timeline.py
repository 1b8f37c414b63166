"""A per-rank timeline of one step: backward compute and each collective, for the report.

Every ``every`` steps the enricher keeps the step's intervals (host clock; gloo) and the session
writes them, overwriting, to ``comm_timeline.rank<R>.json`` in the run directory: one small file
per rank, never growing. ``render`` draws the ranks' files as text lines, one row per rank.
"""

from __future__ import annotations

import json
import os
from typing import Any

from .._files import make_private_dir, read_json_private, say_unwritable, write_private


def snapshot(step: int, rank: int, compute: list[tuple[float, float]], spans: list[Any],
             iv: list[tuple[float, float]]) -> dict[str, Any]:
    """Intervals in ms from the step's first backward start (or first span)."""
    origin = min([a for a, _ in compute] + [a for a, _ in iv]) if (compute or iv) else 0.0
    ms = 1e-6
    return {
        "step": step,
        "rank": rank,
        "compute_ms": [[(a - origin) * ms, (b - origin) * ms] for a, b in compute],
        "comm": [
            {"op": s.op, "start_ms": (a - origin) * ms, "end_ms": (b - origin) * ms, "bytes": s.nbytes}
            for s, (a, b) in zip(spans, iv)
        ],
    }


class TimelineWriter:
    def __init__(self, run_dir: str, every: int) -> None:
        self.run_dir = run_dir
        self.every = every
        self._failed = False

    def want(self, step: int) -> bool:
        return not self._failed and step % self.every == self.every - 1

    def write(self, snap: dict[str, Any]) -> None:
        path = os.path.join(self.run_dir, f"comm_timeline.rank{snap['rank']}.json")
        try:
            make_private_dir(self.run_dir)
            write_private(path, json.dumps(snap))
        except OSError as e:
            self._failed = True
            say_unwritable(self.run_dir, "the comm timeline", e)


def load(run_dir: str) -> list[dict[str, Any]]:
    out = []
    for name in sorted(os.listdir(run_dir)):
        if name.startswith("comm_timeline.rank") and name.endswith(".json"):
            try:
                out.append(read_json_private(os.path.join(run_dir, name)))
            except (OSError, ValueError):
                continue
    return sorted(out, key=lambda d: d["rank"])


def render(snaps: list[dict[str, Any]], width: int = 72) -> str:
    """One row per rank: '=' backward compute, '#' comm overlapped with it, '!' exposed comm."""
    if not snaps:
        return ""
    end = max([b for s in snaps for _, b in s["compute_ms"]] + [c["end_ms"] for s in snaps for c in s["comm"]] + [1e-9])
    scale = width / end
    lines = [f"one step per rank (0 .. {end:.1f} ms; '=' backward compute, '#' comm behind compute, '!' exposed comm)"]
    for s in snaps:
        row = [" "] * width
        for a, b in s["compute_ms"]:
            for i in range(int(a * scale), min(width, max(int(b * scale), int(a * scale) + 1))):
                row[i] = "="
        for c in s["comm"]:
            for i in range(int(c["start_ms"] * scale), min(width, max(int(c["end_ms"] * scale), int(c["start_ms"] * scale) + 1))):
                row[i] = "#" if row[i] in ("=", "#") else "!"
        lines.append(f"rank {s['rank']:>4} step {s['step']:>6} |{''.join(row)}|")
    return "\n".join(lines)

"""Read a run directory back: manifest, per-rank step records and findings.

The files are JSON Lines written while the job ran, so a crash can leave half a line at the end
of a file. Such lines are skipped and counted, never fatal: a report of a crashed run is the one
a user needs most.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Any

from ..record import STEP_FIELDS, Finding, StepRecord

# steps.rank<R>.jsonl, steps.rank<R>.<K>.jsonl (attempt K after an elastic restart), and the
# rotated older segments of either, suffixed .<N>.
_FILE_RE = re.compile(r"^(steps|findings)\.rank(\d+)(?:\.(\d+))?\.jsonl(?:\.(\d+))?$")
# run.json, or run.<K>.json when a second launch reused the run id (the writer never overwrites).
_MANIFEST_RE = re.compile(r"^run(?:\.(\d+))?\.json$")
# Each rank's own line of the manifest: host, pid, attempt.
_RANK_INFO_RE = re.compile(r"^rank(\d+)\.json$")

_NUMERIC = frozenset(
    (
        "time", "step_s", "data_wait_s", "forward_s", "backward_s", "optimizer_s", "other_s",
        "eval_s", "checkpoint_s", "mem_peak_bytes", "flops", "mfu", "hfu", "tokens", "grad_norm",
        "comm_s", "comm_exposed_s", "overlap", "allreduce_s", "peak_tflops",
    )
)
_FIELDS = frozenset(STEP_FIELDS)
# Fields the writer always fills; a line that lacks one is from an older or foreign writer, and
# the dataclass default (0.0) would pass for a measurement. Unknown stays None.
_PHASE_DEFAULTS_TO_NONE = ("step_s", "data_wait_s", "forward_s", "backward_s", "optimizer_s",
                           "other_s", "eval_s", "checkpoint_s")


class ReportError(Exception):
    """A run directory that cannot be reported; the message names the path."""


@dataclass(slots=True)
class Run:
    path: str
    manifest: dict[str, Any] | None
    records: dict[int, list[StepRecord]]  # rank -> records ordered by time
    findings: list[Finding]  # ordered by time
    bad_lines: int = 0
    bad_lines_by_file: dict[str, int] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)
    attempts: dict[int, list[int]] = field(default_factory=dict)  # rank -> attempts seen
    manifest_error: str | None = None
    manifest_name: str | None = None  # run.json, or run.<K>.json after a relaunch
    rank_info: dict[int, dict[str, Any]] = field(default_factory=dict)  # from rank<R>.json

    @property
    def name(self) -> str:
        if self.manifest and isinstance(self.manifest.get("run_id"), str):
            return self.manifest["run_id"]
        return os.path.basename(os.path.normpath(self.path)) or self.path

    @property
    def ranks(self) -> list[int]:
        return sorted(self.records)


def _is_num(v: Any) -> bool:
    # json gives exactly int or float (bool is its own type); v - v is 0 only when v is finite.
    t = type(v)
    return t is int or (t is float and v - v == 0.0)


# The records writer spells non-finite floats as strings (JSON has no NaN); json.dumps's own NaN
# and Infinity literals parse to floats already.
_NONFINITE = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}
# A non-finite loss or gradient norm is the news (divergence, overflow), not an unknown.
_KEEP_NONFINITE = frozenset(("grad_norm",))


def _value(v: Any) -> float | None:
    """A number, non-finite included, or None."""
    t = type(v)
    if t is int or t is float:
        return v
    return _NONFINITE.get(v) if t is str else None


def _num_map(v: Any) -> dict[str, float]:
    if type(v) is not dict:
        return {}
    out = {}
    for a, b in v.items():
        if (x := _value(b)) is not None:
            out[a] = x
    return out


def _parse_step(d: Any, file_rank: int) -> StepRecord | None:
    if type(d) is not dict or not (_is_num(d.get("step")) and _is_num(d.get("time"))):
        return None
    kw: dict[str, Any] = dict.fromkeys(_PHASE_DEFAULTS_TO_NONE)
    # One pass over the line: 200,000 steps x ranks makes this loop the report's hot spot.
    for k, v in d.items():
        if k in _NUMERIC:
            t = type(v)
            # A NaN, an infinity or a string where a number belongs: unknown, not a crash.
            if v is None or t is int or (t is float and v - v == 0.0):
                kw[k] = v
            else:
                kw[k] = _value(v) if k in _KEEP_NONFINITE else None
        elif k in _FIELDS:
            kw[k] = v
    if type(kw.get("rank")) is not int:
        kw["rank"] = file_rank
    kw["step"] = int(kw["step"])
    kw["phases"] = _num_map(kw.get("phases"))
    kw["scalars"] = _num_map(kw.get("scalars"))
    kw["skipped"] = bool(kw.get("skipped", False))
    return StepRecord(**kw)


def _parse_finding(d: Any, file_rank: int) -> Finding | None:
    if not isinstance(d, dict) or not isinstance(d.get("kind"), str):
        return None
    kw = {
        "time": d["time"] if _is_num(d.get("time")) else 0.0,
        "step": d["step"] if isinstance(d.get("step"), int) else None,
        "rank": d["rank"] if isinstance(d.get("rank"), int) else file_rank,
        "kind": d["kind"],
        "severity": str(d.get("severity") or "info"),
        "summary": str(d.get("summary") or ""),
        "diagnosis": str(d.get("diagnosis") or ""),
        "action": str(d.get("action") or ""),
        "data": d["data"] if isinstance(d.get("data"), dict) else {},
    }
    return Finding(**kw)


def _read_jsonl(path: str, parse, file_rank: int) -> tuple[list, int]:
    out, bad = [], 0
    # errors="replace": a torn multi-byte character at a crash must not lose the whole file.
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                obj = parse(json.loads(line), file_rank)
            except (ValueError, TypeError):
                obj = None
            if obj is None:
                bad += 1
            else:
                out.append(obj)
    return out, bad


def _hint_for(path: str, names: list[str]) -> str:
    subs = sorted(
        n for n in names
        if os.path.isdir(os.path.join(path, n))
        and any(_FILE_RE.match(x) for x in _safe_listdir(os.path.join(path, n)))
    )
    if subs:
        shown = ", ".join(subs[:5]) + (", ..." if len(subs) > 5 else "")
        return f"; it holds run directories ({shown}): pass one of them"
    return ""


def _safe_listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def _read_json(path: str) -> dict[str, Any] | None:
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except (OSError, ValueError):
        return None
    return obj if isinstance(obj, dict) else None


def _read_manifest(path: str, names: list[str]) -> tuple[dict | None, str | None, str | None]:
    """The latest launch's manifest: ``run.json``, or ``run.<K>.json`` with the highest K."""
    found = sorted(
        ((int(m.group(1) or 0), n) for n in names if (m := _MANIFEST_RE.match(n))), reverse=True
    )
    if not found:
        return None, None, None
    name = found[0][1]
    obj = _read_json(os.path.join(path, name))
    if obj is None:
        return None, name, f"{name} is unreadable or not a JSON object"
    return obj, name, None


def _read_rank_info(path: str, names: list[str]) -> dict[int, dict[str, Any]]:
    out = {}
    for n in names:
        if (m := _RANK_INFO_RE.match(n)) and (obj := _read_json(os.path.join(path, n))):
            out[int(m.group(1))] = obj
    return out


def load_run(path: str) -> Run:
    """Load every record file of a run directory. Raises ``ReportError`` naming the path."""
    if not os.path.exists(path):
        raise ReportError(f"run directory {path!r} does not exist")
    if not os.path.isdir(path):
        raise ReportError(f"run directory {path!r} is not a directory")
    try:
        names = sorted(os.listdir(path))
    except OSError as e:
        raise ReportError(f"run directory {path!r} cannot be read: {e.strerror}") from None

    matched = [(n, m) for n in names if (m := _FILE_RE.match(n))]
    if not matched:
        raise ReportError(
            f"run directory {path!r} has no steps.rank<R>.jsonl or findings.rank<R>.jsonl files"
            + _hint_for(path, names)
        )

    manifest, manifest_name, manifest_error = _read_manifest(path, names)
    run = Run(path=path, manifest=manifest, records={}, findings=[], manifest_error=manifest_error,
              manifest_name=manifest_name, rank_info=_read_rank_info(path, names))
    attempts: dict[int, set[int]] = {}
    for name, m in matched:
        kind, rank, attempt = m.group(1), int(m.group(2)), int(m.group(3) or 0)
        fpath = os.path.join(path, name)
        parse = _parse_step if kind == "steps" else _parse_finding
        try:
            items, bad = _read_jsonl(fpath, parse, rank)
        except OSError as e:
            raise ReportError(f"cannot read {fpath!r}: {e.strerror}") from None
        run.files.append(name)
        if bad:
            run.bad_lines += bad
            run.bad_lines_by_file[name] = bad
        if kind == "steps":
            attempts.setdefault(rank, set()).add(attempt)
            for r in items:
                run.records.setdefault(r.rank, []).append(r)
        else:
            run.findings.extend(items)
    for recs in run.records.values():
        # Stable: records written in the same clock tick keep their file order.
        recs.sort(key=lambda r: r.time)
    run.findings.sort(key=lambda f: f.time)
    run.attempts = {r: sorted(a) for r, a in attempts.items()}
    return run

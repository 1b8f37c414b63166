"""Read a run directory back: manifest, per-rank step records and findings.

The files are JSON Lines written while the job ran, so a crash can leave half a line at the end
of a file. Such lines are skipped and counted, never fatal: a report of a crashed run is the one
a user needs most.

Step records are read line by line into columns (``columns.RankColumns``, built by ``ingest``):
a long job's records would not fit in memory as one object each.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable

from .._files import RANK_FILE_RE, READ_MAX_BYTES, job_dir
from ..record import Finding
from .columns import RankColumns
from .ingest import RankBuilder, _is_num, add_step

# steps.rank<R>.jsonl, steps.rank<R>.<K>.jsonl (attempt K after an elastic restart), and the
# rotated older segments of either, suffixed .<N>.
_FILE_RE = re.compile(r"^(steps|findings)\.rank(\d+)(?:\.(\d+))?\.jsonl(?:\.(\d+))?$")
# The hang watchdog sidecar's own findings (watchdog/sidecar.py): the trainer's pipeline copies
# them into findings.rank<R>.jsonl within a second, unless the trainer ends first (the hang's
# ``exit`` action, a scheduler's SIGTERM right after the dump): then they are only here.
_WATCHDOG_RE = re.compile(r"^findings\.watchdog\.rank(\d+)\.jsonl$")
# run.json, or run.<K>.json when a second launch reused the run id (the writer never overwrites).
_MANIFEST_RE = re.compile(r"^run(?:\.(\d+))?\.json$")
# Each rank's own line of the manifest: host, pid, attempt.
# rank<R>.<K>.json: a relaunch, or another job in the same directory (never overwritten).


class ReportError(Exception):
    """A run directory that cannot be reported; the message names the path."""


@dataclass(slots=True)
class Run:
    path: str
    manifest: dict[str, Any] | None
    columns: dict[int, RankColumns]  # rank -> its records as columns, ordered by time
    findings: list[Finding]  # ordered by time
    bad_lines: int = 0
    bad_lines_by_file: dict[str, int] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)
    attempts: dict[int, list[int]] = field(default_factory=dict)  # rank -> attempts seen
    manifest_error: str | None = None
    manifest_name: str | None = None  # run.json, or run.<K>.json after a relaunch
    rank_info: dict[int, dict[str, Any]] = field(default_factory=dict)  # from rank<R>.json
    # Every launch's ranks that did not end with a shutdown: (attempt, rank, how), from all the
    # rank<R>[.<K>].json files ("how" is the rank's ended_by, or None: no end written).
    rank_ends: list[tuple[int, int, str | None]] = field(default_factory=list)
    # What a reader must know about the files: wrong-typed manifest fields ignored, steps rotated
    # out, two jobs that wrote into one directory at once.
    notes: list[str] = field(default_factory=list)
    concurrent: bool = False  # two launches' files overlap in time: not an elastic restart
    # Launches into this directory (run.json, run.1.json, ...) and the first one's start_time
    # (the step figures cover every launch; the manifest read is the last one's).
    launches: int = 1
    first_start: float | None = None

    @property
    def name(self) -> str:
        if self.manifest and isinstance(self.manifest.get("run_id"), str):
            return self.manifest["run_id"]
        return os.path.basename(os.path.normpath(self.path)) or self.path

    @property
    def ranks(self) -> list[int]:
        return sorted(self.columns)


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


class _Skipped(Exception):
    """A file named like one the report reads that is no regular file; ``str()``: the note."""


# What the report reads must be a regular file: a FIFO named like a records file blocked the
# report forever in open(), and a link to /dev/zero was read until memory ran out. A link to a
# regular file is read like that file: a run directory gathered from the nodes' disks with links
# (or kept by a data tool that stores files as links) is the user's own doing, and the report
# writes nothing through it; where the link points must still be a regular file.
_NOT_REGULAR = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                (stat.S_ISDIR, "a directory"), (stat.S_ISSOCK, "a socket"))


def _refuse(path: str, mode: int) -> _Skipped:
    kind = next((name for test, name in _NOT_REGULAR if test(mode)), "not a file")
    link = ", through a link" if os.path.islink(path) else ""
    return _Skipped(f"{os.path.basename(path)}: not a regular file ({kind}{link}): skipped")


def _open_regular(path: str) -> int:
    """A read-only fd of ``path``, which must be a regular file (``_Skipped`` otherwise, and for
    a link to nothing: a node's disk not mounted where the link points)."""
    try:
        st = os.stat(path)  # before the open: opening a device can act (a tape rewinds, a line hangs up)
    except FileNotFoundError:
        if not os.path.islink(path):
            raise
        raise _Skipped(f"{os.path.basename(path)}: a link to {os.readlink(path)!r}, which does not exist: "
                       "skipped") from None
    if not stat.S_ISREG(st.st_mode):
        raise _refuse(path, st.st_mode)
    # O_NONBLOCK: a FIFO put there after the stat does not block the open; fstat then refuses it.
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise _refuse(path, mode)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


# The longest line taken as one, in characters. A step record is a few hundred bytes, one with
# thousands of logged scalars a few hundred KB. A longer "line" is no record (the NULs a crash
# leaves where the file system had not written the blocks yet, a file that is not JSON Lines):
# it is skipped in pieces of this size, never held whole (read whole, it took twice its size).
LINE_MAX_CHARS = 16 << 20


def _read_jsonl(path: str, take: Callable[[Any], bool]) -> int:
    """Hand each line's JSON to ``take``, one line at a time; returns the lines it refused.
    ``_Skipped`` when ``path`` is no regular file."""
    bad = 0
    # errors="replace": a torn multi-byte character at a crash must not lose the whole file.
    with open(_open_regular(path), encoding="utf-8", errors="replace") as f:
        readline = f.readline
        while line := readline(LINE_MAX_CHARS):
            if len(line) == LINE_MAX_CHARS and line[-1] != "\n":
                while (more := readline(LINE_MAX_CHARS)) and more[-1] != "\n":
                    pass
                bad += 1
                continue
            if not line.strip():
                continue
            try:
                ok = take(json.loads(line))
            except (ValueError, TypeError, RecursionError):  # RecursionError: nested too deep
                ok = False
            if not ok:
                bad += 1
    return bad


def _take_finding(into: list[Finding], d: Any, file_rank: int) -> bool:
    f = _parse_finding(d, file_rank)
    if f is not None:
        into.append(f)
    return f is not None


def _hint_for(path: str, names: list[str]) -> str:
    subs = sorted(
        n for n in names
        if os.path.isdir(os.path.join(path, n))
        and any(_FILE_RE.match(x) for x in _safe_listdir(os.path.join(path, n)))
    )
    if subs:
        shown = ", ".join(subs[:5]) + (", ..." if len(subs) > 5 else "")
        return f"; it holds run directories ({shown}): pass one of them"
    # A shared run dir that another user's job wrote into (its private-<uid>/, 0700: _files.py).
    mine = f"private-{os.getuid()}"
    theirs = sorted(n for n in names if _PRIVATE_RE.fullmatch(n) and n != mine and os.path.isdir(os.path.join(path, n)))
    if theirs:
        shown = ", ".join(f"{n}/" for n in theirs[:5]) + (", ..." if len(theirs) > 5 else "")
        whose = "another user's run" if len(theirs) == 1 else "other users' runs"
        return f"; {shown} hold{'s' if len(theirs) == 1 else ''} {whose} (private-<uid>): run the report as that user"
    return ""


_PRIVATE_RE = re.compile(r"private-\d+")


def _safe_listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def _read_json(path: str, notes: list[str] | None = None) -> dict[str, Any] | None:
    """A JSON object file of the run directory (a manifest: a few KB), at most ``READ_MAX_BYTES``
    of it; None when it is anything else. A file that is no regular file adds its note to ``notes``."""
    try:
        with os.fdopen(_open_regular(path), "rb") as f:
            data = f.read(READ_MAX_BYTES + 1)
        obj = json.loads(data) if len(data) <= READ_MAX_BYTES else None
    except _Skipped as e:
        if notes is not None:
            notes.append(str(e))
        return None
    except (OSError, ValueError, RecursionError):
        return None
    return obj if isinstance(obj, dict) else None


# The numbers the report shows or computes with, where the writer's values lie. A value outside
# is none the writer wrote (a hand edit, a corrupt file; "start_time": 1e20 crashed time.gmtime)
# and is dropped with a note, like a value of the wrong type.
TIME_MAX = 253402300799  # 9999-12-31 23:59:59 UTC: the last second a four-digit year writes
COUNT_MAX = 2**63 - 1  # beyond any counter of a real job


def is_time(v: Any) -> bool:
    """A wall-clock time (seconds since 1970) that ``time.gmtime`` and a date can show."""
    return type(v) in (int, float) and 0 < v <= TIME_MAX  # NaN compares False, inf is past TIME_MAX


def is_count(v: Any, lo: int = 0, hi: int = COUNT_MAX) -> bool:
    return type(v) is int and lo <= v <= hi


# The manifest's fields: their types, and for a number the range it must lie in (_manifest.py
# writes them); a field of another type or out of range is dropped with a note instead of
# breaking the report.
_NUM, _TIME = (int, float), (int, float, type(None))
_COUNT = (is_count, "a count (0 or more)")
_AT = (is_time, "a time (seconds since 1970, before the year 10000)")
_MANIFEST_TYPES: dict[str, tuple[tuple[type, ...], str, tuple[Callable[[Any], bool], str] | None]] = {
    "schema_version": ((int,), "an integer", _COUNT), "run_id": ((str,), "a string", None),
    "argv": ((list,), "a list", None), "versions": ((dict,), "an object", None),
    # torch's ranks are 32-bit
    "world_size": ((int,), "an integer", (lambda v: is_count(v, 1, 2**31), "a world size (1 .. 2**31)")),
    "hosts": ((list,), "a list", None), "attempt": ((int,), "an integer", _COUNT),
    "start_time": (_TIME, "a number or null", _AT), "end_time": (_TIME, "a number or null", _AT),
    "config": ((dict,), "an object", None),
    "features": ((dict,), "an object", None), "exporters": ((list,), "a list", None),
    "steps": ((int,), "an integer", _COUNT), "dropped_records": ((int,), "an integer", _COUNT),
    "exporter_drops": ((dict,), "an object", None), "internal_errors": ((dict,), "an object", None),
}
_JSON_NAMES = {int: "an integer", float: "a number", str: "a string", list: "a list", dict: "an object",
               type(None): "null", bool: "true/false"}


def _shown(v: Any) -> str:
    """A number out of range as a note shows it: short (a 400-digit integer would fill the table)."""
    if type(v) is int and not -10**15 < v < 10**15:
        return f"an integer of {len(str(abs(v)))} digits"
    return f"{v:.6g}" if type(v) is float else str(v)


def _check_manifest(name: str, obj: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Drop each field of the wrong type or out of range, with a note: the report goes on with the rest."""
    clean, notes = {}, []
    for k, v in obj.items():
        want = _MANIFEST_TYPES.get(k)
        if want is not None and (isinstance(v, bool) or not isinstance(v, want[0])):
            notes.append(f"{name}: {k!r} is {_JSON_NAMES.get(type(v), type(v).__name__)}, not {want[1]}: ignored")
            continue
        if want is not None and want[2] is not None and v is not None and not want[2][0](v):
            notes.append(f"{name}: {k!r} is {_shown(v)}, not {want[2][1]}: ignored")
            continue
        clean[k] = v
    return clean, notes


def _read_manifest(path: str, names: list[str]) -> tuple[dict | None, str | None, str | None]:
    """The latest launch's manifest: ``run.json``, or ``run.<K>.json`` with the highest K."""
    found = sorted(
        ((int(m.group(1) or 0), n) for n in names if (m := _MANIFEST_RE.match(n))), reverse=True
    )
    if not found:
        return None, None, None
    name = found[0][1]
    skipped: list[str] = []
    obj = _read_json(os.path.join(path, name), skipped)
    if obj is None:
        return None, name, skipped[0] if skipped else f"{name} is unreadable or not a JSON object"
    return obj, name, None


def _first_launch(path: str, names: list[str]) -> tuple[int, float | None]:
    """How many launches wrote a manifest here, and the first one's ``start_time`` when several did."""
    found = sorted((int(m.group(1) or 0), n) for n in names if (m := _MANIFEST_RE.match(n)))
    if len(found) < 2:
        return len(found) or 1, None
    start = (_read_json(os.path.join(path, found[0][1])) or {}).get("start_time")
    return len(found), float(start) if is_time(start) else None


def _read_rank_info(path: str, names: list[str], notes: list[str]
                    ) -> tuple[dict[int, dict[str, Any]], list[tuple[int, int, str | None]]]:
    """Each rank's info from its latest launch's file (the highest K), and the ranks of every
    launch that did not end with a shutdown (``Run.rank_ends``; files from before the twenty-ninth
    session carry no end and are not counted)."""
    found = sorted((int(m.group(2) or 0), int(m.group(1)), n) for n in names if (m := RANK_FILE_RE.match(n)))
    out: dict[int, dict[str, Any]] = {}
    ends: list[tuple[int, int, str | None]] = []
    for k, rank, n in found:
        if obj := _read_json(os.path.join(path, n), notes):
            out[rank] = obj
            if "end_time" in obj and (obj.get("end_time") is None or obj.get("ended_by") not in ("shutdown", None)):
                # By the file name's K, as the records' attempts are: an elastic restart and a
                # relaunch each get the next K, while torchrun's count starts at 0 again in every
                # launch (two launches' ends both read "attempt 0").
                how = obj.get("ended_by") if obj.get("end_time") is not None else None
                ends.append((k, rank, str(how) if how is not None else None))
    return out, sorted(ends)


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
    if not matched and (private := job_dir(path)) != path:
        # a shared or foreign run dir: the job wrote into its private subfolder (_files.py)
        return load_run(private)
    if not matched:
        raise ReportError(
            f"run directory {path!r} has no steps.rank<R>.jsonl or findings.rank<R>.jsonl files"
            + _hint_for(path, names)
        )

    manifest, manifest_name, manifest_error = _read_manifest(path, names)
    notes: list[str] = []
    if manifest is not None:
        manifest, notes = _check_manifest(manifest_name or "run.json", manifest)
    run = Run(path=path, manifest=manifest, columns={}, findings=[], manifest_error=manifest_error,
              manifest_name=manifest_name, notes=notes)
    run.rank_info, run.rank_ends = _read_rank_info(path, names, run.notes)
    run.launches, run.first_start = _first_launch(path, names)
    # (rank, launch K) -> [first time, last time, first step, has a rotated segment]
    spans: dict[tuple[int, int], list[Any]] = {}
    attempts: dict[int, set[int]] = {}
    # A line's "rank" decides its rank, not the file name it is in: one builder per rank seen.
    builders: dict[int, RankBuilder] = {}
    skipped: list[str] = []
    for name, m in matched:
        kind, rank, attempt = m.group(1), int(m.group(2)), int(m.group(3) or 0)
        fpath = os.path.join(path, name)
        if kind == "steps":
            span = spans.setdefault((rank, attempt), [math.inf, -math.inf, math.inf, False])
            span[3] = span[3] or m.group(4) is not None
            take = partial(_take_step, builders, span, file_rank=rank)
        else:
            take = partial(_take_finding, run.findings, file_rank=rank)
        try:
            bad = _read_jsonl(fpath, take)
        except _Skipped as e:
            skipped.append(str(e))
            continue
        except OSError as e:
            raise ReportError(f"cannot read {fpath!r}: {e.strerror}") from None
        run.files.append(name)
        if bad:
            run.bad_lines += bad
            run.bad_lines_by_file[name] = bad
        if kind == "steps" and span[0] != math.inf:
            # an attempt with steps: an empty steps file is a process that trained nothing (the
            # launcher of spawned trainers), no restart (its end, if any, is in rank_ends)
            attempts.setdefault(rank, set()).add(attempt)
    if len(skipped) == len(matched):
        raise ReportError(f"run directory {path!r} has no readable record files: " + "; ".join(skipped))
    run.notes.extend(skipped)
    _add_watchdog_findings(run, path, names)
    # Each rank's segments and attempts merged, ordered by time (finish sorts).
    run.columns = {r: b.finish() for r, b in builders.items()}
    run.findings.sort(key=lambda f: f.time)
    run.attempts = {r: sorted(a) for r, a in attempts.items()}
    _note_rotation_and_launches(run, spans, path, names)
    return run


def _add_watchdog_findings(run: Run, path: str, names: list[str]) -> None:
    """The sidecar's findings that the trainer did not copy before it ended (a hang the job was
    ended for: ``stepwatch report`` said "No findings")."""
    def key(f: Finding) -> tuple[Any, ...]:
        return (f.kind, f.rank, f.step, f.summary, round(f.time, 3))

    have = {key(f) for f in run.findings}
    for name in names:
        m = _WATCHDOG_RE.match(name)
        if not m:
            continue
        found: list[Finding] = []
        try:
            bad = _read_jsonl(os.path.join(path, name), partial(_take_finding, found, file_rank=int(m.group(1))))
        except _Skipped as e:
            run.notes.append(str(e))
            continue
        except OSError:
            continue  # the sidecar's file is extra: the report stands without it
        run.files.append(name)
        if bad:
            run.bad_lines += bad
            run.bad_lines_by_file[name] = bad
        for f in found:
            if key(f) not in have:
                have.add(key(f))
                run.findings.append(f)


def _take_step(builders: dict[int, RankBuilder], span: list[Any], d: Any, file_rank: int) -> bool:
    if not add_step(builders, d, file_rank=file_rank):
        return False
    t, step = float(d["time"]), int(d["step"])
    span[0], span[1], span[2] = min(span[0], t), max(span[1], t), min(span[2], step)
    return True


def _note_rotation_and_launches(run: Run, spans: dict[tuple[int, int], list[Any]], path: str,
                                names: list[str]) -> None:
    cfg = (run.manifest or {}).get("config")
    offset = cfg.get("step_offset") if isinstance(cfg, dict) else None
    offset = offset if is_count(offset) else 0
    for (rank, k), (_, _, first, rotated) in sorted(spans.items()):
        if not rotated or first == math.inf:
            continue
        # The writer keeps one rotated segment (<name>.1): a rank that rotated twice lost its
        # oldest steps. Its rank file says how many (since the forty-first session); a job resumed
        # at step 1000 (set_step) lost none of 0-999: run.json's step offset said it had.
        info = f"rank{rank}.json" if not k else f"rank{rank}.{k}.json"
        meta = _read_json(os.path.join(path, info)) if info in names else None
        lost = meta.get("steps_rotated_out") if isinstance(meta, dict) else None
        if is_count(lost):
            if lost:
                run.notes.append(
                    f"rank {rank}: {lost} steps before step {first} were rotated out (the records reached the "
                    "rank's share of STEPWATCH_DISK_BUDGET_MB; raise it to keep more); shown: from step "
                    f"{first}.")
            continue
        # A rank file of an earlier version: known for the first launch, from the configured offset.
        if k == 0 and first > offset:
            run.notes.append(
                f"rank {rank}: steps {offset}-{first - 1} were rotated out (the records reached the "
                "rank's share of STEPWATCH_DISK_BUDGET_MB; raise it to keep more); shown: from step "
                f"{first}.")
    by_rank: dict[int, list[tuple[float, float, int]]] = {}
    for (rank, k), (t0, t1, _, _) in spans.items():
        if t0 != math.inf:
            by_rank.setdefault(rank, []).append((t0, t1, k))
    for rank, launches in sorted(by_rank.items()):
        launches.sort()
        for (_, a_end, a), (b_start, _, b) in zip(launches, launches[1:]):
            if b_start < a_end:  # an elastic restart starts after the attempt before it ended
                run.concurrent = True
                name = lambda k: f"steps.rank{rank}{'' if not k else f'.{k}'}.jsonl"  # noqa: E731
                run.notes.append(
                    f"{name(a)} and {name(b)} were written at the same time: two jobs ran in this "
                    "directory at once (not an elastic restart), and their steps are mixed here. "
                    "Give each job its own STEPWATCH_DIR or STEPWATCH_RUN_ID.")

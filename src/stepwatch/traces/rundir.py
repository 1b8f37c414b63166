"""Trace analyses in a run directory: the capture sections of the report, on-demand requests.

Layout (``<run_dir>/captures/``, written by capture/profiler.py and worker.py):
``capture-<k>-steps<a>-<b>.rank<R>.trace.json.gz`` (the trace), ``....rank<R>.json`` (its
metadata) and ``....rank<R>.analysis.json`` (the summary with its findings). Each rank analyses
its own trace where it wrote it; only these small summaries are joined here, per capture, to say
which rank's GPU idled while the others computed.

On-demand captures (``stepwatch capture RUN_DIR``): the command drops
``<run_dir>/requests/capture-<id>.json`` (``{"id", "steps"}``); rank 0's capture manager takes it
(at most once a second), publishes the capture to every rank through the store like an anomaly
trigger, and answers in ``capture-<id>.taken.json`` (``{"capture", "first_step", "last_step"}``
or ``{"refused"}``). A rank that then does not take capture ``k`` (the job's own profiler runs or
took the capture over, the rank's limits) says why in ``captures/skipped-<k>.rank<R>.json``
(``capture_skips``), so the command tells it at once.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

from .._files import RANK_FILE_RE
from . import ANALYSIS_SUFFIX

REQUESTS = "requests"
_ANALYSIS_RE = re.compile(r"^capture-(\d+)-steps(-?\d+)-(-?\d+)\.rank(\d+)" + re.escape(ANALYSIS_SUFFIX) + "$")
_TRACE_RE = re.compile(r"^(capture-(\d+)-steps-?\d+--?\d+\.rank\d+)\.trace\.json(?:\.gz)?$")
_REQUEST_RE = re.compile(r"^capture-([A-Za-z0-9_-]{1,64})\.json$")
_SKIPPED_RE = re.compile(r"^skipped-(\d+)\.rank(\d+)\.json$")
_META_RE = re.compile(r"^capture-(\d+)-steps(-?\d+)-(-?\d+)\.rank(\d+)\.json$")
MAX_STEPS = 100


def _read(path: str) -> Any:
    """A JSON file of the run dir, or None: never through a link, never from a FIFO (one named like
    a capture's analysis blocked ``stepwatch report`` forever), at most ``READ_MAX_BYTES``."""
    from .._files import read_json_private

    try:
        return read_json_private(path)
    except (OSError, ValueError):
        return None


def capture_analyses(run_dir: str) -> dict[int, list[dict[str, Any]]]:
    """Capture number -> its ranks' summaries (sorted by rank)."""
    d = os.path.join(run_dir, "captures")
    try:
        names = os.listdir(d)
    except OSError:
        return {}
    out: dict[int, list[dict[str, Any]]] = {}
    for n in sorted(names):
        m = _ANALYSIS_RE.match(n)
        if not m:
            continue
        s = _read(os.path.join(d, n))
        if isinstance(s, dict):
            s.setdefault("rank", int(m.group(4)))
            s["_capture"] = {"capture": int(m.group(1)), "first_step": int(m.group(2)), "last_step": int(m.group(3))}
            out.setdefault(int(m.group(1)), []).append(s)
    for v in out.values():
        v.sort(key=lambda s: s["rank"] if isinstance(s.get("rank"), int) else -1)
    return out


def capture_tables(run_dir: str) -> list[Any]:
    """One section per capture: the ranks side by side, each rank's largest gaps, the findings."""
    from ..record import Finding
    from .findings import across_ranks
    from .tables import findings_table, gaps_table, ranks_table

    out = []
    for k, summaries in sorted(capture_analyses(run_dir).items()):
        c = summaries[0]["_capture"]
        reason = next((f["data"].get("reason") for s in summaries for f in s.get("findings", [])
                       if f.get("data", {}).get("reason")), None)
        title = f"Capture {k}: steps {c['first_step']}-{c['last_step']}" + (f" ({reason})" if reason else "")
        out.append(ranks_table(summaries, title))
        for s in summaries:
            if s.get("error"):
                out[-1].notes.append(f"rank {s.get('rank')}: not analysed: {s['error']}")
            elif s.get("gaps"):
                out.append(gaps_table(s))
        fs = [Finding.from_dict(f) for s in summaries for f in s.get("findings", [])]
        fs += across_ranks(summaries, step=c["first_step"], context={"capture": k})
        out.append(findings_table(fs, f"Capture {k}: findings"))
    return out


def skipped_path(captures_dir: str, capture: int, rank: int) -> str:
    """Where a rank says it did not take capture ``capture`` (written by capture/profiler.py)."""
    return os.path.join(captures_dir, f"skipped-{capture}.rank{rank}.json")


def capture_skips(run_dir: str, capture: int) -> list[dict[str, Any]]:
    """The ranks that did not take capture ``capture``, and why (``{"rank", "skipped", "detail"...}``),
    sorted by rank."""
    return _per_rank(run_dir, capture, _SKIPPED_RE)


def capture_metas(run_dir: str, capture: int) -> list[dict[str, Any]]:
    """The metadata the ranks wrote beside their traces of ``capture`` (the steps each one
    recorded, ``cut_short``), sorted by rank."""
    return _per_rank(run_dir, capture, _META_RE)


def highest_capture(captures_dir: str) -> int:
    """The highest capture number any file in ``captures_dir`` holds (a trace, its metadata or
    analysis, a skip note), 0 for none: a later launch into the run dir numbers on from it."""
    try:
        names = os.listdir(captures_dir)
    except OSError:
        return 0
    return max((int(m.group(1 if rx is not _TRACE_RE else 2)) for n in names
                for rx in (_META_RE, _ANALYSIS_RE, _SKIPPED_RE, _TRACE_RE) if (m := rx.match(n))), default=0)


def _per_rank(run_dir: str, capture: int, pattern: "re.Pattern[str]") -> list[dict[str, Any]]:
    d = os.path.join(run_dir, "captures")
    try:
        names = os.listdir(d)
    except OSError:
        return []
    out = []
    for n in sorted(names):
        m = pattern.match(n)
        if not m or int(m.group(1)) != capture:
            continue
        s = _read(os.path.join(d, n))
        if isinstance(s, dict):
            s["rank"] = int(m.group(m.lastindex or 1))
            out.append(s)
    out.sort(key=lambda s: s["rank"])
    return out


# -- on-demand requests ----------------------------------------------------------------------------

def request_dir(run_dir: str) -> str:
    return os.path.join(run_dir, REQUESTS)


def request_capture(run_dir: str, steps: int) -> str:
    """Drop an on-demand request for ``steps`` captured steps (what ``stepwatch capture`` does);
    returns its id, which names the answer file ``capture-<id>.taken.json``."""
    import time
    import uuid

    from .._files import make_private_dir, write_private

    rid = uuid.uuid4().hex[:12]
    d = request_dir(run_dir)
    make_private_dir(d)
    write_private(os.path.join(d, f"capture-{rid}.json"), json.dumps({"id": rid, "steps": steps, "time": time.time()}))
    return rid


def pending_requests(run_dir: str) -> list[tuple[str, int]]:
    """(request id, steps) of requests not yet taken, oldest first (bad files are skipped)."""
    d = request_dir(run_dir)
    try:
        names = sorted(os.listdir(d), key=lambda n: _mtime(os.path.join(d, n)))
    except OSError:
        return []
    out = []
    for n in names:
        m = _REQUEST_RE.match(n)
        if not m or n.endswith(".taken.json"):
            continue
        req = _read(os.path.join(d, n))
        steps = req.get("steps") if isinstance(req, dict) else None
        if isinstance(steps, int) and 1 <= steps <= MAX_STEPS:
            out.append((m.group(1), steps))
    return out


_RUN_RE = re.compile(r"^run(?:\.\d+)?\.json$")  # run.json, and run.<K>.json of a relaunch in the same directory


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True  # someone else's process, or a pid we cannot ask about: count it as running
    return True


def run_ended(run_dir: str) -> str | None:
    """Why no rank of the job in ``run_dir`` can take a request any more, or None when one may.

    Ended when every run manifest (``run.json``, and ``run.<K>.json`` of a relaunch in the same
    directory) has its ``end_time`` (written at the job's shutdown), or when every rank file
    (``rank<R>.json``, ``rank<R>.<K>.json``) names a process of this host that no longer exists
    (a job killed before its shutdown). A rank on another host, or a pid now taken by another
    process, counts as running."""
    try:
        names = os.listdir(run_dir)
    except OSError as e:
        return f"cannot read {run_dir}: {e}"
    ends = []
    for n in sorted(names):
        if _RUN_RE.match(n):
            m = _read(os.path.join(run_dir, n))
            ends.append(m.get("end_time") if isinstance(m, dict) else None)
    if ends and all(isinstance(e, (int, float)) for e in ends):
        import time

        at = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(max(ends)))
        return f"the run in {run_dir} has ended (run.json: end_time {at})"
    import socket

    host = socket.gethostname()
    pids = []
    for n in sorted(names):
        if not RANK_FILE_RE.match(n):
            continue
        m = _read(os.path.join(run_dir, n))
        if not isinstance(m, dict) or m.get("host") != host or not isinstance(m.get("pid"), int):
            return None  # another host's rank (or an unreadable file): it may be running
        if _pid_alive(m["pid"]):
            return None
        pids.append(f"rank {m.get('rank')} pid {m['pid']}")
    if pids:
        return f"the run in {run_dir} has ended: no rank's process is running ({', '.join(pids)})"
    return None


def captures_off(run_dir: str) -> str | None:
    """Why no running job in ``run_dir`` can take a request for a capture, or None when one may.

    Every run manifest not yet ended (``run.json``, ``run.<K>.json``; rank 0 takes the requests)
    says under ``features.capture.captures`` whether its captures are on; a job with them off
    would leave the request lying until ``--timeout``. A manifest without ``features`` (another
    version's) may take it."""
    try:
        names = sorted(n for n in os.listdir(run_dir) if _RUN_RE.match(n))
    except OSError:
        return None
    live = []
    for n in names:
        m = _read(os.path.join(run_dir, n))
        if not isinstance(m, dict) or not isinstance(m.get("features"), dict):
            return None
        if m.get("end_time") is None:
            live.append(n)
            cap = m["features"].get("capture")
            caps = cap.get("captures") if isinstance(cap, dict) else None
            if isinstance(caps, dict) and caps.get("enabled", True):
                return None  # this job takes requests
    if not live:
        return None
    return (f"captures are off in the run in {run_dir} ({', '.join(live)}: no features.capture.captures): start "
            "the job with STEPWATCH_CAPTURE=on (or under `stepwatch run`) to take captures")


def analyses_pending(run_dir: str, capture: int) -> bool:
    """Whether a rank wrote its trace of ``capture`` and its analysis is not there yet (the
    analysis process goes on after its job ends)."""
    d = os.path.join(run_dir, "captures")
    try:
        names = set(os.listdir(d))
    except OSError:
        return False
    for n in names:
        m = _TRACE_RE.match(n)
        if m and int(m.group(2)) == capture and m.group(1) + ANALYSIS_SUFFIX not in names:
            return True
    return False


def _mtime(p: str) -> float:
    try:
        return os.stat(p).st_mtime
    except OSError:
        return 0.0


def answer_request(run_dir: str, rid: str, answer: dict[str, Any]) -> None:
    from .._files import write_private

    d = request_dir(run_dir)
    write_private(os.path.join(d, f"capture-{rid}.taken.json"), json.dumps(answer))
    try:
        os.unlink(os.path.join(d, f"capture-{rid}.json"))
    except OSError:
        pass

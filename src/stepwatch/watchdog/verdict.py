"""The cross-rank verdict on a hang: who is behind, in which collective, and ``report.json``.

Input: one snapshot per rank (its progress board at detection plus the top frames of its stack
dump). Three sources of evidence, best first:

1. Collectives (the comm hook writes them to the board): per process group, the collective the
   others wait in is the highest sequence number still open on some rank; the *laggards* are the
   ranks whose last entered sequence in that group is lower (they have not entered it). When every
   rank has entered it and it is open everywhere, no rank is behind: the collective itself does not
   complete, which points at the device or the network.
2. Stacks, when no collective the comm hook times is open (a ``dist.all_reduce`` or a barrier of
   the job's own, which nothing times, leaves the board with every rank at the same step and
   phase): a rank whose innermost frames, below its own code, are in ``torch.distributed`` waits
   in a collective; a rank whose main thread is in its own code (``time.sleep``, a busy loop), in
   the standard library or elsewhere in torch, and not in backward, is in no collective: it is
   the laggard. Judged only when the stacks show both kinds; a rank without frames is neither.
3. Phases, when neither names anyone: DDP's gradient AllReduce runs inside backward, so ranks in
   ``backward`` of the newest step wait in it, and ranks still at an earlier step, or in another
   phase of that step, are the laggards.
"""

from __future__ import annotations

import time
from typing import Any

from .._os.pyspy import call_site
from ..hooks import progress


def _last_per_group(snap: dict[str, Any]) -> dict[int, dict[str, Any]]:
    out: dict[int, dict[str, Any]] = {}
    for c in snap.get("collectives") or []:
        g = c["group"]
        if g not in out or c["seq"] >= out[g]["seq"]:
            out[g] = c
    return out


def _by_collectives(snaps: dict[int, dict[str, Any]]) -> dict[str, Any] | None:
    last = {r: _last_per_group(s) for r, s in snaps.items()}
    candidates = []  # (how long ago the wait began, group, the open collective)
    for r, groups in last.items():
        for g, c in groups.items():
            if not c["completed"]:
                # Each rank's sidecar measured the age on its own host: monotonic clocks of
                # different hosts count from their own boot, so enter times do not compare.
                age = c.get("age_s")
                candidates.append((age if age is not None else -c["enter_ns"] / 1e9, g, c))
    if not candidates:
        return None
    # The group whose wait started first (the oldest wait) is where the job stopped.
    _, group, _ = max(candidates, key=lambda x: x[0])
    open_seq = max(c["seq"] for _, g, c in candidates if g == group)
    waiting, laggards = [], []
    coll = None
    for r in sorted(snaps):
        c = last[r].get(group)
        if c is None or c["seq"] < open_seq:
            laggards.append(r)
        elif c["seq"] == open_seq:
            coll = coll or c
            if not c["completed"]:
                waiting.append(r)
    verdict = "laggard" if laggards else "device_or_network"
    return {
        "verdict": verdict,
        "laggards": laggards,
        "waiting": waiting,
        "collective": {
            "op": coll["op"] if coll else "unknown",
            "group": group,
            "sequence": open_seq,
            "bytes": coll["bytes"] if coll else None,
            "step": coll["step"] if coll else None,
            "source": "comm_hook",
        },
    }


# torch.distributed's collectives and waits, as a Python frame names them (innermost first:
# ``all_reduce (torch/distributed/distributed_c10d.py:3252)``, then its logging wrapper).
_IN_DIST = "torch/distributed/"
_IN_BACKWARD = ("torch/autograd/", "torch/_tensor.py")


def _lib_frames(frames: list[str]) -> list[str]:
    """The innermost frames below the job's own code (all of them when none is the job's)."""
    site = call_site(frames)
    return frames[:frames.index(site)] if site is not None else frames


def _frame_path(frame: str) -> str:
    return frame[frame.rfind("(") + 1:].rsplit(":", 1)[0].replace("\\", "/")


def _collective_frame(frames: list[str]) -> str | None:
    """The torch.distributed frame this stack waits in, or None when it is in no collective."""
    dist = [f for f in _lib_frames(frames) if _IN_DIST in _frame_path(f)]
    if not dist:
        return None
    for f in dist:  # the collective itself, not a wrapper around it
        if progress.op_code(_op_name(f)) != 0:
            return f
    return dist[0]


def _op_name(frame: str) -> str:
    name = frame[:frame.rfind(" (")] if " (" in frame else frame
    return name.rsplit(".", 1)[-1]


def _by_stacks(snaps: dict[int, dict[str, Any]]) -> dict[str, Any] | None:
    waiting, laggards = [], []
    coll_frame = None
    for r in sorted(snaps):
        s = snaps[r]
        frames = s.get("top_frames") or []
        if not frames:
            continue  # no evidence either way
        f = _collective_frame(frames)
        if f is not None:
            waiting.append(r)
            coll_frame = coll_frame or (f, s)
        elif not any(p in _frame_path(x) for x in _lib_frames(frames) for p in _IN_BACKWARD):
            # In backward, DDP's AllReduce waits where Python shows no frame: not judged here.
            laggards.append(r)
    if not waiting or not laggards:
        return None
    f, s = coll_frame
    name = _op_name(f)
    code = progress.op_code(name)
    return {
        "verdict": "laggard",
        "laggards": laggards,
        "waiting": waiting,
        "collective": {
            "op": progress.OPS[code] if code else name,
            "group": None,
            "sequence": None,
            "bytes": None,
            "step": s.get("step"),
            "source": "stacks (a collective stepwatch does not time: the waiting ranks' frames are in "
                      "torch.distributed, the laggards' are not)",
        },
    }


def _by_phases(snaps: dict[int, dict[str, Any]]) -> dict[str, Any]:
    newest = max(s["step"] for s in snaps.values())
    waiting = [r for r, s in sorted(snaps.items()) if s["step"] == newest and s["phase"] == "backward"]
    if waiting:
        laggards = [r for r in sorted(snaps) if r not in waiting]
        return {
            "verdict": "laggard" if laggards else "device_or_network",
            "laggards": laggards,
            "waiting": waiting,
            "collective": {
                "op": "allreduce",
                "group": 0,
                "sequence": None,
                "bytes": None,
                "step": newest,
                "source": "phases (DDP's gradient AllReduce runs in backward; no collective was published)",
            },
        }
    oldest = min(s["step"] for s in snaps.values())
    laggards = [r for r, s in sorted(snaps.items()) if s["step"] == oldest] if oldest != newest else []
    return {
        "verdict": "laggard" if laggards else "unknown",
        "laggards": laggards,
        "waiting": [r for r in sorted(snaps) if r not in laggards],
        "collective": None,
    }


def verdict(snaps: dict[int, dict[str, Any]], world_size: int) -> dict[str, Any]:
    """Decide from the snapshots that arrived (missing ranks are named, never guessed)."""
    if not snaps:
        return {"verdict": "unknown", "laggards": [], "waiting": [], "collective": None}
    v = _by_collectives(snaps) or _by_stacks(snaps) or _by_phases(snaps)
    v["missing_ranks"] = [r for r in range(world_size) if r not in snaps]
    if v["verdict"] == "device_or_network" and v["missing_ranks"]:
        # Every rank *that sent a snapshot* entered it: a missing one may not have.
        v["verdict"] = "unknown"
    coll = v.get("collective")
    if coll is not None:
        site = None
        for r in v.get("waiting") or []:
            site = call_site(snaps[r].get("top_frames") or [])
            if site:
                break
        coll["call_site"] = site
    return v


def _last_collective(s: dict[str, Any]) -> dict[str, Any] | None:
    colls = s.get("collectives") or []
    if not colls:
        return None
    c = max(colls, key=lambda c: c["enter_ns"])
    return {k: c[k] for k in ("op", "group", "seq", "bytes", "completed", "step")}


def build_report(
    n: int, snaps: dict[int, dict[str, Any]], world_size: int, *, timeout_s: float, detected_after_s: float,
    action: str, run_dir: str, hang_dir: str | None = None,
) -> dict[str, Any]:
    v = verdict(snaps, world_size)
    ranks = []
    for r in sorted(snaps):
        s = snaps[r]
        ranks.append(
            {
                "rank": r,
                "host": s.get("host"),
                "pid": s.get("pid"),
                "step": s["step"],
                "phase": s["phase"],
                "stalled_s": s.get("stalled_s"),
                "last_collective": _last_collective(s),
                "top_frames": s.get("top_frames") or [],
                "stuck": s.get("stuck"),
                "stacks": s.get("stacks"),
                "stack_method": s.get("stack_method"),
            }
        )
    report = {
        "hang": n,
        "time": time.time(),
        "detected_after_s": round(detected_after_s, 3),
        "timeout_s": timeout_s,
        "action": action,
        "verdict": v["verdict"],
        "laggards": v["laggards"],
        "waiting": v["waiting"],
        "missing_ranks": v["missing_ranks"],
        "collective": v["collective"],
        "ranks": ranks,
        "run_dir": run_dir,
        "dir": hang_dir or f"{run_dir}/hang-{n}",
    }
    report["summary"] = summary(report)
    return report


def _whereabouts(frames: list[str], op: str) -> str:
    """Where a laggard's main thread is: its innermost frame that is not stepwatch's own (a
    collective's wait wrapper said "in BlockedTimer._wrap_wait.<locals>.wait"), the job's line
    that called it, and whether that is a collective itself: then the ranks called different
    collectives (a step count or a branch that differs between ranks), not a slow rank."""
    own = [f for f in frames if "stepwatch/" not in f.replace("\\", "/")]
    top = own[0] if own else (frames[0] if frames else "?")
    text = f"in {top}"
    site = call_site(frames)
    if site and site != top:
        text += f" called from {site}"
    coll = next((f for f in own if "torch/distributed/" in f.replace("\\", "/") and "c10d" in f), None)
    if coll is not None:
        name = coll.split(" (", 1)[0]
        text += (f": it waits in another collective ({name}) than the {op} the others wait in, so the ranks "
                 "called different collectives (a step count or a branch that differs between ranks)")
    return text


def summary(report: dict[str, Any]) -> str:
    """One paragraph for the log."""
    coll = report.get("collective") or {}
    op = coll.get("op") or "a collective"
    details = []
    if coll.get("sequence") is not None:
        details.append(f"#{coll['sequence']}")
    if coll.get("group") not in (None, 0):
        details.append(f"group {coll['group']}")
    if coll.get("bytes"):
        details.append(f"{coll['bytes']} bytes")
    if coll.get("step") is not None:
        details.append(f"step {coll['step']}")
    where = op + (f" ({', '.join(details)})" if details else "")
    if coll.get("call_site"):
        where += f" called from {coll['call_site']}"
    ranks = {r["rank"]: r for r in report.get("ranks", [])}
    lag = report.get("laggards") or []
    waiting = report.get("waiting") or []
    head = (f"Hang {report.get('hang')}: no progress for {report.get('detected_after_s', 0):.0f} s "
            f"(timeout {report.get('timeout_s'):g} s). ")

    def ranks_text(rs: list[int]) -> str:
        return ("rank " if len(rs) == 1 else "ranks ") + ", ".join(map(str, rs))

    if report["verdict"] == "laggard":
        parts = []
        for r in lag:
            info = ranks.get(r, {})
            parts.append(f"Rank {r} is at step {info.get('step')}, phase {info.get('phase')}, "
                         + _whereabouts(info.get("top_frames") or [], op))
        verb = "waits" if len(waiting) == 1 else "wait"
        text = head + (f"Laggard: {ranks_text(lag)}, which did not enter the {where} that "
                       f"{ranks_text(waiting)} {verb} in. " + "; ".join(parts) + ".")
    elif report["verdict"] == "device_or_network":
        text = head + (f"Every rank entered the {where} and it does not complete: no rank is behind, so "
                       "suspect the device or the network (NCCL: a GPU, an NVLink or InfiniBand link, the transport; "
                       "gloo: the network between the hosts, or a host that stopped answering).")
    elif waiting and report.get("missing_ranks"):
        missing = report["missing_ranks"]
        text = head + (f"{ranks_text(waiting).capitalize()} {'waits' if len(waiting) == 1 else 'wait'} in the "
                       f"{where}; {ranks_text(missing)} sent no snapshot and may be the laggard (not entered "
                       "it): look at that rank first (its process, its host, its log).")
        return text + f" Stacks and report.json: {report.get('dir')}/"
    else:
        text = head + "The ranks' progress does not name a laggard; read the stacks."
    if report.get("missing_ranks"):
        text += f" No snapshot from {ranks_text(report['missing_ranks'])}."
    return text + f" Stacks and report.json: {report.get('dir')}/"

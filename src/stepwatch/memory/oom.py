"""OOM forensics: what was in memory when a ``torch.OutOfMemoryError`` (or ``MemoryError``) went
through a phase stepwatch hooks. Runs on the training thread at that moment -- the job is failing
anyway, and the allocator's state is only worth reading before the exception unwinds and frees the
step's tensors -- writes ``oom-<n>/`` in the run directory and returns the ``oom`` finding.
It never raises: the user's exception is what propagates.

``oom-<n>/`` holds ``report.json`` (rank, step, phase, exception, requested size, allocator and
host numbers), ``records.jsonl`` (the last step records), and where CUDA is in use
``memory_stats.json``, ``memory_summary.txt`` and, when the allocation history was recording,
``memory_snapshot.pickle`` (open it at https://pytorch.org/memory_viz).
"""

from __future__ import annotations

import json
import os
import pickle
import re
import sys
import threading
import time
from typing import Any, Callable

from .._files import numbered_subdir, write_json_private, write_private
from ..analysis.kinds import make_finding
from ..record import Finding

# Most oom-<n>/ directories one rank writes (a loop that catches OOMs and retries must not fill the disk).
MAX_DUMPS = 5

_UNITS = {"b": 1, "bytes": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40, "pib": 1 << 50,
          "kb": 1 << 10, "mb": 1 << 20, "gb": 1 << 30, "tb": 1 << 40, "pb": 1 << 50}
# CUDA: "Tried to allocate 20.00 MiB" (c10/cuda/CUDACachingAllocator.cpp); CPU:
# "DefaultCPUAllocator: can't allocate memory: you tried to allocate 8000000000000 bytes"; numpy:
# "Unable to allocate 6.00 GiB for an array with shape ...".
_REQ = re.compile(r"(?:tried|unable) to allocate\s+([0-9][0-9.,]*)\s*([KMGTP]i?B|bytes|B)\b", re.IGNORECASE)
# torch's own CPU out-of-memory is a plain RuntimeError (c10's alloc_cpu.cpp: "can't allocate
# memory", "not enough memory"), and a DataLoader worker's MemoryError whose type cannot be rebuilt
# from its message (numpy's) reaches the trainer as one: torch's ExceptionWrapper writes
# "Caught MemoryError in DataLoader worker process 0". Their messages are torch's own.
_CPU_OOM = re.compile(r"DefaultCPUAllocator: (?:can't allocate memory|not enough memory)"
                      r"|\ACaught \w*(?:MemoryError|OutOfMemoryError) in DataLoader worker process"
                      # a worker the kernel's OOM killer ended (SIGKILL): the trainer lives on to say so
                      r"|\ADataLoader worker \(pid \d+\) is killed by signal: Killed\.")


_WORKER_KILLED = "is killed by signal: Killed"  # the DataLoader's words for a worker ended by SIGKILL


def requested_bytes(message: str) -> int | None:
    m = _REQ.search(message or "")
    if not m:
        return None
    try:
        return int(float(m.group(1).replace(",", "")) * _UNITS[m.group(2).lower()])
    except (ValueError, KeyError):
        return None


def is_oom(exc: BaseException) -> bool:
    if isinstance(exc, MemoryError):
        return True
    torch = sys.modules.get("torch")
    cls = getattr(torch, "OutOfMemoryError", None) if torch is not None else None
    if cls is not None and isinstance(exc, cls):
        return True
    if not isinstance(exc, RuntimeError):
        return False
    # The loader's SIGCHLD handler raises "killed by signal" inside its queue's get, which turns it
    # into "DataLoader worker (pid(s) N) exited unexpectedly" raised from it: its cause says why.
    cause = exc.__cause__
    try:
        return any(_CPU_OOM.search(str(e)) is not None for e in (exc, cause) if isinstance(e, RuntimeError))
    except Exception:  # noqa: BLE001 - an exception whose __str__ fails is not ours to judge
        return False


class OomForensics:
    def __init__(self, run_dir: str, rank: int, *, records: Callable[[], list[dict[str, Any]]],
                 host: Callable[[], dict[str, Any]], cuda_device: Callable[[], int | None],
                 max_dumps: int = MAX_DUMPS) -> None:
        self.run_dir = run_dir
        self.rank = rank
        self.records = records
        self.host = host
        self.cuda_device = cuda_device
        self.max_dumps = max_dumps
        self.seen = 0
        self.dumps: list[str] = []
        self.pending: list[tuple[str, int]] = []
        self._lock = threading.Lock()  # pending: appended on the training thread, drained on the pipeline's

    def write_records(self, last_step: int | None, *, final: bool) -> None:
        """Background thread: ``records.jsonl`` of each dump whose earlier steps the pipeline has
        now seen (``last_step``: the newest record's step), or of every dump at shutdown."""
        with self._lock:
            todo, self.pending = self.pending, []
        keep = []
        for where, step in todo:
            if not final and (last_step is None or last_step < step - 1):
                keep.append((where, step))
                continue
            rows = [r for r in self.records() if r["step"] < step]
            try:
                write_private(os.path.join(where, "records.jsonl"),
                              "".join(json.dumps(r, default=str) + "\n" for r in rows))
            except OSError:
                pass
        with self._lock:
            self.pending[:0] = keep

    def handle(self, exc: BaseException, *, phase: str, step: int) -> Finding:
        self.seen += 1
        msg = str(exc)
        req = requested_bytes(msg)
        report: dict[str, Any] = {
            "rank": self.rank, "pid": os.getpid(), "time": time.time(), "step": step, "phase": phase,
            "exception": f"{type(exc).__module__}.{type(exc).__qualname__}", "message": msg,
            "requested_bytes": req,
        }
        files: dict[str, Any] = {}
        dev = self.cuda_device()
        if dev is not None:
            import torch

            cuda: dict[str, Any] = {"device": dev}
            try:
                stats = torch.cuda.memory_stats(dev)
                files["memory_stats.json"] = json.dumps(stats, indent=1)
                cuda.update(allocated_bytes=stats.get("allocated_bytes.all.current"),
                            reserved_bytes=stats.get("reserved_bytes.all.current"),
                            peak_bytes=stats.get("allocated_bytes.all.peak"),
                            alloc_retries=stats.get("num_alloc_retries"), ooms=stats.get("num_ooms"))
                files["memory_summary.txt"] = torch.cuda.memory_summary(dev)
                free, total = torch.cuda.mem_get_info(dev)
                cuda.update(free_bytes=free, total_bytes=total)
            except Exception as e:  # a broken context: keep what we have
                cuda["error"] = f"{type(e).__name__}: {e}"
            try:
                # Segments always; the allocation trace too when the history was recording.
                files["memory_snapshot.pickle"] = pickle.dumps(torch.cuda.memory._snapshot())
            except Exception as e:
                cuda["snapshot_error"] = f"{type(e).__name__}: {e}"
            report["cuda"] = cuda
        report["host"] = self.host()
        where = None
        if len(self.dumps) < self.max_dumps:
            try:
                where, n = numbered_subdir(self.run_dir, "oom-")
                report["files"] = sorted(files) + ["records.jsonl", "report.json"]
                for name, body in files.items():
                    write_private(os.path.join(where, name), body)
                # The pipeline is up to a pass behind the training thread: the last records are
                # written once it has seen the steps before this one (write_records).
                with self._lock:
                    self.pending.append((where, step))
                self.dumps.append(where)
            except OSError as e:
                report["write_error"] = str(e)
                where = None
        killed = any(_WORKER_KILLED in str(e) for e in (exc, exc.__cause__) if e is not None)
        finding = make_finding(
            "oom", rank=self.rank, step=step,
            summary=(f"rank {self.rank} ran out of memory in {phase} at step {step}"
                     + (f" (tried to allocate {_human(req)})" if req else "")
                     + (": a DataLoader worker was killed by SIGKILL, most likely by the kernel's OOM killer"
                        if killed else "")
                     + _cuda_tail(report.get("cuda"))
                     + (f"; forensics in {os.path.basename(where)}/" if where else "")),
            data={k: report.get(k) for k in ("phase", "exception", "message", "requested_bytes", "cuda", "host")}
            | {"dir": where},
        )
        if "cuda" not in report:
            finding.action = CPU_ACTION
        if where is not None:
            try:
                write_json_private(os.path.join(where, "report.json"), report | {"finding": finding.to_dict()})
            except OSError:
                pass
        return finding


# The ``oom`` action where no CUDA device is in use: the host's files and tools (the catalogue's
# action reads the CUDA allocator's summary and snapshot, which a CPU job has not).
CPU_ACTION = ("Read oom-<n>/report.json (requested size; the trainer's RSS, the DataLoader workers' memory "
              "and the host limit) and records.jsonl (host_rss_bytes and workers_pss_bytes step by step: a "
              "steady rise is a leak, see memory_growth). Then reduce the batch, load fewer samples at once "
              "(fewer DataLoader workers, a smaller prefetch_factor), or find what is kept with memray run "
              "--native train.py.")


def _human(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def _cuda_tail(c: dict[str, Any] | None) -> str:
    if not c or c.get("allocated_bytes") is None:
        return ""
    s = f"; {_human(c['allocated_bytes'])} allocated, {_human(c.get('reserved_bytes') or 0)} reserved"
    if c.get("free_bytes") is not None:
        s += f", {_human(c['free_bytes'])} free of {_human(c['total_bytes'])}"
    return s

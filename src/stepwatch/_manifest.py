"""The run directory's manifests: every rank writes ``rank<R>.json`` (who it is), rank 0 also
``run.json`` (the run: hosts from every rank's file, versions, config, features, exporters, what
was dropped, logged values that became null, internal errors). ``report/load.py`` reads them.

Written at the first pass that opens the exporters and again at shutdown (``end_time`` set); a
relaunch in the same directory gets ``rank<R>.<K>.json`` / ``run.<K>.json`` beside the first.
Files only through :mod:`stepwatch._files`.
"""

from __future__ import annotations

import os
import platform
import re
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from ._files import RANK_FILE_RE, create_private, make_private_dir, read_json_private, say_unwritable, write_json_private
from ._version import __version__
from .config import Config
from .context import RunContext
from .exporters.records import claim_name
from .record import SCHEMA_VERSION


@dataclass
class RunFacts:
    """What the session knows at the moment of writing (run.json's fields beyond who and when)."""

    features: dict[str, Any] = field(default_factory=dict)
    exporters: list[str] = field(default_factory=list)
    steps: int = 0
    dropped_records: int = 0
    exporter_drops: dict[str, dict[str, Any]] = field(default_factory=dict)
    null_scalars: dict[str, int] = field(default_factory=dict)
    internal_errors: dict[str, int] = field(default_factory=dict)
    # Step records this rank's steps file rotated out within its disk budget (None: no records file).
    steps_rotated_out: int | None = None
    # At the final write: "shutdown" (stepwatch.shutdown() or the interpreter's exit), "SIGTERM",
    # or "uncaught <exception type>: <message>"; None before.
    ended_by: str | None = None


# Room kept on the run directory's disk for the final manifest (run.json is ~5 KB; written through
# a temporary file, then renamed): a disk that filled during the run left run.json as its first
# write made it (no end time, steps 0, nothing said of the records lost), and the report read the
# finished job as "still running, or it crashed".
RESERVE_BYTES = 64 * 1024


class Manifest:
    def __init__(self, config: Config, ctx: RunContext, *, pid: int, start_time: float) -> None:
        self.config = config
        self.ctx = ctx
        self.pid = pid
        self.start_time = start_time
        self._rank_path: str | None = None
        self._run_path: str | None = None
        self._reserve: str | None = None  # ``.reserve.rank<R>.<pid>``: freed right before the final write

    def paths(self) -> list[str]:
        """The manifests this process wrote (its rank file; on rank 0 the run's too)."""
        return [p for p in (self._rank_path, self._run_path) if p is not None]

    def write(self, facts: RunFacts, *, final: bool) -> None:
        """Never raises for a file that cannot be written: one warning, the job goes on."""
        if not self.config.records:
            return
        ctx = self.ctx
        if final:
            self._release_reserve()
        try:
            make_private_dir(ctx.run_dir)
            me = {
                "rank": ctx.rank,
                "local_rank": ctx.local_rank,
                "host": ctx.host,
                "pid": self.pid,
                "attempt": ctx.attempt,
                "start_time": self.start_time,
                # Each rank's own end (run.json has rank 0's only): a rank that crashed says why
                # here; one killed (SIGKILL, the OOM killer) keeps end_time null.
                "end_time": time.time() if final else None,
                "ended_by": facts.ended_by,
                "steps_rotated_out": facts.steps_rotated_out,
            }
            if self._rank_path is None:
                # rank<R>.<K>.json beside the first launch's: a relaunch or a second job in the
                # same directory keeps the other's file (the report tells them apart)
                self._rank_path = claim_name(ctx.run_dir, f"rank{ctx.rank}", "json")
            write_json_private(self._rank_path, me)
            if ctx.rank != 0:
                return
            manifest = {
                "schema_version": SCHEMA_VERSION,
                "run_id": ctx.run_id,
                "argv": list(sys.argv),
                "versions": versions(),
                "world_size": ctx.world_size,
                "hosts": sorted({ctx.host} | set(hosts_in(ctx.run_dir, _launch_of(self._rank_path)))),
                "attempt": ctx.attempt,
                "start_time": self.start_time,
                "end_time": time.time() if final else None,
                "ended_by": facts.ended_by,
                "config": self.config.as_manifest(),
                "features": facts.features,
                "exporters": facts.exporters,
                "steps": facts.steps,
                "dropped_records": facts.dropped_records,
                "exporter_drops": facts.exporter_drops,
                "null_scalars": dict(facts.null_scalars),
                "internal_errors": dict(facts.internal_errors),
            }
            if self._run_path is None:
                self._run_path = claim_name(ctx.run_dir, "run", "json")
            write_json_private(self._run_path, manifest)
            if not final and self._reserve is None:
                self._keep_reserve()
        except OSError as e:
            say_unwritable(ctx.run_dir, "the manifest", e)

    def _keep_reserve(self) -> None:
        """Rank 0, after its first manifest: ``RESERVE_BYTES`` of the disk taken now, given back
        right before the final manifest (a disk full by then still takes it)."""
        host = _SAFE.sub("_", self.ctx.host)
        _drop_dead_reserves(self.ctx.run_dir, self.ctx.rank, host)
        path = os.path.join(self.ctx.run_dir, f".reserve.rank{self.ctx.rank}.{host}.{self.pid}")
        self._reserve = path
        try:
            fd = create_private(path)
        except OSError:
            return  # no room even now: the final write takes its chances
        try:
            try:
                os.posix_fallocate(fd, 0, RESERVE_BYTES)
            except (OSError, AttributeError):  # a file system without fallocate: written out
                os.write(fd, b"\0" * RESERVE_BYTES)
        except OSError:
            pass  # what it got is kept
        finally:
            os.close(fd)

    def _release_reserve(self) -> None:
        path, self._reserve = self._reserve, None
        if path is not None:
            try:
                os.unlink(path)
            except OSError:
                pass


_SAFE = re.compile(r"[^A-Za-z0-9._-]")


def _launch_of(rank_path: str | None) -> str | None:
    """The launch suffix of a rank file's name: "" for ``rank<R>.json``, ``.<K>`` for
    ``rank<R>.<K>.json`` (a relaunch's); None when unknown."""
    m = RANK_FILE_RE.match(os.path.basename(rank_path)) if rank_path else None
    return f".{m.group(2)}" if m and m.group(2) else ("" if m else None)


def _drop_dead_reserves(run_dir: str, rank: int, host: str) -> None:
    """Remove the reserves of this host's earlier rank-``rank`` processes that are gone: one
    SIGKILLed (the OOM killer, a scheduler's kill after its grace period) gave its 64 KiB back
    never, and each such launch left one more. Another host's are left alone (its pids are not
    ours to judge)."""
    prefix = f".reserve.rank{rank}.{host}."
    try:
        names = [n for n in os.listdir(run_dir) if n.startswith(prefix)]
    except OSError:
        return
    for n in names:
        pid = n[len(prefix):]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
            continue  # alive (or not ours to signal): kept
        except ProcessLookupError:
            pass
        except OSError:
            continue
        try:
            os.unlink(os.path.join(run_dir, n))
        except OSError:
            pass


def hosts_in(run_dir: str, launch: str | None = None) -> list[str]:
    """The hosts named by the rank files in ``run_dir`` (one unreadable file is skipped); with
    ``launch`` (see :func:`_launch_of`), those of that launch's rank files only: a relaunch's
    ``run.<K>.json`` listed the hosts of every earlier launch."""
    out = []
    try:
        names = os.listdir(run_dir)
    except OSError:
        return out
    for n in names:
        m = RANK_FILE_RE.match(n)
        if m and (launch is None or (f".{m.group(2)}" if m.group(2) else "") == launch):
            try:
                out.append(read_json_private(os.path.join(run_dir, n))["host"])
            except (OSError, ValueError, KeyError, TypeError):
                continue
    return out


def versions() -> dict[str, str]:
    torch = sys.modules.get("torch")
    return {
        "stepwatch": __version__,
        "torch": getattr(torch, "__version__", "not imported"),
        "python": platform.python_version(),
    }

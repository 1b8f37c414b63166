"""Who this process is in the job: rank, local rank, world size, host, run id and run directory.

Read from the torchrun environment at init; refreshed from ``torch.distributed`` once a process
group exists (a script launched without torchrun learns its rank only then).
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from typing import Mapping


@dataclass(slots=True)
class RunContext:
    rank: int
    local_rank: int
    world_size: int
    host: str
    run_id: str
    run_dir: str
    # torchrun's restart counter: an elastic restart writes new files beside the old ones.
    attempt: int = 0
    pid: int = 0
    # The accelerator's name once training ran a step (``torch.cuda.get_device_name``), "cpu" on CPU.
    device: str | None = None


def _env_int(env: Mapping[str, str], name: str, default: int) -> int:
    try:
        return int(env.get(name, default))
    except ValueError:
        return default


def resolve_run_id(env: Mapping[str, str], explicit: str | None = None) -> str:
    """The id every rank of one launch agrees on, without talking to each other.

    torchrun sets ``TORCHELASTIC_RUN_ID`` per launch (``--rdzv-id``; a fresh uuid under
    ``--standalone``). Its static-rendezvous default is the literal ``none``, which is no id. Then
    the master address and port name the job (the same for every rank of a launch), then the
    default store of a process group that exists already (:func:`store_run_id`), and a lone
    process falls back to a timestamp and its pid.
    """
    if explicit:
        safe = _safe(explicit)
        if safe != explicit:
            from ._log import warn_once

            warn_once(f"run_id.{explicit}", "stepwatch: run id %r holds characters that cannot go in a folder name "
                      "(only letters, digits, '-', '_', '.'): using %r", explicit, safe)
        return safe
    rid = env.get("TORCHELASTIC_RUN_ID", "")
    if rid and rid.lower() != "none":
        return _safe(rid)
    addr, port = env.get("MASTER_ADDR"), env.get("MASTER_PORT")
    if addr and port:
        return _safe(f"job-{addr}-{port}")
    got = store_run_id()
    if got is not None:
        return got
    return lone_run_id()


def lone_run_id() -> str:
    """A lone process's id: a timestamp and its pid (:func:`is_lone_run_id` knows it)."""
    return time.strftime("run-%Y%m%d-%H%M%S", time.localtime()) + f"-{os.getpid()}"


def is_lone_run_id(run_id: str, pid: int) -> bool:
    return run_id.startswith("run-") and run_id.endswith(f"-{pid}")


def store_run_id() -> str | None:
    """The id of a job whose process group exists already and whose launcher set no variable
    (``torch.multiprocessing.spawn`` ranks with ``init_method="tcp://HOST:PORT"`` or
    ``"file://PATH"``): its default store's address, the same on every rank. None without one
    (torch is never imported here)."""
    import sys
    import zlib

    dist = sys.modules.get("torch.distributed")
    try:
        if dist is None or not dist.is_available() or not dist.is_initialized():
            return None
        store = dist.distributed_c10d._get_default_store()
        for _ in range(8):  # PrefixStores around the real one
            inner = getattr(store, "underlying_store", None)
            if inner is None:
                break
            store = inner
        host, port, path = getattr(store, "host", None), getattr(store, "port", None), getattr(store, "path", None)
    except Exception:  # a torch without these: the lone process's id
        return None
    if host and port:
        return _safe(f"job-{host}-{port}")
    if isinstance(path, str) and path:
        return f"job-file-{zlib.crc32(os.path.abspath(path).encode()):08x}"
    return None


def _safe(s: str) -> str:
    """Keep a path component safe: ids come from the environment."""
    out = "".join(c if (c.isalnum() or c in "-_.") else "_" for c in s).strip(".")
    return out or "run"


def from_env(env: Mapping[str, str], *, run_dir: str | None, run_id: str | None) -> RunContext:
    rid = resolve_run_id(env, run_id)
    return RunContext(
        rank=_env_int(env, "RANK", 0),
        local_rank=_env_int(env, "LOCAL_RANK", 0),
        world_size=max(1, _env_int(env, "WORLD_SIZE", 1)),
        host=socket.gethostname(),
        run_id=rid,
        run_dir=os.path.abspath(run_dir or os.path.join("stepwatch-runs", rid)),
        attempt=_env_int(env, "TORCHELASTIC_RESTART_COUNT", 0),
        pid=os.getpid(),
    )


def refresh_from_dist(ctx: RunContext) -> bool:
    """Learn rank and world size from ``torch.distributed`` once a process group exists (never
    importing torch); True when they were read."""
    import sys

    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        ctx.rank = dist.get_rank()
        ctx.world_size = dist.get_world_size()
        return True
    return False

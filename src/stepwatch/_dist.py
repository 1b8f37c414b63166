"""torch.distributed as the job set it up: its store, rank and world size, the one way the in-job parts
(straggler exchange, grad-norm exchange, capture decisions) reach it. Never creates a process
group, never imports torch: before the job initialises one, there is no store (None).

Every key stepwatch writes there lives under ``stepwatch/<run id>/...`` (:func:`namespace`), so two
runs, or two attempts of one, never read each other's keys."""

from __future__ import annotations

import sys
from typing import Any


def _dist() -> Any:
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    return dist


def default_store() -> Any:
    """The default process group's store, or None before there is one."""
    dist = _dist()
    return None if dist is None else dist.distributed_c10d._get_default_store()


def world() -> tuple[int, int]:
    """(rank, world size) of the default process group; (0, 1) before there is one."""
    dist = _dist()
    return (0, 1) if dist is None else (dist.get_rank(), dist.get_world_size())


def namespace(run_id: str, *parts: object) -> str:
    return "/".join(["stepwatch", str(run_id), *(str(p) for p in parts)])

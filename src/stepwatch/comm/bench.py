"""An nccl-tests-style AllReduce sweep through torch.distributed (``stepwatch bench-comm``).

Columns and formulas follow nccl-tests (doc/PERFORMANCE.md): ``time`` is the mean time of one
AllReduce, averaged over the ranks (nccl-tests' default ``-a 1``), ``algbw = size / time`` and
``busbw = algbw * 2(n-1)/n`` for AllReduce, in GB/s with GB = 1e9 bytes. Sizes take K/M/G suffixes as powers of 1024 like
nccl-tests' ``-b``/``-e``.

Arguments, and the ``--json`` file's directory, are checked before anything is printed or started;
a ``--json`` file that still cannot be written at the end is :class:`OutputError` (the table is
printed by then).
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

from .findings import baseline, verdict
from .overlap import GB, bus_factor
from .spans import ALLREDUCE

_SUFFIX = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3}
_BACKENDS = ("nccl", "gloo")
MAX_STEPS = 100_000  # of the size sweep: a factor closer to 1 than this allows is refused, not looped on
_DTYPES = {"float": "float32", "float32": "float32", "half": "float16", "float16": "float16", "bfloat16": "bfloat16"}


class OutputError(Exception):
    """The sweep ran (its table is printed) but the ``--json`` file could not be written."""


def check_writable(path: str, name: str = "--json") -> None:
    """Before the sweep: ``path`` can be created (or, when it exists, written) by this user."""
    full = os.path.abspath(path)
    if os.path.isdir(full):
        raise ValueError(f"{name} {path!r} is a directory: give a file name")
    d = os.path.dirname(full)
    if not os.path.isdir(d):
        raise ValueError(f"{name} {path!r}: the directory {d!r} does not exist")
    target = full if os.path.exists(full) else d
    if not os.access(target, os.W_OK):  # access(2) also says no on a read-only filesystem (EROFS)
        raise ValueError(f"{name} {path!r}: {target!r} is not writable by this user")


def parse_size(s: str, name: str = "size") -> int:
    """'1M' -> 1048576; bad input names the option and what is valid."""
    t = str(s).strip().upper().removesuffix("B")
    suf = t[-1:] if t[-1:] in ("K", "M", "G") else ""
    num = t[: len(t) - len(suf)]
    try:
        v = int(float(num) * _SUFFIX[suf])
    except (ValueError, OverflowError):  # int(inf): -b inf, -e 1e400 were an OverflowError traceback
        raise ValueError(f"{name}={s!r} is not a size: expected a number of bytes with an optional K, M or G suffix (e.g. 1M)") from None
    if v <= 0:
        raise ValueError(f"{name}={s!r} must be > 0 bytes")
    return v


def sizes(begin: int, end: int, factor: float, elem: int = 1) -> list[int]:
    """The sweep's message sizes, each a whole number of ``elem``-byte elements (at least one), as
    the buffer that is sent holds, and each larger than the one before: ``-f 1.5`` from 4 bytes
    gave 4, 6, 9, ... and float32 buffers of 4, 4, 8 bytes, the same size measured twice."""
    if end < begin:
        raise ValueError(f"-e/--maxbytes ({end}) must be >= -b/--minbytes ({begin})")
    if not factor > 1:  # not `factor <= 1`: nan compares false with everything, and passed it
        raise ValueError(f"-f/--stepfactor must be > 1, got {factor}")
    steps = math.log(end / begin) / math.log(factor) if end > begin else 0.0
    if steps > MAX_STEPS:  # -f 1.0000001 from 1 B to 1 GB: 2e8 steps of this loop before any output
        least = (end / begin) ** (1 / MAX_STEPS)
        raise ValueError(f"-f/--stepfactor {factor} is too close to 1: from -b {begin} to -e {end} bytes that is "
                         f"{steps:.3g} steps (at most {MAX_STEPS}); use -f {least:.7g} or more")
    out: list[int] = []
    s = float(begin)
    while s <= end:
        n = max(int(s) // elem, 1) * elem
        if not out or n > out[-1]:
            out.append(n)
        s *= factor
    return out


@dataclass(slots=True)
class Row:
    size: int
    count: int
    type: str
    redop: str
    root: int
    time_us: float
    algbw: float
    busbw: float
    bus_factor: float
    verdict: str


def row(size: int, elem: int, dtype: str, seconds: float, world: int, base: dict[str, Any] | None) -> Row:
    f = bus_factor(ALLREDUCE, world)
    algbw = size / seconds / GB
    busbw = algbw * f
    return Row(size, size // elem, dtype, "sum", -1, seconds * 1e6, algbw, busbw, f, verdict(busbw, size, base))


def header(world: int, backend: str, base: dict[str, Any] | None) -> str:
    b = f"baseline: {base['name']}" if base else "baseline: none for this hardware (the reference has H100 numbers only); verdict n/a"
    return (
        f"# stepwatch bench-comm: AllReduce, {world} ranks, backend {backend}\n# {b}\n"
        "#\n#       size         count      type   redop    root     time   algbw   busbw  verdict\n"
        "#        (B)    (elements)                               (us)  (GB/s)  (GB/s)"
    )


def fmt(r: Row) -> str:
    return (
        f"{r.size:12d}  {r.count:12d}  {r.type:>8s}  {r.redop:>6s}  {r.root:6d}  {r.time_us:9.1f}  "
        f"{r.algbw:6.2f}  {r.busbw:6.2f}  {r.verdict}"
    )


def run(
    begin: int,
    end: int,
    factor: float,
    iters: int,
    warmup: int,
    dtype: str = "float32",
    backend: str | None = None,
    out: Callable[[str], None] = print,
    json_path: str | None = None,
) -> list[Row]:
    # Every argument is checked before anything is printed or started.
    if dtype not in _DTYPES:
        raise ValueError(f"--dtype={dtype!r}: expected one of {', '.join(sorted(_DTYPES))}")
    if backend is not None and backend not in _BACKENDS:  # else torch's AssertionError on every rank
        raise ValueError(f"--backend={backend!r}: expected {' or '.join(_BACKENDS)}")

    import torch
    import torch.distributed as dist

    tdtype = getattr(torch, _DTYPES[dtype])
    elem = torch.tensor([], dtype=tdtype).element_size()
    plan = sizes(begin, end, factor, elem)
    if "RANK" not in os.environ and not dist.is_initialized():
        raise RuntimeError(
            "bench-comm runs one process per rank: start it under torchrun, e.g. "
            "`torchrun --nproc-per-node 8 -m stepwatch bench-comm -b 1M -e 1G -f 2`"
        )
    rank0 = dist.get_rank() == 0 if dist.is_initialized() else os.environ.get("RANK", "0").strip() == "0"
    if json_path and rank0:
        check_writable(json_path)  # rank 0 writes it: said now, not after a sweep of minutes
    cuda = torch.cuda.is_available()
    own = not dist.is_initialized()
    if own:
        dist.init_process_group(backend or ("nccl" if cuda else "gloo"))
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(device)
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world) or world)
        base = baseline(torch.cuda.get_device_name(device) if cuda else None, world, max(1, world // max(local, 1)))
        rows = []
        if rank == 0:
            out(header(world, dist.get_backend(), base))
        for size in plan:
            n = max(size // elem, 1)
            buf = torch.ones(n, dtype=tdtype, device=device)
            for _ in range(warmup):
                dist.all_reduce(buf)
            if cuda:
                torch.cuda.synchronize(device)
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                dist.all_reduce(buf)
            if cuda:
                torch.cuda.synchronize(device)
            t = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64, device=device)
            dist.all_reduce(t)  # the ranks' mean, as nccl-tests reports by default (-a 1)
            r = row(n * elem, elem, str(tdtype).removeprefix("torch."), float(t.item()) / world, world, base)
            rows.append(r)
            if rank == 0:
                out(fmt(r))
        if rank == 0 and rows:
            out(f"# Avg bus bandwidth    : {sum(r.busbw for r in rows) / len(rows):.4g} GB/s")
            judged = [r for r in rows if r.verdict != "n/a"]
            if judged:
                worst = min(judged, key=lambda r: r.busbw)
                out(f"# verdict: {'healthy' if all(r.verdict == 'ok' for r in judged) else 'BELOW BASELINE'} "
                    f"(lowest busbw {worst.busbw:.1f} GB/s at {worst.size} B)")
            if json_path:
                try:
                    with open(json_path, "w", encoding="utf-8") as f:
                        json.dump({"world": world, "backend": dist.get_backend(), "baseline": base,
                                   "rows": [asdict(r) for r in rows]}, f, indent=1)
                except OSError as e:
                    raise OutputError(f"--json {json_path!r}: the results were not written ({e.strerror or e}); "
                                      "the table above has them") from e
        return rows
    finally:
        if own:
            dist.destroy_process_group()

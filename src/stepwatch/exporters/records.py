"""The run directory's per-rank JSON Lines files: ``steps.rank<R>.jsonl`` and ``findings.rank<R>.jsonl``.

Files are created readable by the job's user only (0600, directories 0700). A name that already
exists (an elastic restart, or a second launch with the same run id) is never overwritten: the
new file is ``steps.rank<R>.<K>.jsonl`` with the first free K. Each file rotates to ``<name>.1``
when it reaches its cap, so a rank's records never exceed its share of the run directory's disk
budget. Written and flushed on every background pass: a crash loses at most one pass of steps.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

from .._files import make_private_dir, open_private
from ..context import RunContext
from .base import Batch, Exporter

# Share of a rank's budget per file kind; each keeps one rotated segment beside the live one.
_STEPS_SHARE = 0.35
_FINDINGS_SHARE = 0.10


def free_name(run_dir: str, stem: str, ext: str) -> str:
    """``stem.ext`` if unused, else ``stem.K.ext`` with the first free K (a dangling link counts as used)."""
    path = os.path.join(run_dir, f"{stem}.{ext}")
    k = 1
    while os.path.lexists(path):
        path = os.path.join(run_dir, f"{stem}.{k}.{ext}")
        k += 1
    return path


def claim_name(run_dir: str, stem: str, ext: str) -> str:
    """:func:`free_name`, taken at once (created empty, ``O_EXCL``): a job starting in the same
    directory at the same moment gets the next name instead of overwriting this one."""
    for k in range(100_000):
        path = os.path.join(run_dir, f"{stem}.{ext}" if k == 0 else f"{stem}.{k}.{ext}")
        try:
            open_private(path).close()
            return path
        except FileExistsError:
            continue
    raise FileExistsError(f"no free name for {stem}.<K>.{ext} in {run_dir}")


def _clean(v: Any) -> Any:
    """JSON has no NaN/Infinity: non-finite floats are written as the strings "nan"/"inf"/"-inf"."""
    if isinstance(v, float) and not math.isfinite(v):
        return "nan" if v != v else ("inf" if v > 0 else "-inf")
    if isinstance(v, dict):
        return {k: _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    return v


def _make_encoder() -> Any:
    """json's C encoder as ``json.dumps(separators=(",", ":"), allow_nan=False, default=str)``
    builds it, made once: ``json.dumps`` with arguments builds a ``JSONEncoder`` and its C
    encoder for every line. None where the C accelerator is missing."""
    try:
        from json.encoder import c_make_encoder, encode_basestring_ascii
    except ImportError:  # pragma: no cover - CPython always has it
        return None
    if c_make_encoder is None or encode_basestring_ascii is None:
        return None
    return c_make_encoder({}, str, encode_basestring_ascii, None, ":", ",", False, False, False)


_ENCODER = _make_encoder()


def dumps(d: dict[str, Any]) -> str:
    global _ENCODER
    enc = _ENCODER
    try:  # the common case, all in C: no NaN or Infinity anywhere
        if enc is not None:
            return "".join(enc(d, 0))
        return json.dumps(d, separators=(",", ":"), allow_nan=False, default=str)
    except ValueError:
        if enc is not None:
            _ENCODER = _make_encoder()  # its circular-reference markers may hold the failed call's
        return json.dumps(_clean(d), separators=(",", ":"), default=str)


class _RotatingFile:
    def __init__(self, path: str, cap_bytes: int) -> None:
        self.path = path
        self.cap = max(cap_bytes, 4096)
        self.f = open_private(path)
        self.size = 0

    def write_lines(self, lines: list[str]) -> None:
        data = "\n".join(lines) + "\n" if lines else ""
        if self.size and self.size + len(data) > self.cap:
            self.f.close()
            os.replace(self.path, self.path + ".1")
            self.f = open_private(self.path)
            self.size = 0
        self.f.write(data)
        self.f.flush()
        self.size += len(data)

    def close(self) -> None:
        self.f.close()


class RecordsExporter(Exporter):
    name = "records"

    def __init__(self, ctx: RunContext, *, budget_bytes: int) -> None:
        self.ctx = ctx
        self.share = budget_bytes // max(ctx.world_size, 1)
        make_private_dir(ctx.run_dir)
        stem = f"rank{ctx.rank}"
        self.steps = _RotatingFile(free_name(ctx.run_dir, f"steps.{stem}", "jsonl"), int(self.share * _STEPS_SHARE))
        self.findings = _RotatingFile(
            free_name(ctx.run_dir, f"findings.{stem}", "jsonl"), int(self.share * _FINDINGS_SHARE)
        )

    def export(self, batch: Batch) -> None:
        if batch.records:
            self.steps.write_lines([dumps(r.to_dict()) for r in batch.records])
        if batch.findings:
            self.findings.write_lines([dumps(f.to_dict()) for f in batch.findings])

    def shutdown(self) -> None:
        self.steps.close()
        self.findings.close()

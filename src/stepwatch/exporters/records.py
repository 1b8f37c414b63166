"""The run directory's per-rank JSON Lines files: ``steps.rank<R>.jsonl`` and ``findings.rank<R>.jsonl``.

Files are created readable by the job's user only (0600, directories 0700). A name that already
exists (an elastic restart, or a second launch with the same run id) is never overwritten: the
new file is ``steps.rank<R>.<K>.jsonl`` with the first free K. Each file rotates to ``<name>.1``
when it reaches its cap, so a rank's records never exceed its share of the run directory's disk
budget. Written and flushed on every background pass: a crash loses at most one pass of steps.
"""

from __future__ import annotations

import errno
import json
import math
import operator
import os
from typing import Any

from .._files import append_private_fd, make_private_dir, open_private
from .._log import logger
from ..context import RunContext
from ..record import STEP_FIELDS, StepRecord, c_to_record
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


def _make_value_encoder() -> Any:
    """:func:`dumps`'s encoder for one field's value (a dict of scalars, an unusual type), without
    the circular-reference markers (no state left behind by a call that fails: such a line is
    written by :func:`dumps` instead). None where the C accelerator is missing."""
    try:
        from json.encoder import c_make_encoder, encode_basestring_ascii
    except ImportError:  # pragma: no cover - CPython always has it
        return None
    if c_make_encoder is None or encode_basestring_ascii is None:
        return None
    return c_make_encoder(None, str, encode_basestring_ascii, None, ":", ",", False, False, False)


_VALUE_ENCODER = _make_value_encoder()
_VALUES = operator.attrgetter(*STEP_FIELDS)
# Fields whose value, not only its type, is part of a line's shape: bool and str fields with a
# few distinct values ("host"/"device", "bf16"), written into the template once.
_KEYED = tuple(STEP_FIELDS.index(n) for n in ("skipped", "clock", "mfu_dtype", "tail"))
_KEYED_VALUES = operator.itemgetter(*_KEYED)
# A job has a few dozen at most (features fill fields every step, every N steps, once a second,
# and in combination); past this bound (~2 KB each), new shapes take dumps(rec.to_dict()).
_MAX_SHAPES = 256
_SHAPES: dict[tuple[Any, ...], "_StepTemplate"] = {}
try:  # the same template filled in C (src/stepwatch/_speedups.c); optional, like the timer
    from .._speedups import fill as _fill
except ImportError:  # not built (no compiler at install): the Python template, the same bytes
    _fill = None
# _speedups bound StepRecord's slots (record.py): fill then takes the record, not a tuple of its values.
_FILL_READS_RECORD = _fill is not None and c_to_record is not None
# The template of the last line: the next record most often has the same shape, and _fill checks
# that (every field's type, the keyed values) for less than working out the shape's key.
_last: "_StepTemplate | None" = None


def _enc(v: Any) -> str:
    return "".join(_VALUE_ENCODER(v, 0))


def _picker(positions: list[int]) -> Any:
    """``itemgetter(*positions)`` that always returns a tuple (itemgetter of one returns the item)."""
    if len(positions) >= 2:
        return operator.itemgetter(*positions)
    if positions:
        (p,) = positions
        return lambda vals: (vals[p],)
    return lambda vals: ()


class _StepTemplate:
    """A step line for one shape of record (each field's type; the keyed fields' values) as a
    %-template: the keys, nulls and keyed values written in once, ``%r`` for each int and float
    field (what json writes for the exact types), ``%s`` for each other field's JSON (dicts and
    anything unusual, through the same encoder as :func:`dumps`). What follows the last field
    filled in (most often some 30 nulls) is kept apart, appended as it is: ``%`` reads its
    template a character at a time."""

    __slots__ = ("template", "tail", "floats", "args", "dicts", "others", "spec", "pieces")

    def __init__(self, types: tuple[type, ...], keyed: tuple[Any, ...]) -> None:
        literal = dict(zip(_KEYED, keyed))
        parts: list[str] = []  # the template: literals with % doubled, and the placeholders
        tail: list[str] = []  # the literals since the last placeholder, as they are
        floats, args, self.dicts, self.others = [], [], [], []
        spec: list[Any] = []  # _speedups.fill's: per field, the type (or the literal) it must hold
        pieces: list[str] = []  # and the text before each field's value
        cut = 0
        for i, (name, t) in enumerate(zip(STEP_FIELDS, types)):
            text = ("{" if i == 0 else ",") + _enc(name) + ":"
            if t is type(None) or (i in literal and t in (bool, str)):
                text += _enc(None if t is type(None) else literal[i])
                parts.append(text.replace("%", "%%"))
                tail.append(text)
                spec.append(None if t is type(None) else literal[i])
                pieces.append(text)
                continue
            spec.append(t)
            pieces.append(text)
            parts.append(text.replace("%", "%%"))
            if t is float or t is int:  # not a subclass: json writes float/int's own repr, %r the subclass's
                parts.append("%r")
                if t is float:
                    floats.append(i)
            else:
                (self.dicts if t is dict else self.others).append(len(args))
                parts.append("%s")
            args.append(i)
            cut, tail = len(parts), []
        self.template = "".join(parts[:cut])
        self.tail = "".join(tail) + "}"
        self.spec, self.pieces = tuple(spec), (*pieces, "}")
        self.floats = _picker(floats) if floats else None
        self.args = _picker(args)

    def line(self, vals: tuple[Any, ...]) -> str | None:
        """The line, or None when a float field is not finite (NaN/Infinity: :func:`dumps` writes
        those as strings)."""
        if self.floats is not None:
            total = sum(self.floats(vals))  # non-finite when one is (or on overflow: dumps then)
            if total - total != 0.0:
                return None
        args = self.args(vals)
        if self.dicts or self.others:
            args = list(args)
            for i in self.dicts:
                v = args[i]
                args[i] = _enc(v) if v else "{}"
            for i in self.others:
                args[i] = _enc(args[i])
            args = tuple(args)
        return self.template % args + self.tail


def step_line(rec: StepRecord) -> str:
    """``dumps(rec.to_dict())``, byte for byte, at a fraction of its cost: the line's template is
    made once per shape of record (json spent most of a line on the 45 keys and the nulls, the
    same in every line). Anything unusual (a non-finite float, a value json cannot write, a
    subclass of StepRecord, too many shapes) takes ``dumps(rec.to_dict())`` itself. Where the C
    filler is built, a record of the last line's shape is filled by it; any other, or one it
    declines (a NaN, an error), takes the Python template."""
    global _last
    if type(rec) is StepRecord and _VALUE_ENCODER is not None:
        try:
            if _fill is not None and _last is not None:
                # the record itself where _speedups has bound StepRecord (it reads the slots in
                # place), else the tuple of its values
                line = _fill(rec if _FILL_READS_RECORD else _VALUES(rec), _last.spec, _last.pieces, _enc)
                if line is not None:
                    return line
            vals = _VALUES(rec)
            key = (tuple(map(type, vals)), _KEYED_VALUES(vals))
            tmpl = _SHAPES.get(key)
            if tmpl is None and len(_SHAPES) < _MAX_SHAPES:
                tmpl = _SHAPES[key] = _StepTemplate(*key)
            if tmpl is not None:
                _last = tmpl
                line = tmpl.line(vals)
                if line is not None:
                    return line
        except Exception:  # noqa: BLE001 - dumps below says what is wrong, as it always did
            pass
    return dumps(rec.to_dict())


class _RotatingFile:
    """One file kind's live segment and its ``.1``. Written unbuffered (``os.write`` of whole
    lines): a write the disk refuses (full, quota, an I/O error) is cut back to the last whole
    line, and what it did not take is dropped and counted (:attr:`lost`), never held and appended
    later. A line longer than a segment is dropped and counted too (the disk budget is a bound).
    The live file gone (its directory deleted mid-run) is counted and made again on the next write."""

    def __init__(self, path: str, cap_bytes: int) -> None:
        self.path = path
        self.cap = max(cap_bytes, 4096)
        self.fd: int | None = append_private_fd(path, exclusive=True)
        self.size = 0
        self.lines = 0  # lines in the live segment
        self.lost = 0  # lines dropped: refused by the disk, too long, or written to a file since deleted
        # Lines the budget rotated out: a ``.1`` segment overwritten by the next rotation, and a
        # batch's oldest lines that would not fit in both segments (never written). rank<R>.json
        # says it: the report cannot tell a job resumed at step 1000 from one that lost 0-999.
        self.rotated_out = 0
        self._prev_lines: int | None = None  # lines in the ``.1`` segment (None: there is none)
        self.too_long = 0  # of which longer than a segment
        self._losing = 0  # lines lost in the current run of failures (0: writing normally)
        self._said = 0  # runs of failures logged (bounded: a disk that flaps says it a few times)

    def write_lines(self, lines: list[str]) -> None:
        """Append whole lines (ASCII JSON: a character is a byte), each segment within ``cap``:
        the file rotates to ``.1`` whenever the next line would not fit, within a batch too (a
        long flush interval hands over thousands of lines at once). Lines that the batch itself
        would rotate out of both segments are not written at all; a line longer than a segment is
        dropped and counted. Never raises for the disk: what is not written is counted in :attr:`lost`."""
        if not lines:
            return
        sizes = [len(line) + 1 for line in lines]
        if max(sizes) > self.cap:
            keep = [k for k, n in enumerate(sizes) if n <= self.cap]
            n_long = len(lines) - len(keep)
            self.lost += n_long
            self.too_long += n_long
            if self.too_long == n_long:
                logger.warning("stepwatch: a record line of %d bytes is longer than a segment of %s (%d bytes, "
                               "its share of disk_budget_mb): dropped, counted in run.json",
                               max(sizes), os.path.basename(self.path), self.cap)
            lines = [lines[k] for k in keep]
            sizes = [sizes[k] for k in keep]
            if not lines:
                return
        start, kept = len(lines), 0
        while start > 0 and kept + sizes[start - 1] <= 2 * self.cap:
            start -= 1
            kept += sizes[start]
        start = min(start, len(lines) - 1)  # the newest line is always written
        self.rotated_out += start
        i = start
        try:
            self._check_live()
            while i < len(lines):
                room, j, used = self.cap - self.size, i, 0
                while j < len(lines) and used + sizes[j] <= room:
                    used += sizes[j]
                    j += 1
                if j == i:  # the next line does not fit (every line fits an empty segment)
                    self._rotate()
                    continue
                i += self._write(lines[i:j], used)
        except _PartlyWritten as e:
            self._lose(len(lines) - i - e.kept, e.error)
            return
        except OSError as e:
            self._lose(len(lines) - i, e)
            return
        if self._losing:
            if self._said <= _LOSS_RUNS_SAID:
                logger.warning("stepwatch: writing %s again; %d records were lost meanwhile (counted in run.json)",
                               os.path.basename(self.path), self._losing)
            self._losing = 0

    def _write(self, lines: list[str], used: int) -> int:
        """Write ``lines`` (``used`` bytes) at the end of the live segment; returns how many were
        written. A short write or an error leaves only whole lines: the file is cut back to the
        last newline written, and the error is raised with the count of lines it kept."""
        data = ("\n".join(lines) + "\n").encode("ascii", "backslashreplace")
        fd = self.fd
        assert fd is not None
        done = 0
        try:
            while done < len(data):
                n = os.write(fd, data[done:] if done else data)
                if n <= 0:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.path)
                done += n
        except OSError as e:
            whole = data.rfind(b"\n", 0, done) + 1  # bytes up to the last whole line written
            try:
                os.ftruncate(fd, self.size + whole)
            except OSError:
                pass
            kept = data.count(b"\n", 0, whole)
            self.size += whole
            self.lines += kept
            raise _PartlyWritten(kept, e) from None
        self.size += used
        self.lines += len(lines)
        return len(lines)

    def _check_live(self) -> None:
        """The live file still there (not deleted with its directory), else the lines written to
        it are counted as lost and a new one is opened (the directory made again)."""
        if self.fd is not None:
            try:
                gone = os.fstat(self.fd).st_nlink == 0
            except OSError:
                gone = True
            if not gone:
                return
            self._gone()
        self._reopen()

    def _gone(self) -> None:
        if self.lines:
            self._lose(self.lines, FileNotFoundError(errno.ENOENT, "deleted while being written", self.path))
        self._close_fd()

    def _reopen(self) -> None:
        make_private_dir(os.path.dirname(self.path) or ".")
        self.fd = append_private_fd(self.path, exclusive=False)
        try:
            self.size = os.fstat(self.fd).st_size
        except OSError:
            self.size = 0
        self.lines = 0

    def _rotate(self) -> None:
        """The live segment becomes ``.1``; a new live one is opened. The old file is closed only
        once it is renamed: a rename that fails leaves it open (the next write tries again), a
        live file deleted meanwhile is counted and made again."""
        try:
            os.replace(self.path, self.path + ".1")
        except FileNotFoundError:
            self._gone()
            self._reopen()
            return
        if self._prev_lines is not None:
            self.rotated_out += self._prev_lines
        self._prev_lines = self.lines
        self._close_fd()
        self.size = 0
        self.lines = 0
        self.fd = append_private_fd(self.path, exclusive=False)

    def _lose(self, n: int, exc: BaseException) -> None:
        if n <= 0:
            return
        self.lost += n
        if not self._losing:
            self._said += 1
            if self._said <= _LOSS_RUNS_SAID:
                logger.warning("stepwatch: records are being lost: %s not written (%s); counted in run.json "
                               "until writing resumes", os.path.basename(self.path), exc)
        self._losing += n

    def _close_fd(self) -> None:
        fd, self.fd = self.fd, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass

    def close(self) -> None:
        self._close_fd()


class _PartlyWritten(Exception):
    """A write cut back to its last whole line: ``kept`` lines of it stay; ``error`` stopped it."""

    def __init__(self, kept: int, error: OSError) -> None:
        super().__init__(kept, error)
        self.kept, self.error = kept, error


# How many runs of lost records (disk full, then writing again) are logged; more are only counted.
_LOSS_RUNS_SAID = 5


def _say_earlier_launches(run_dir: str, budget_bytes: int) -> None:
    """One line when the run directory's record files from earlier launches (a resumed or
    requeued job with the same run id) already pass the disk budget, which bounds each launch's
    own files: they are kept, never rotated out by a later launch, so the directory holds more."""
    held = 0
    try:
        with os.scandir(run_dir) as it:
            for e in it:
                if e.name.startswith(("steps.", "findings.")) and e.is_file(follow_symlinks=False):
                    held += e.stat(follow_symlinks=False).st_size
    except OSError:
        return
    if held > budget_bytes:
        logger.info(
            "stepwatch: %s already holds %.1f MB of records from earlier launches, more than the disk budget "
            "(STEPWATCH_DISK_BUDGET_MB, %.1f MB), which bounds each launch's own files: the earlier ones are kept "
            "beside this launch's", run_dir, held / 1e6, budget_bytes / 1e6,
        )


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
        if ctx.rank == 0:
            _say_earlier_launches(ctx.run_dir, budget_bytes)

    def export(self, batch: Batch) -> None:
        if batch.records:
            self.steps.write_lines([step_line(r) for r in batch.records])
        if batch.findings:
            self.findings.write_lines([dumps(f.to_dict()) for f in batch.findings])

    def dropped(self) -> int:
        """Step records not written (the disk refused them, a line longer than a segment, a file
        deleted mid-run): the pipeline adds them to each batch's ``dropped``."""
        return self.steps.lost

    def rotated_out(self) -> int:
        """Step records the disk budget rotated out of the steps file (rank<R>.json says it)."""
        return self.steps.rotated_out

    def drop_counts(self) -> dict[str, int]:
        """``run.json``'s ``exporter_drops["records"]``: what this exporter lost (nonzero counts only)."""
        d = {"records": self.steps.lost, "findings": self.findings.lost}
        return {k: v for k, v in d.items() if v}

    def paths(self) -> list[str]:
        """The files this exporter writes (a rotated segment, ``.1``, beside each when it exists)."""
        return [self.steps.path, self.findings.path]

    def shutdown(self) -> None:
        self.steps.close()
        self.findings.close()

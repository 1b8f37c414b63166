"""Step lines into columns as they are read: no list of a file's lines or records is held, only
the numbers of the last few thousand lines until they are converted.

The rules are the records writer's: a line needs a finite ``step`` and ``time``; a float field
that is missing, null, non-finite, a string or a bool is unknown (NaN), never the dataclass
default; the writer spells non-finite floats as strings ("nan", "inf", "-inf"), which count in
the gradient norm, the user phases and the logged scalars, where they are the news.
"""

from __future__ import annotations

from array import array
from operator import itemgetter
from typing import Any

import numpy as np

from .columns import FLOAT_FIELDS, RankColumns, Series

NAN = float("nan")
_NONFINITE = {"nan": NAN, "inf": float("inf"), "-inf": float("-inf")}
_INT64 = (-(2**63), 2**63)


def _is_num(v: Any) -> bool:
    # json gives exactly int or float (bool is its own type); v - v is 0 only when v is finite.
    t = type(v)
    return t is int or (t is float and v - v == 0.0)


def _value(v: Any) -> float | int | None:
    """A number, non-finite included (the writer's strings too), or None."""
    t = type(v)
    if t is int or t is float:
        return v
    return _NONFINITE.get(v) if t is str else None


def _finite(v: Any) -> float:
    """A finite number as a float, else NaN (unknown)."""
    t = type(v)
    if t is float:
        return v if v - v == 0.0 else NAN
    if t is int:
        try:
            return float(v)
        except OverflowError:  # an integer no float holds: unknown rather than a crash
            return NAN
    return NAN


# Lines are gathered in chunks and converted field by field with numpy: per line only the
# dict lookups, no Python-level work per number. A chunk holds a few MB.
_CHUNK = 4096
_ROW = FLOAT_FIELDS + ("grad_norm",)
_get_row = itemgetter(*_ROW)
_NONE = type(None)
_PLAIN = frozenset((float, int, _NONE))  # what the writer's numeric fields hold


def _floats(vals: tuple) -> np.ndarray:
    """A chunk of one field: finite numbers as floats, anything else NaN (the one NaN)."""
    a = None
    if set(map(type, vals)) <= _PLAIN:  # not a bool, string or object: numpy converts it
        try:
            a = np.array(vals, dtype=np.float64)  # None -> NaN
        except OverflowError:  # an integer beyond any float
            pass
    if a is None:
        a = np.fromiter(map(_finite, vals), dtype=np.float64, count=len(vals))
    np.putmask(a, ~np.isfinite(a), np.nan)
    return a


_NAN_BITS = np.array(NAN).view(np.int64)


class _FloatColumn:
    """A float column that stays one value and a count until a second value arrives.

    Many fields never change over a run (eval_s 0.0 without evaluation, tokens per step) or are
    never recorded (MFU on a CPU): those cost nothing per record.
    """

    __slots__ = ("bits", "count", "buf")

    def __init__(self) -> None:
        self.bits, self.count, self.buf = _NAN_BITS, 0, None

    def extend(self, vals: tuple) -> None:
        a = _floats(vals)
        if self.buf is None:
            bits = a.view(np.int64)  # the same bits: -0.0 is not 0.0 (it sums differently)
            if self.count == 0:
                self.bits = bits[0]
            if (bits == self.bits).all():
                self.count += len(a)
                return
            self.buf = array("d", np.full(self.count, self.bits).view(np.float64).tobytes())
        # One buffer grown in place (no chunks to join at the end: that would need twice the
        # memory for a moment, and leave the heap in pieces).
        self.buf.frombytes(a.tobytes())

    def finish(self) -> np.ndarray | float:
        if self.buf is None:
            return float(np.array(self.bits).view(np.float64))
        return np.frombuffer(self.buf, dtype=np.float64)


class _SeriesBuilder:
    """A sparse field: values put at record indices; the records between are unknown (NaN)."""

    __slots__ = ("buf", "nan_at", "int_at")

    def __init__(self) -> None:
        self.buf = array("d")
        self.nan_at: list[int] = []
        self.int_at: list[int] = []

    def _pad(self, i: int) -> None:
        if len(self.buf) < i:
            self.buf.extend(array("d", [NAN]) * (i - len(self.buf)))

    def put(self, i: int, v: float | int) -> None:
        if len(self.buf) < i:
            self._pad(i)
        if type(v) is int:
            try:
                self.buf.append(v)
            except OverflowError:  # no float holds it: unknown
                self.buf.append(NAN)
                return
            self.int_at.append(i)
        else:
            if v != v:
                self.nan_at.append(i)
            self.buf.append(v)

    def extend(self, start: int, vals: tuple) -> None:
        """Values of the records from ``start`` on; None or not a number: unknown."""
        types = set(map(type, vals))
        if types == {_NONE}:  # all unknown: the gap is filled if a value comes later
            return
        if types <= {float, _NONE}:
            a = np.array(vals, dtype=np.float64)
            nan = np.isnan(a)
            n_nan = int(nan.sum())
            nones = vals.count(None) if _NONE in types else 0
            # Either every NaN came from a null, or there is no null and every NaN was written
            # as one; else tell them apart one by one below.
            if n_nan == nones:
                self._pad(start)
                self.buf.frombytes(a.tobytes())
                if n_nan and not nones:
                    self.nan_at.extend((np.flatnonzero(nan) + start).tolist())
                return
        for j, v in enumerate(vals):  # strings ("nan"), integers, nulls beside NaNs: one by one
            x = _value(v)
            if x is not None:
                self.put(start + j, x)

    def finish(self, n: int) -> Series:
        if not self.buf:  # never recorded (no gradient norm without the feature): no memory
            return Series(np.broadcast_to(np.float64(NAN), (n,)))
        self._pad(n)
        return Series(np.frombuffer(self.buf, dtype=np.float64), _mask(self.nan_at, n),
                      _mask(self.int_at, n))


def _mask(at: list[int], n: int) -> np.ndarray | None:
    if not at:
        return None
    m = np.zeros(n, dtype=bool)
    m[at] = True
    return m


class RankBuilder:
    """One rank's records as they are read, in file order; ``finish`` orders them by time."""

    def __init__(self) -> None:
        self.n = 0
        self.step = array("q")
        self.time = array("d")
        self.skipped = bytearray()
        self.tail = bytearray()  # evaluation/checkpoints after the last step: no training step
        self.rows: list[tuple] = []  # the chunk not yet converted: one tuple of _ROW per line
        self.floats = {k: _FloatColumn() for k in FLOAT_FIELDS}
        self.grad_norm = _SeriesBuilder()
        self.phases: dict[str, _SeriesBuilder] = {}
        self.scalars: dict[str, _SeriesBuilder] = {}
        # Each distinct sequence of scalar names -> (time, index) of its earliest record: the
        # order of first appearance after sorting, without a note per record.
        self.scalar_sigs: dict[tuple[str, ...], tuple[float, int]] = {}
        self.mfu_dtypes: set[str] = set()

    def add(self, d: dict[str, Any], step: int, t: float) -> None:
        """One record; ``step`` and ``time`` already checked. Nothing here raises."""
        i = self.n
        get = d.get
        try:
            self.rows.append(_get_row(d))
        except KeyError:  # an older or foreign writer's line lacks a field: unknown
            self.rows.append(tuple(map(get, _ROW)))
        ph = get("phases")
        if type(ph) is dict and ph:
            _put_map(self.phases, ph, i)
        sc = get("scalars")
        if type(sc) is dict and sc:
            names = _put_map(self.scalars, sc, i)
            if names:
                sig, key = tuple(names), (t, i)
                first = self.scalar_sigs.get(sig)
                if first is None or key < first:
                    self.scalar_sigs[sig] = key
        dt = get("mfu_dtype")
        if type(dt) is str and dt:  # another type cannot be shown as a dtype: unknown
            self.mfu_dtypes.add(dt)
        self.skipped.append(1 if get("skipped") else 0)
        self.tail.append(1 if get("tail") is True else 0)
        self.step.append(step)
        self.time.append(t)
        self.n = i + 1
        if len(self.rows) == _CHUNK:
            self._convert()

    def _convert(self) -> None:
        if not self.rows:
            return
        start = self.n - len(self.rows)
        cols = list(zip(*self.rows))
        self.rows.clear()
        for col, vals in zip(self.floats.values(), cols):
            col.extend(vals)
        self.grad_norm.extend(start, cols[-1])

    def finish(self) -> RankColumns:
        self._convert()
        n = self.n
        time = np.frombuffer(self.time, dtype=np.float64)
        # Stable: records written in the same clock tick keep their file order.
        order = (np.argsort(time, kind="stable") if n > 1 and (np.diff(time) < 0).any()
                 else None)

        def ordered(a):
            return a if order is None or not isinstance(a, np.ndarray) else a[order]

        def series(b: _SeriesBuilder) -> Series:
            s = b.finish(n)
            return s if order is None else s.take(order)

        first: dict[str, tuple] = {}
        for sig, (t, i) in sorted(self.scalar_sigs.items(), key=lambda x: x[1]):
            for pos, name in enumerate(sig):
                first.setdefault(name, (t, i, pos))
        return RankColumns(
            step=ordered(np.frombuffer(self.step, dtype=np.int64)),
            time=ordered(time),
            skipped=ordered(np.frombuffer(self.skipped, dtype=bool)),
            tail=ordered(np.frombuffer(self.tail, dtype=bool)) if 1 in self.tail else None,
            floats={k: ordered(c.finish()) for k, c in self.floats.items()},
            grad_norm=series(self.grad_norm),
            phases={k: series(b) for k, b in self.phases.items()},
            scalars={k: series(self.scalars[k]) for k in first},
            scalar_first=first,
            mfu_dtypes=frozenset(self.mfu_dtypes),
        )


def _put_map(into: dict[str, _SeriesBuilder], m: dict[str, Any], i: int) -> list[str]:
    """A record's phases or scalars; returns the names kept, in the record's order."""
    names = []
    for name, v in m.items():
        if type(v) is not float:  # the writer's floats go straight through
            v = _value(v)
            if v is None:
                continue
        b = into.get(name)
        if b is None:
            b = into[name] = _SeriesBuilder()
        b.put(i, v)
        names.append(name)
    return names


def add_step(builders: dict[int, RankBuilder], d: Any, file_rank: int) -> bool:
    """Add one parsed line to its rank's builder; False when it is not a step record."""
    if type(d) is not dict:
        return False
    step, t = d.get("step"), d.get("time")
    if not (_is_num(step) and _is_num(t)):
        return False
    step = int(step)
    try:
        t = float(t)
    except OverflowError:  # an integer time beyond any float
        return False
    if not _INT64[0] <= step < _INT64[1]:  # beyond a step counter of any real job
        return False
    rank = d.get("rank")
    if type(rank) is not int:
        rank = file_rank
    b = builders.get(rank)
    if b is None:
        b = builders[rank] = RankBuilder()
    b.add(d, step, t)
    return True

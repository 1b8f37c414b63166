"""A rank's step records as columns: one numpy array per field the report reads.

A ``StepRecord`` object per step costs about 1.5 KB (the object, a Python float per field, two
dicts); a week-long job has millions of steps per rank. As columns a step costs 8 bytes per
number that varies, and nothing for a field that never does or was never recorded.

Unknown stays unknown: a float column holds NaN where the record had no usable number. Sparse
fields (the gradient norm, each user phase, each logged scalar) are a ``Series``: NaN where the
record has no value, and the few values that NaN or a float cannot stand for (a recorded NaN,
an integer) noted beside it, because they read differently in the report.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# The float fields the report reads (NaN: unknown). step, time and skipped are kept apart, as are
# the sparse ones: grad_norm (a non-finite norm is the news, not an unknown), phases, scalars.
FLOAT_FIELDS = (
    "step_s", "data_wait_s", "forward_s", "backward_s", "optimizer_s", "other_s", "eval_s",
    "checkpoint_s", "mem_peak_bytes", "tokens", "mfu", "hfu", "comm_s", "comm_exposed_s",
    "overlap", "allreduce_s", "peak_tflops",
    # memory (sparse: read every STEPWATCH_MEMORY_EVERY steps)
    "mem_allocated_bytes", "mem_reserved_bytes", "host_rss_bytes", "workers_uss_bytes", "workers_pss_bytes",
)


@dataclass(slots=True)
class Series:
    """One sparse field over a rank's records, in record order."""

    # float64, NaN where the record has no value; a field never recorded is a read-only view
    # of one NaN.
    values: np.ndarray
    # True where the record held NaN itself (a known NaN: a diverged loss), else None: none did.
    recorded_nan: np.ndarray | None = None
    # True where the value was a JSON integer: shown as one ("12345", not "1.234e+04").
    was_int: np.ndarray | None = None

    def known(self) -> np.ndarray:
        k = ~np.isnan(self.values)
        return k if self.recorded_nan is None else k | self.recorded_nan

    def item(self, i: int) -> float | int:
        v = float(self.values[i])
        return int(v) if self.was_int is not None and self.was_int[i] else v

    def take(self, order: np.ndarray) -> "Series":
        if self.values.strides == (0,):  # one NaN stands for every record: nothing to order
            return self
        return Series(self.values[order],
                      None if self.recorded_nan is None else self.recorded_nan[order],
                      None if self.was_int is None else self.was_int[order])


class RankColumns:
    """One rank's records ordered by time. Arrays are shared: read them, do not write them."""

    __slots__ = ("step", "time", "skipped", "tail", "_floats", "grad_norm", "phases", "scalars",
                 "scalar_first", "mfu_dtypes")

    def __init__(self, step: np.ndarray, time: np.ndarray, skipped: np.ndarray,
                 floats: dict[str, np.ndarray | float], grad_norm: Series,
                 phases: dict[str, Series], scalars: dict[str, Series],
                 scalar_first: dict[str, tuple], mfu_dtypes: frozenset[str],
                 tail: np.ndarray | None = None):
        self.step = step  # int64
        self.time = time  # float64, unix seconds, non-decreasing
        self.skipped = skipped  # bool
        # bool: a tail record (evaluation and checkpoints after the last step), no training step
        self.tail = np.broadcast_to(np.False_, (len(time),)) if tail is None else tail  # None: none
        # A float column, or one float standing for every record: the field never changed.
        self._floats = floats
        self.grad_norm = grad_norm
        self.phases = phases  # user phase name -> Series
        self.scalars = scalars  # scalar name -> Series, in order of first appearance
        # Where each scalar first appears, (time, index in file order, position in its record):
        # the order of first appearance when ranks are pooled.
        self.scalar_first = scalar_first
        self.mfu_dtypes = mfu_dtypes  # the matmul dtypes the records name

    def __len__(self) -> int:
        return len(self.time)

    def num(self, name: str) -> np.ndarray:
        """A float field, NaN where unknown."""
        v = self._floats[name]
        return np.full(len(self.time), v) if isinstance(v, float) else v

    def phase(self, name: str) -> Series:
        return self.phases[name]

    def scalar(self, name: str) -> Series:
        return self.scalars[name]

    @property
    def phase_names(self) -> list[str]:
        return list(self.phases)

    @property
    def scalar_names(self) -> list[str]:
        return list(self.scalars)

    def nbytes(self) -> int:
        """Memory the columns hold (a one-value view counts one value)."""
        arrays = [self.step, self.time, self.skipped, self.tail, *self._floats.values()]
        for s in (self.grad_norm, *self.phases.values(), *self.scalars.values()):
            arrays += [s.values, s.recorded_nan, s.was_int]
        return sum(a.itemsize if a.strides == (0,) else a.nbytes
                   for a in arrays if isinstance(a, np.ndarray))


class PooledColumns:
    """Several ranks' records as one time-ordered sequence, made column by column when asked.

    The pooled statistics need each column once; holding them all would double the memory.
    Ties in time keep rank order, then record order (a stable sort, as the per-rank order).
    """

    def __init__(self, parts: list[RankColumns]):
        self.parts = parts
        order = np.argsort(np.concatenate([p.time for p in parts]), kind="stable")
        n = len(order)
        where = np.empty(n, dtype=np.int32 if n < 2**31 else np.int64)  # held: keep it small
        where[order] = np.arange(n, dtype=where.dtype)
        del order
        # Each rank's records' places in the pooled order: a pooled column is each rank's
        # column put in its places, with no joined copy in between.
        ends = np.cumsum([len(p) for p in parts])
        self.places = [where[e - len(p):e] for p, e in zip(parts, ends)]
        self.n = n
        self.mfu_dtypes = frozenset().union(*(p.mfu_dtypes for p in parts))
        self.phase_names = sorted(set().union(*(p.phases for p in parts)))
        first: dict[str, tuple] = {}
        for pos, p in enumerate(parts):
            for name, (t, i, k) in p.scalar_first.items():
                key = (t, pos, i, k)
                if name not in first or key < first[name]:
                    first[name] = key
        self.scalar_names = sorted(first, key=first.__getitem__)

    def __len__(self) -> int:
        return self.n

    def _pool(self, arrays: list[np.ndarray]) -> np.ndarray:
        out = np.empty(self.n, dtype=arrays[0].dtype)
        for a, at in zip(arrays, self.places):
            out[at] = a
        return out

    def _pool_series(self, parts: list[Series | None]) -> Series:
        """A rank without the field: unknown for its records."""
        values = np.full(self.n, np.nan)
        for p, at in zip(parts, self.places):
            if p is not None:
                values[at] = p.values

        def mask(get) -> np.ndarray | None:
            if all(p is None or get(p) is None for p in parts):
                return None
            m = np.zeros(self.n, dtype=bool)
            for p, at in zip(parts, self.places):
                if p is not None and get(p) is not None:
                    m[at] = get(p)
            return m

        return Series(values, mask(lambda p: p.recorded_nan), mask(lambda p: p.was_int))

    @property
    def step(self) -> np.ndarray:
        return self._pool([p.step for p in self.parts])

    @property
    def time(self) -> np.ndarray:
        return self._pool([p.time for p in self.parts])

    @property
    def skipped(self) -> np.ndarray:
        return self._pool([p.skipped for p in self.parts])

    @property
    def tail(self) -> np.ndarray:
        return self._pool([p.tail for p in self.parts])

    def num(self, name: str) -> np.ndarray:
        return self._pool([p.num(name) for p in self.parts])

    @property
    def grad_norm(self) -> Series:
        return self._pool_series([p.grad_norm for p in self.parts])

    def phase(self, name: str) -> Series:
        return self._pool_series([p.phases.get(name) for p in self.parts])

    def scalar(self, name: str) -> Series:
        return self._pool_series([p.scalars.get(name) for p in self.parts])


def pool(parts: list[RankColumns]) -> RankColumns | PooledColumns:
    """All ranks' records in time order; one rank is its own pool."""
    if not parts:
        return RankColumns(np.zeros(0, np.int64), np.zeros(0), np.zeros(0, bool),
                           dict.fromkeys(FLOAT_FIELDS, np.nan), Series(np.zeros(0)), {}, {}, {},
                           frozenset())
    return parts[0] if len(parts) == 1 else PooledColumns(parts)

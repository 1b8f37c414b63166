"""SLO math over a window of scrapes, the way PromQL does it.

- quantiles: ``histogram_quantile(q, rate(X_bucket[w]))`` = the quantile of the bucket *deltas*
  between the window's first and last scrape, interpolated linearly inside the bucket (Prometheus
  promql/quantile.go: lower bound 0 for the first bucket, the highest finite bound when the rank
  falls in +Inf);
- rates and ratios from counter deltas (``rate``/``increase``), a counter that went down counts as
  a restart from zero (Prometheus' reset rule), checked at every scrape in the window, as PromQL
  does: a server restarted mid-window adds what it counted before and after the restart;
- everything per series (``engine``, ``model_name``), so several engines stay apart.

Unknown stays ``None`` (no requests in the window has no P99), never a plausible wrong number.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from .parse import Labels, Samples, first_present, series_key


@dataclass(frozen=True, slots=True)
class Scrape:
    mono: float  # time.monotonic() when read: windows and rates
    wall: float  # time.time(): what findings carry
    samples: Samples


def sum_by_series(samples: Samples, names: tuple[str, ...], where: dict[str, set[str]] | None = None) -> dict[Labels, float]:
    """Sum a sample over all labels except the series labels; ``where`` keeps only matching label values."""
    name = first_present(samples, names)
    out: dict[Labels, float] = {}
    if name is None:
        return out
    for labels, v in samples[name].items():
        if where is not None:
            d = dict(labels)
            if any(d.get(k) not in vals for k, vals in where.items()):
                continue
        key = series_key(labels)
        out[key] = out.get(key, 0.0) + v
    return out


def counter_increase(old: float | None, new: float) -> float:
    """Prometheus' reset rule: a counter that went down restarted from zero."""
    if old is None:
        return 0.0
    return new if new < old else new - old


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Quantile from cumulative (upper bound, count) pairs sorted by bound, +Inf last.

    Same result as PromQL's ``histogram_quantile`` over the same buckets. None when there are no
    observations or the buckets are not a valid histogram (no +Inf bucket, counts going down).
    """
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q must be within 0..1, got {q}")
    if not buckets or not math.isinf(buckets[-1][0]):
        return None
    total = buckets[-1][1]
    if total <= 0:
        return None
    prev_count = 0.0
    for _, c in buckets:
        if c < prev_count - 1e-9:
            return None
        prev_count = c
    rank = q * total
    prev_bound, prev_count = 0.0, 0.0
    for i, (bound, count) in enumerate(buckets):
        if count >= rank:
            if math.isinf(bound):
                return buckets[i - 1][0] if i > 0 else None
            if i == 0 and bound <= 0:
                return bound
            in_bucket = count - prev_count
            if in_bucket <= 0:
                return bound
            return prev_bound + (bound - prev_bound) * (rank - prev_count) / in_bucket
        prev_bound, prev_count = bound, count
    return None


def _buckets(samples: Samples, base: str) -> dict[Labels, dict[float, float]]:
    out: dict[Labels, dict[float, float]] = {}
    for labels, v in samples.get(base + "_bucket", {}).items():
        d = dict(labels)
        try:
            le = float(d["le"])
        except (KeyError, ValueError):
            continue
        key = series_key(labels)
        per = out.setdefault(key, {})
        per[le] = per.get(le, 0.0) + v  # several API servers' label sets fold into one series
    return out


class Window:
    """What changed between two scrapes of one server. ``old=None`` means "since the server
    started" (every counter began at zero); rates are then unknown (no duration). ``between``: the
    scrapes taken between the two, oldest first: a counter reset is looked for at each (the ends
    alone miss a restart whose new counts passed the old ones, and count none of what came before
    it)."""

    def __init__(self, old: Scrape | None, new: Scrape, between: Sequence[Scrape] = ()) -> None:
        self.old, self.new = old, new
        self.seconds = (new.mono - old.mono) if old is not None else 0.0
        self._chain = (old, *between, new) if old is not None else (new,)

    def series(self) -> set[Labels]:
        """Every engine series seen in the newest scrape."""
        out: set[Labels] = set()
        for per in self.new.samples.values():
            for labels in per:
                key = series_key(labels)
                if key:
                    out.add(key)
        return out

    def increase(self, names: tuple[str, ...], where: dict[str, set[str]] | None = None) -> dict[Labels, float]:
        new = sum_by_series(self.new.samples, names, where)
        if self.old is None:
            return dict(new)  # since the server started: its counters began at zero
        chain = [sum_by_series(s.samples, names, where) for s in self._chain[:-1]]
        out: dict[Labels, float] = {}
        for k, v in new.items():
            total, prev = 0.0, chain[0].get(k, 0.0)
            for sums in chain[1:]:
                cur = sums.get(k)
                if cur is not None:  # a scrape without the series (a restarted server's first) adds nothing
                    total += counter_increase(prev, cur)
                    prev = cur
            out[k] = total + counter_increase(prev, v)
        return out

    def rate(self, names: tuple[str, ...], where: dict[str, set[str]] | None = None) -> dict[Labels, float | None]:
        inc = self.increase(names, where)
        if self.seconds <= 0:
            return {k: None for k in inc}
        return {k: v / self.seconds for k, v in inc.items()}

    def ratio(self, num: tuple[str, ...], den: tuple[str, ...], min_den: float = 1.0) -> dict[Labels, float | None]:
        """Δnum / Δden per series; None when Δden < min_den (too little traffic to say)."""
        n, d = self.increase(num), self.increase(den)
        return {k: (n.get(k, 0.0) / dv if dv >= min_den else None) for k, dv in d.items()}

    def gauge(self, names: tuple[str, ...]) -> dict[Labels, float]:
        return sum_by_series(self.new.samples, names)

    def quantiles(self, bases: tuple[str, ...], qs: tuple[float, ...]) -> dict[Labels, dict[float, float | None]]:
        base = first_present(self.new.samples, tuple(b + "_bucket" for b in bases))
        if base is None:
            return {}
        base = base[: -len("_bucket")]
        chain = [_buckets(s.samples, base) for s in self._chain]
        out: dict[Labels, dict[float, float | None]] = {}
        for key, nb in chain[-1].items():
            acc = dict.fromkeys(nb, 0.0) if len(chain) > 1 else dict(nb)  # one scrape: since the start
            prev = chain[0].get(key, {})
            for per in chain[1:]:
                cur = per.get(key)
                if cur is None:
                    continue
                # A restarted server's histogram counts from zero again: take it whole.
                reset = cur.get(math.inf, 0.0) < prev.get(math.inf, 0.0)
                for le in acc:
                    c = cur.get(le, 0.0)
                    acc[le] += c if reset else c - prev.get(le, 0.0)
                prev = cur
            out[key] = {q: histogram_quantile(q, sorted(acc.items())) for q in qs}
        return out

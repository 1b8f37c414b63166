"""Hand-drawn inline SVG charts: no JavaScript, no fonts, no network, so the page opens anywhere.

Long runs are thinned before drawing so that a 200,000-step run still makes a page of a few MB:
lines keep each bucket's minimum and maximum (a spike survives thinning), stacked areas keep each
bucket's mean (min and max do not add up across layers).
"""

from __future__ import annotations

import math
from html import escape
from typing import Callable, Sequence

import numpy as np

W, H = 880, 260
# A stacked chart of 5 layers draws each point twice per layer; 600 is below one per pixel.
STACK_POINTS = 600
ML, MR, MT, MB = 64, 16, 12, 34  # margins: room for tick labels

# Distinct hues that stay readable on white; ranks cycle through them.
PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2",
           "#17becf", "#7f7f7f", "#bcbd22")


def minmax_downsample(
    x: np.ndarray, y: np.ndarray, max_points: int
) -> tuple[np.ndarray, np.ndarray]:
    """At most ``max_points`` points, keeping each bucket's lowest and highest y in x order."""
    n = len(x)
    if n <= max_points or max_points < 4:
        return x, y
    nb = max_points // 2
    edges = np.linspace(0, n, nb + 1).astype(int)
    keep: list[int] = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        seg = y[lo:hi]
        ok = ~np.isnan(seg)
        if not ok.any():
            keep.append(lo)  # keep the gap visible
            continue
        masked_lo = np.where(ok, seg, np.inf)
        masked_hi = np.where(ok, seg, -np.inf)
        a, b = lo + int(masked_lo.argmin()), lo + int(masked_hi.argmax())
        keep.extend(sorted({a, b}))
    idx = np.asarray(keep, dtype=int)
    return x[idx], y[idx]


def mean_downsample(x: np.ndarray, ys: Sequence[np.ndarray], max_points: int):
    """At most ``max_points`` points, each the mean of a bucket of consecutive points."""
    n = len(x)
    if n <= max_points:
        return x, list(ys)
    edges = np.linspace(0, n, max_points + 1).astype(int)
    starts = edges[:-1]
    counts = np.diff(edges)
    xm = np.add.reduceat(x.astype(float), starts) / counts
    return xm, [np.add.reduceat(y, starts) / counts for y in ys]


def nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    if not (math.isfinite(lo) and math.isfinite(hi)) or hi <= lo:
        return [lo]
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]


class _Frame:
    def __init__(self, x0: float, x1: float, y0: float, y1: float):
        self.x0, self.x1 = x0, (x1 if x1 > x0 else x0 + 1)
        self.y0, self.y1 = y0, (y1 if y1 > y0 else y0 + 1)

    def px(self, x):
        return ML + (x - self.x0) / (self.x1 - self.x0) * (W - ML - MR)

    def py(self, y):
        return H - MB - (y - self.y0) / (self.y1 - self.y0) * (H - MT - MB)


def _axes(f: _Frame, yfmt: Callable[[float], str], xlabel: str) -> list[str]:
    out = [f'<rect x="{ML}" y="{MT}" width="{W - ML - MR}" height="{H - MT - MB}" '
           f'fill="none" stroke="#ccc"/>']
    for t in nice_ticks(f.y0, f.y1):
        y = f.py(t)
        out.append(f'<line x1="{ML}" x2="{W - MR}" y1="{y:.1f}" y2="{y:.1f}" stroke="#eee"/>')
        out.append(f'<text x="{ML - 6}" y="{y + 4:.1f}" text-anchor="end">{escape(yfmt(t))}</text>')
    for t in nice_ticks(f.x0, f.x1, 8):
        x = f.px(t)
        out.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{H - MB}" y2="{H - MB + 4}" '
                   'stroke="#999"/>')
        label = f"{t:.0f}" if abs(t) >= 1 or t == 0 else f"{t:.2g}"
        out.append(f'<text x="{x:.1f}" y="{H - MB + 16}" text-anchor="middle">{label}</text>')
    out.append(f'<text x="{(ML + W - MR) / 2:.0f}" y="{H - 4}" text-anchor="middle" '
               f'fill="#666">{escape(xlabel)}</text>')
    return out


def _svg(title: str, body: list[str], kind: str) -> str:
    return (f'<svg class="chart" data-chart="{escape(kind)}" viewBox="0 0 {W} {H}" width="{W}" '
            f'height="{H}" role="img" font-family="sans-serif" font-size="11">'
            f'<title>{escape(title)}</title>' + "".join(body) + "</svg>")


def _segments(x: np.ndarray, y: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """Split where y is unknown or x goes back (a restart resumed from an earlier step)."""
    if len(x) == 0:
        return []
    brk = np.isnan(y)
    back = np.zeros(len(x), dtype=bool)
    back[1:] = np.diff(x) < 0
    out, start = [], 0
    for i in range(len(x) + 1):
        if i == len(x) or brk[i] or back[i]:
            if i > start:
                out.append((x[start:i], y[start:i]))
            start = i + 1 if i < len(x) and brk[i] else i
    return out


def line_chart(
    series: Sequence[tuple[str, np.ndarray, np.ndarray, str]],
    *,
    title: str,
    yfmt: Callable[[float], str],
    xlabel: str = "step",
    max_points: int = 2000,
    kind: str = "line",
    from_zero: bool = True,
) -> str:
    """One line per (label, x, y, colour) series; y NaN leaves a gap.

    Durations start at zero so heights compare; a loss curve (``from_zero=False``) spans its
    own range, or its changes would be a flat line.
    """
    def finite(y):  # an inf loss cannot be drawn: it leaves a gap like an unknown
        y = np.asarray(y, float)
        return np.where(np.isfinite(y), y, np.nan)

    thinned = [(lab, *minmax_downsample(np.asarray(x, float), finite(y), max_points), c)
               for lab, x, y, c in series]
    xs = np.concatenate([s[1] for s in thinned]) if thinned else np.zeros(0)
    ys = np.concatenate([s[2] for s in thinned]) if thinned else np.zeros(0)
    ys = ys[np.isfinite(ys)]
    if xs.size == 0 or ys.size == 0:
        return _svg(title, [f'<text x="{W / 2}" y="{H / 2}" text-anchor="middle">no data</text>'],
                    kind)
    lo, hi = float(ys.min()), float(ys.max())
    if from_zero:
        lo, hi = min(0.0, lo), hi * 1.05
    else:
        pad = (hi - lo) * 0.05 or abs(hi) * 0.05 or 1.0
        lo, hi = lo - pad, hi + pad
    f = _Frame(float(xs.min()), float(xs.max()), lo, hi)
    body = _axes(f, yfmt, xlabel)
    for label, x, y, color in thinned:
        for sx, sy in _segments(x, y):
            if len(sx) == 1:
                body.append(f'<circle cx="{f.px(sx[0]):.1f}" cy="{f.py(sy[0]):.1f}" r="2" '
                            f'fill="{color}"/>')
                continue
            pts = " ".join(f"{a:.1f},{b:.1f}" for a, b in zip(f.px(sx), f.py(sy)))
            body.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.2" '
                        f'points="{pts}"><title>{escape(label)}</title></polyline>')
    return _svg(title, body, kind)


def stacked_top(x: np.ndarray, ys: Sequence[np.ndarray], max_points: int = STACK_POINTS) -> float:
    """The highest point ``stacked_chart`` would draw: small multiples share one y axis."""
    if len(x) == 0 or not ys:
        return 0.0
    _, thin = _thin_layers(np.asarray(x, float), ys, max_points)
    return float(np.sum(np.vstack(thin), axis=0).max())


def _thin_layers(x: np.ndarray, ys: Sequence[np.ndarray], max_points: int):
    """``mean_downsample`` of the layers, unknown counted as zero, one layer at a time: a long
    run's layers are megabytes each, their thinned points a few kilobytes."""
    thin = []
    for y in ys:
        xt, (yt,) = mean_downsample(x, [np.nan_to_num(np.asarray(y, float), nan=0.0)], max_points)
        thin.append(yt)
    return xt, thin


def stacked_chart(
    x: np.ndarray,
    layers: Sequence[tuple[str, np.ndarray, str]],
    *,
    title: str,
    yfmt: Callable[[float], str],
    xlabel: str = "step",
    max_points: int = STACK_POINTS,
    kind: str = "stacked",
    y_max: float | None = None,
) -> str:
    """Stacked areas, bottom layer first. Unknown values count as zero height."""
    x = np.asarray(x, float)
    if len(x) == 0 or not layers:
        return _svg(title, [f'<text x="{W / 2}" y="{H / 2}" text-anchor="middle">no data</text>'],
                    kind)
    x, ys = _thin_layers(x, [y for _, y, _ in layers], max_points)
    tops = np.cumsum(np.vstack(ys), axis=0)
    top = max(float(tops[-1].max()), y_max or 0.0)
    f = _Frame(float(x.min()), float(x.max()), 0.0, top * 1.05 or 1.0)
    body = _axes(f, yfmt, xlabel)
    px = f.px(x)
    bottom = np.zeros_like(x)
    for (label, _, color), top in zip(layers, tops):
        if len(x) == 1:
            w = (W - ML - MR) * 0.5
            body.append(f'<rect x="{px[0] - w / 2:.1f}" y="{f.py(top[0]):.1f}" width="{w:.1f}" '
                        f'height="{f.py(bottom[0]) - f.py(top[0]):.1f}" fill="{color}"/>')
        else:
            fwd = " ".join(f"{a:.1f},{b:.1f}" for a, b in zip(px, f.py(top)))
            back = " ".join(f"{a:.1f},{b:.1f}" for a, b in zip(px[::-1], f.py(bottom)[::-1]))
            body.append(f'<polygon fill="{color}" fill-opacity="0.85" stroke="none" '
                        f'points="{fwd} {back}"><title>{escape(label)}</title></polygon>')
        bottom = top
    return _svg(title, body, kind)

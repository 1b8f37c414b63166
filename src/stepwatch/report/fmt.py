"""How numbers read in the terminal and on the page. Unknown (``None``) reads as an en dash."""

from __future__ import annotations

UNKNOWN = "–"


def dur(s: float | None) -> str:
    if s is None:
        return UNKNOWN
    a = abs(s)
    if a >= 1e7:  # past ~4 months a corrupt value, not a time: a 300-digit number broke the tables
        return f"{s:.3g} s"
    if a >= 100:
        return f"{s:.0f} s"
    if a >= 10:
        return f"{s:.1f} s"
    if a >= 1:
        return f"{s:.2f} s"
    if a >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    if a == 0:
        return "0"
    return f"{s * 1e6:.3g} µs"


def pct(x: float | None) -> str:
    return UNKNOWN if x is None else f"{x * 100:.1f}%"


def rate(x: float | None) -> str:
    if x is None:
        return UNKNOWN
    for div, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.3g}{suffix}"
    return f"{x:.3g}"


def nbytes(x: float | None) -> str:
    if x is None:
        return UNKNOWN
    v = float(x)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(v) < 1024:
            return f"{v:.3g} {unit}" if unit != "B" else f"{v:.0f} B"
        v /= 1024
    return f"{v:.3g} TiB"


def num(x: float | None) -> str:
    if x is None:
        return UNKNOWN
    if isinstance(x, int):
        return str(x)
    return f"{x:.4g}"


def by_unit(x: float | None, unit: str) -> str:
    return {"s": dur, "share": pct, "rate": rate, "bytes": nbytes}.get(unit, num)(x)


def delta(x: float | None, rel: float | None, unit: str) -> str:
    if x is None:
        return UNKNOWN
    if unit == "share":
        body = f"{x * 100:+.1f} pp"
    elif unit == "count":
        body = f"{x:+d}" if isinstance(x, int) else f"{x:+.4g}"
    else:
        sign = "+" if x >= 0 else "-"
        body = sign + by_unit(abs(x), unit)
    if rel is not None and unit != "share":
        body += f" ({rel * 100:+.1f}%)"
    return body


def steps_range(first: int | None, last: int | None) -> str:
    if first is None:
        return UNKNOWN
    return str(first) if first == last else f"{first}–{last}"

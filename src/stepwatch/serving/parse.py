"""``/metrics`` text -> samples, with prometheus_client's parser; bad text is counted, not fatal.

The parser raises on the first bad line and loses the rest of the text, so the text is cut into
metric families (a family starts at its ``# HELP``/``# TYPE`` lines) and each is parsed on its
own; a family that fails is parsed again line by line under its header, so one bad line costs one
sample. A text that does not end in a newline was cut off in transit: its last line is dropped
(``..._total 56`` of a cut ``..._total 5614`` would parse, wrongly).
"""

from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass, field
from typing import Iterable

from . import names as N

log = logging.getLogger("stepwatch.serving")

Labels = tuple[tuple[str, str], ...]  # sorted (name, value) pairs: hashable, order-free


@dataclass
class ParseErrors:
    """Lines (or whole texts) that could not be read. Logged once per distinct reason."""

    count: int = 0
    _seen: set[str] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, why: str, n: int = 1) -> None:
        with self._lock:
            self.count += n
            first = why not in self._seen and len(self._seen) < 32
            if first:
                self._seen.add(why)
        if first:
            log.warning("stepwatch serve-vllm: skipped unreadable /metrics text: %s (counted in %s)", why, N.OUT_SCRAPE_ERRORS)


# sample name -> {labels: value}
Samples = dict[str, dict[Labels, float]]


def _family_blocks(lines: list[str]) -> Iterable[tuple[list[str], list[str]]]:
    """(header lines, sample lines) per family, in order."""
    header: list[str] = []
    body: list[str] = []
    for line in lines:
        if line.startswith("#"):
            parts = line.split(None, 3)
            is_meta = len(parts) >= 3 and parts[1] in ("HELP", "TYPE")
            if is_meta and body:
                yield header, body
                header, body = [], []
            if is_meta and header and parts[2] != header[-1].split(None, 3)[2]:
                # A new family whose HELP/TYPE follows another's header with no samples between.
                yield header, body
                header, body = [], []
            if is_meta:
                header.append(line)
            continue
        if line.strip():
            body.append(line)
    if header or body:
        yield header, body


def _wanted(header: list[str], body: list[str], keep: frozenset[str] | None) -> bool:
    if keep is None:
        return True
    if header:
        fam = header[0].split(None, 3)[2]
        return any(k.startswith(fam) for k in keep) or any(line.split("{", 1)[0].split(" ", 1)[0] in keep for line in body[:1])
    return any(line.split("{", 1)[0].split(" ", 1)[0] in keep for line in body)


def _add(out: Samples, families, keep: frozenset[str] | None) -> None:
    for fam in families:
        for s in fam.samples:
            if keep is not None and s.name not in keep:
                continue
            v = float(s.value)
            if math.isnan(v):
                continue
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = v


def parse_metrics(text: str, errors: ParseErrors | None = None, keep: frozenset[str] | None = N.KEEP) -> Samples:
    """Parse Prometheus text exposition; keep only sample names in ``keep`` (None = all)."""
    from prometheus_client.parser import text_string_to_metric_families

    errors = errors if errors is not None else ParseErrors()
    out: Samples = {}
    if not isinstance(text, str):
        errors.add(f"not text ({type(text).__name__})")
        return out
    lines = text.split("\n")
    if text and not text.endswith("\n"):
        cut = lines.pop()
        errors.add("text cut off mid-line (no final newline); dropped its last line")
        log.debug("dropped cut line %r", cut[:200])
    for header, body in _family_blocks(lines):
        if not _wanted(header, body, keep):
            continue
        block = "\n".join(header + body) + "\n"
        try:
            _add(out, list(text_string_to_metric_families(block)), keep)
            continue
        except Exception as e:  # the parser raises ValueError/IndexError/KeyError on bad text
            fam = header[0].split(None, 3)[2] if header else (body[0][:40] if body else "?")
            log.debug("family %s failed to parse (%r); retrying line by line", fam, e)
        head = "\n".join(header) + "\n" if header else ""
        for line in body:
            try:
                _add(out, list(text_string_to_metric_families(head + line + "\n")), keep)
            except Exception as e:
                errors.add(f"bad line in family {line.split('{', 1)[0].split(' ', 1)[0][:80]!r}: {type(e).__name__}")
    if keep is not None and not out and text.strip():
        errors.add("no vLLM metric in the text (not a vLLM /metrics page?)")
    return out


def first_present(samples: Samples, candidates: tuple[str, ...]) -> str | None:
    """The first of ``candidates`` (newest vLLM name first) that this scrape has."""
    for name in candidates:
        if name in samples:
            return name
    return None


def series_key(labels: Labels) -> Labels:
    """The labels that name an engine's series (engine, model_name); others are dropped."""
    return tuple((k, v) for k, v in labels if k in N.SERIES_LABELS)

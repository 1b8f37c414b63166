"""An OTel ``MetricReader`` that a ``prometheus_client`` registry scrapes.

The metrics are made with the OTel SDK (one set of instruments for OTLP and Prometheus); at each
scrape this reader collects them and hands ``prometheus_client`` the metric families, named as the
OTel-Prometheus compatibility spec says: ``[^a-zA-Z0-9:]`` in names and ``[^a-zA-Z0-9]`` in label
keys become ``_``, the OTel unit becomes the name's suffix (``s`` -> ``_seconds``), monotonic sums
are counters (``_total``), other sums and gauges are gauges, explicit-bucket histograms are
histograms, and the resource is one ``target_info`` series.

Why not ``opentelemetry-exporter-prometheus``: it is published only as pre-releases, each tied to
one SDK version, so depending on it forced one OTel SDK on every user's environment.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from opentelemetry.sdk.metrics.export import (
    Gauge,
    Histogram,
    MetricReader,
    MetricsData,
    Sum,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)

_NAME_BAD = re.compile(r"[^a-zA-Z0-9:]+")
_LABEL_BAD = re.compile(r"[^a-zA-Z0-9]+")
# The OTel units stepwatch uses (and the usual others) as Prometheus name suffixes.
_UNITS = {"s": "seconds", "ms": "milliseconds", "us": "microseconds", "ns": "nanoseconds",
          "By": "bytes", "MiBy": "mebibytes", "W": "watts", "J": "joules", "Cel": "celsius",
          "Hz": "hertz", "%": "percent", "1": "", "": ""}


def prom_name(name: str) -> str:
    name = "_" + name[1:] if name[:1].isdigit() else name
    return _NAME_BAD.sub("_", name)


def prom_label(key: str) -> str:
    key = "_" + key[1:] if key[:1].isdigit() else key
    return _LABEL_BAD.sub("_", key)


def prom_unit(unit: str) -> str:
    unit = re.sub(r"\{.*\}", "", unit or "")
    if unit in _UNITS:
        return _UNITS[unit]
    return _NAME_BAD.sub("_", unit).strip("_")


def _label_value(v: Any) -> str:
    return v if isinstance(v, str) else json.dumps(v, default=str)


class PrometheusReader(MetricReader):
    """Register on ``registry``; every scrape collects the SDK's current (cumulative) values."""

    def __init__(self, registry: Any) -> None:
        super().__init__(preferred_temporality={})  # the SDK default: cumulative everywhere
        self._lock = threading.Lock()
        self._data: MetricsData | None = None
        self._registry = registry
        registry.register(self)  # prometheus_client calls .collect() on a scrape

    # MetricReader: collect() lands here, synchronously, on the scraping thread.
    def _receive_metrics(self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: Any) -> None:
        self._data = metrics_data

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        try:
            self._registry.unregister(self)
        except KeyError:
            pass

    def describe(self) -> Iterable[Metric]:
        return []  # registering must not run a collection

    def collect(self, timeout_millis: float = 10_000) -> Iterator[Metric]:  # type: ignore[override]
        # Two methods in one name: the SDK's MetricReader.collect() pulls the instruments;
        # prometheus_client's Collector.collect() wants families back. Do the first, then yield.
        with self._lock:
            self._data = None
            super().collect(timeout_millis=timeout_millis)
            data = self._data
        if data is None:
            return
        yield from self._families(data)

    def _families(self, data: MetricsData) -> Iterator[Metric]:
        families: dict[tuple[str, str], Metric] = {}
        target: dict[str, str] = {}
        for rm in data.resource_metrics:
            target.update({prom_label(k): _label_value(v) for k, v in rm.resource.attributes.items()})
            for sm in rm.scope_metrics:
                for metric in sm.metrics:
                    self._add(families, metric)
        if target:
            info = InfoMetricFamily("target", "Target metadata", labels=list(target))
            info.add_metric(list(target), target)
            yield info
        yield from families.values()

    def _add(self, families: dict[tuple[str, str], Metric], metric: Any) -> None:
        d = metric.data
        points = list(d.data_points)
        labels = [{prom_label(k): _label_value(v) for k, v in p.attributes.items()} for p in points]
        keys = sorted({k for lab in labels for k in lab})
        rows = [[lab.get(k, "") for k in keys] for lab in labels]
        name, unit, doc = prom_name(metric.name), prom_unit(metric.unit), metric.description or ""
        counter = isinstance(d, Sum) and d.is_monotonic
        if counter:
            cls: type = CounterMetricFamily
        elif isinstance(d, (Gauge, Sum)):
            cls = GaugeMetricFamily
        elif isinstance(d, Histogram):
            cls = HistogramMetricFamily
        else:  # exponential histograms: Prometheus' text format has no such type
            return
        fam = families.get((name, cls.__name__))
        if fam is None:
            fam = families[(name, cls.__name__)] = cls(name, doc, labels=keys, unit=unit)
        for row, p in zip(rows, points):
            if cls is HistogramMetricFamily:
                fam.add_metric(row, buckets=_buckets(p.bucket_counts, p.explicit_bounds), sum_value=p.sum)
            else:
                fam.add_metric(row, p.value)


def _buckets(counts: Sequence[int], bounds: Sequence[float]) -> list[tuple[str, float]]:
    out, total = [], 0
    for le, c in zip([*map(str, bounds), "+Inf"], counts):
        total += c
        out.append((le, total))
    return out


__all__ = ["PrometheusReader", "prom_label", "prom_name", "prom_unit"]

"""The Grafana dashboard: one time-series panel per query in :mod:`stepwatch.rules.queries`, in
three rows (training, GPU health, serving). The panels run exactly those strings, which the tests
run against Prometheus.
"""

from __future__ import annotations

from typing import Any

from .queries import ALL, Query

SECTIONS = (("training", "Training"), ("gpu", "GPU health (DCGM names)"), ("serving", "Serving (vLLM)"))
_DS = {"type": "prometheus", "uid": "${datasource}"}


def _panel(q: Query, pid: int, x: int, y: int) -> dict[str, Any]:
    return {
        "id": pid,
        "type": "timeseries",
        "title": q.title,
        "datasource": _DS,
        "gridPos": {"h": 8, "w": 8, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": q.unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}},
        "targets": [{"refId": "A", "datasource": _DS, "expr": q.expr, "legendFormat": q.legend}],
    }


def build(title: str = "stepwatch", uid: str = "stepwatch") -> dict[str, Any]:
    panels: list[dict[str, Any]] = []
    pid, y = 1, 0
    for section, name in SECTIONS:
        panels.append({"id": pid, "type": "row", "title": name, "collapsed": False, "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
        pid, y = pid + 1, y + 1
        qs = [q for q in ALL if q.section == section]
        for i, q in enumerate(qs):
            panels.append(_panel(q, pid, (i % 3) * 8, y + (i // 3) * 8))
            pid += 1
        y += ((len(qs) + 2) // 3) * 8
    return {
        "title": title,
        "uid": uid,
        "tags": ["stepwatch", "training", "gpu", "vllm"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {
            "list": [{"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Prometheus", "current": {}}]
        },
        "panels": panels,
    }


def queries_in(dashboard: dict[str, Any]) -> list[str]:
    """Every PromQL string a dashboard's panels run (what the tests check against Prometheus)."""
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]

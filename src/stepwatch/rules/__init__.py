"""Prometheus alerting rules, their ``promtool test rules`` file and a Grafana dashboard, generated
from the metric names in :mod:`stepwatch.exporters.names` (``stepwatch rules``,
``stepwatch dashboard``). Pure data and string building: no Prometheus needed to generate.
"""

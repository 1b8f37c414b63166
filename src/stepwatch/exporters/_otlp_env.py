"""The OpenTelemetry SDK's environment variables that decide whether OTLP export is on, and where
to: read here once, with no OTel import, for the exporter (``otel.py``) and for the cheap check
before it loads (``builtin.otlp_configured``)."""

from __future__ import annotations

from typing import Mapping

# Standard OpenTelemetry SDK variables (opentelemetry-specification,
# specification/configuration/sdk-environment-variables.md and protocol/exporter.md).
OTEL_SERVICE_NAME = "OTEL_SERVICE_NAME"
OTEL_RESOURCE_ATTRIBUTES = "OTEL_RESOURCE_ATTRIBUTES"
OTEL_SDK_DISABLED = "OTEL_SDK_DISABLED"
OTEL_METRICS_EXPORTER = "OTEL_METRICS_EXPORTER"
ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
PROTOCOL_VARS = ("OTEL_EXPORTER_OTLP_METRICS_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
# The Python SDK's default OTLP protocol is gRPC (its `otlp` exporter entry point), kept here.
PROTOCOLS = ("grpc", "http/protobuf")
DEFAULT_SERVICE_NAME = "stepwatch"


def otlp_endpoint(environ: Mapping[str, str]) -> str | None:
    """The configured OTLP metrics endpoint, or None when OTLP is off."""
    if environ.get(OTEL_SDK_DISABLED, "").strip().lower() == "true":
        return None
    exporters = [e.strip().lower() for e in environ.get(OTEL_METRICS_EXPORTER, "").split(",") if e.strip()]
    if exporters and "otlp" not in exporters:
        return None  # e.g. OTEL_METRICS_EXPORTER=none
    for var in ENDPOINT_VARS:
        v = environ.get(var, "").strip()
        if v:
            return v
    return None

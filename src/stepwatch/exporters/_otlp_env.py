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
INSECURE_VARS = ("OTEL_EXPORTER_OTLP_METRICS_INSECURE", "OTEL_EXPORTER_OTLP_INSECURE")
CERTIFICATE_VARS = ("OTEL_EXPORTER_OTLP_METRICS_CERTIFICATE", "OTEL_EXPORTER_OTLP_CERTIFICATE")
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


def tls_by_default(environ: Mapping[str, str]) -> str | None:
    """The line to say when the gRPC exporter will use TLS only because the endpoint has no scheme
    (``localhost:4317``; the SDK takes TLS unless the scheme is ``http`` or INSECURE is set): a
    plaintext collector then refuses every handshake, and gRPC's C core logs each one. None when
    the user said what they want (a scheme, INSECURE, a certificate) or the protocol is HTTP."""
    for var in PROTOCOL_VARS:
        v = environ.get(var, "").strip().lower()
        if v:
            if v != "grpc":
                return None
            break
    if any(environ.get(v, "").strip() for v in INSECURE_VARS + CERTIFICATE_VARS):
        return None
    for var in ENDPOINT_VARS:
        v = environ.get(var, "").strip()
        if v:
            if "://" in v:
                return None
            return (f"stepwatch: {var}={v!r} has no scheme, so the OpenTelemetry SDK connects to it with TLS; "
                    f"a plaintext collector refuses that (gRPC then logs a handshake failure about once a second). "
                    f"For a plaintext collector write http://{v}, or set OTEL_EXPORTER_OTLP_INSECURE=true; for TLS, "
                    f"https://{v}.")
    return None

"""GPU telemetry as a session feature: start the sampler, and on every background pass hand its
samples to the exporters, summarise them into each record's ``gpu`` object, and diagnose."""

from __future__ import annotations

from typing import Any

from ..record import Finding, StepRecord


class TelemetryFeature:
    name = "gpu_telemetry"

    def __init__(self, source: Any) -> None:
        self.source = source

    def collect(self, records: list[StepRecord]) -> tuple[list[dict[str, Any]], list[Finding]]:
        samples = self.source.drain()
        for r in records:
            r.gpu = self.source.window(r.time - r.step_s, r.time)
        return samples, self.source.analyze(samples, records)

    def stop(self) -> None:
        self.source.stop()

    def status(self) -> dict[str, Any]:
        return dict(self.source.status)


def install(session: Any) -> TelemetryFeature | None:
    """Called on the training thread at init (CUDA's current device is per thread)."""
    from .nvml import current_cuda_uuid
    from .source import TelemetrySource

    cfg = session.config
    src = TelemetrySource.from_config(cfg, session.ctx, device=cfg.gpu_device or current_cuda_uuid())
    src.start()
    return TelemetryFeature(src)

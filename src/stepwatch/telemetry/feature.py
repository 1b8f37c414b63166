"""GPU telemetry as a session feature: start the sampler, and on every background pass hand its
samples to the exporters, summarise them into each record's ``gpu`` object, and diagnose."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..record import Finding, StepRecord

if TYPE_CHECKING:
    from .._feature import Hub


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


def install(hub: "Hub") -> TelemetryFeature | None:
    """Called on the training thread at init (CUDA's current device is per thread)."""
    from .nvml import current_cuda_uuid
    from .source import TelemetrySource

    cfg = hub.config
    src = TelemetrySource.from_config(cfg, hub.ctx, device=cfg.gpu_device or current_cuda_uuid())
    src.start()
    return TelemetryFeature(src)

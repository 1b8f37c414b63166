"""GPU health telemetry: NVML + GPM (NVIDIA) or amdsmi (AMD), under the DCGM exporter's names.

Importing this package is cheap: ``pynvml``/``amdsmi`` load on the sampler thread at ``start()``.
See docs/telemetry.md.
"""

from .diagnose import Analyzer, CheckpointWatch, checkpoint_fields, find_gpu_stragglers, sm_series
from .fields import FIELDS
from .nvml import current_cuda_uuid
from .source import TelemetrySource
from .summary import samples_between, summarize_window

__all__ = [
    "FIELDS",
    "Analyzer",
    "CheckpointWatch",
    "TelemetrySource",
    "checkpoint_fields",
    "current_cuda_uuid",
    "find_gpu_stragglers",
    "samples_between",
    "sm_series",
    "summarize_window",
]

"""stepwatch: one import, and every rank of a PyTorch training job measures itself.

    import stepwatch.auto          # or: stepwatch.init(...)

Public surface (pinned by tests/unit/test_api.py::test_public_api_is_pinned): :func:`init`, :func:`shutdown`,
:func:`step`, :func:`phase`, :func:`log`, :func:`set_step`, :func:`get_session`, the exporter
contract (:class:`Exporter`, :class:`Batch`, :class:`InMemoryExporter`) and the record types.
Importing this package is cheap: torch and the exporters load when a session starts.
"""

from ._version import __version__

from ._api import get_session, init, log, phase, set_step, shutdown, step
from .config import Config, ConfigError
from .exporters.base import Batch, Exporter, InMemoryExporter
from .record import Finding, StepRecord

__all__ = [
    "Batch",
    "Config",
    "ConfigError",
    "Exporter",
    "Finding",
    "InMemoryExporter",
    "StepRecord",
    "__version__",
    "get_session",
    "init",
    "log",
    "phase",
    "set_step",
    "shutdown",
    "step",
]

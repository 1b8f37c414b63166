"""Which exporters a session starts from its config. The session calls :func:`build_exporters`.

Each built-in exporter is imported only when its feature is on, so an unused exporter costs
nothing at import time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._log import logger
from .base import Exporter

if TYPE_CHECKING:
    from ..config import Config
    from ..context import RunContext


def build_exporters(config: "Config", ctx: "RunContext") -> list[Exporter]:
    out: list[Exporter] = []
    if config.records:
        from .records import RecordsExporter

        try:
            out.append(RecordsExporter(ctx, budget_bytes=config.disk_budget_mb * 1024 * 1024))
        except OSError as e:
            # An unwritable run dir must not stop the job: warn and go on without files.
            logger.warning("cannot write to the run directory %s (%s): going on without files", ctx.run_dir, e)
    if config.console != "off" and ctx.rank == config.console_rank:
        from .console import ConsoleExporter

        out.append(ConsoleExporter(config, ctx))
    if config.prometheus_port is not None or (config.otel and otlp_configured()):
        # Imported only when on: the OTel SDK and prometheus_client cost ~100 ms to import.
        try:
            from .otel import OTelExporter

            out.append(
                OTelExporter(
                    ctx,
                    prometheus_port=config.prometheus_port,
                    prometheus_host=config.prometheus_host,
                    otlp=None if config.otel else False,
                )
            )
        except ImportError as e:
            logger.warning(
                "metrics export is off: %s. Install it with: pip install opentelemetry-sdk "
                "opentelemetry-exporter-otlp prometheus_client", e,
            )
        except ValueError as e:  # a bad OTEL_* value: named in the message
            logger.warning("metrics export is off: %s", e)
    out.extend(_tracking_sinks(config, ctx))
    out.extend(config.exporters)
    return out


def _tracking_sinks(config: "Config", ctx: "RunContext") -> list[Exporter]:
    """TensorBoard when asked for; W&B unless turned off, inert until the script has a run of its
    own (docs/sinks.md). Neither library is imported here."""
    out: list[Exporter] = []
    if config.tensorboard is not None:
        import importlib.util

        if isinstance(config.tensorboard, str) and importlib.util.find_spec("tensorboard") is None:
            logger.warning(
                "STEPWATCH_TENSORBOARD=%s: TensorBoard export is off: the tensorboard package is not "
                "installed. Install it with: pip install tensorboard", config.tensorboard,
            )
        else:
            from .tensorboard import TensorBoardExporter

            out.append(TensorBoardExporter(ctx, config.tensorboard))
    if config.wandb:
        from .wandb import WandbExporter

        out.append(WandbExporter(ctx))
    # MLflow's exporter is started with the session's features (session.py): its probe of the
    # thread-local active run must be on the training thread from the first step.
    return out


def otlp_configured() -> bool:
    """Cheap pre-check (no OTel import) of what ``otel.otlp_endpoint`` decides in full."""
    import os

    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    wanted = [e.strip().lower() for e in os.environ.get("OTEL_METRICS_EXPORTER", "").split(",") if e.strip()]
    if wanted and "otlp" not in wanted:
        return False
    return any(os.environ.get(v, "").strip() for v in ("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"))

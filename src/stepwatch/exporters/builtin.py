"""Which exporters a session starts from its config. The session calls :func:`exporter_specs`.

Each exporter is one :class:`ExporterSpec`: a name and a ``build`` that makes it (or returns None
when it cannot run here, after saying why). The pipeline builds and runs each on its own (the
records file on its background thread, every other exporter on a thread of its own, see
:mod:`stepwatch.exporters.worker`), so one that fails to start, or is slow, costs no other.
Each built-in exporter is imported only when its feature is on, so an unused exporter costs
nothing at import time.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from .._log import logger
from .base import Exporter

if TYPE_CHECKING:
    from ..config import Config
    from ..context import RunContext


@dataclass(frozen=True)
class ExporterSpec:
    name: str
    build: Callable[[], Exporter | None]
    #: Run on the pipeline's background thread (the records file); else on a thread of its own.
    inline: bool = False


def exporter_specs(config: "Config", ctx: "RunContext") -> list[ExporterSpec]:
    out: list[ExporterSpec] = []
    if config.records:
        out.append(ExporterSpec("records", functools.partial(_records, config, ctx), inline=True))
    if config.console != "off" and ctx.rank == config.console_rank:
        out.append(ExporterSpec("console", functools.partial(_console, config, ctx)))
    elif config.console != "off" and ctx.rank == 0 and config.console_rank >= ctx.world_size:
        logger.warning("STEPWATCH_CONSOLE_RANK=%d, but this job has %d rank(s) (0 .. %d): no rank prints the "
                       "live console", config.console_rank, ctx.world_size, ctx.world_size - 1)
    if otel_wanted(config):
        out.append(ExporterSpec("otel", functools.partial(_otel, config, ctx)))
    out.extend(_tracking_sinks(config, ctx))
    names = {s.name for s in out}
    for e in config.exporters:
        name = str(getattr(e, "name", type(e).__name__))
        k = 2
        while name in names:  # two sinks of one class: each counted under its own name
            name = f"{getattr(e, 'name', type(e).__name__)}#{k}"
            k += 1
        names.add(name)
        out.append(ExporterSpec(name, functools.partial(_given, e)))
    return out


def build_exporters(config: "Config", ctx: "RunContext") -> list[Exporter]:
    """Every exporter of ``config`` built here and now, in this thread (tools and tests)."""
    return [e for e in (s.build() for s in exporter_specs(config, ctx)) if e is not None]


def otel_wanted(config: "Config") -> bool:
    return config.prometheus_port is not None or (config.otel and otlp_configured())


def preload(config: "Config") -> None:
    """Import what the configured exporters need (the OTel SDK and OTLP exporter take 1-2 s),
    so that they are loaded before the job can end: at interpreter exit they can no longer be
    imported (the SDK's import runs a thread pool, refused after ``concurrent.futures`` shut down).
    Failures are left to the exporter's own build to report."""
    if not otel_wanted(config):
        return
    import importlib
    import os

    try:
        from . import otel

        if config.otel and otlp_configured():
            importlib.import_module(otel.OTLP_MODULES[otel.otlp_protocol(os.environ)])
        if config.prometheus_port is not None:
            from . import prometheus  # noqa: F401
    except Exception:  # noqa: BLE001 - reported by the build, under the exporter's name
        pass


def _records(config: "Config", ctx: "RunContext") -> Exporter | None:
    from .records import RecordsExporter

    try:
        return RecordsExporter(ctx, budget_bytes=config.disk_budget_mb * 1024 * 1024)
    except OSError as e:
        # An unwritable run dir must not stop the job: warn (once) and go on without files.
        from .._files import say_unwritable

        say_unwritable(ctx.run_dir, "the records file", e)
        return None


def _console(config: "Config", ctx: "RunContext") -> Exporter:
    from .console import ConsoleExporter

    return ConsoleExporter(config, ctx)


def _otel(config: "Config", ctx: "RunContext") -> Exporter | None:
    # Imported only when on: the OTel SDK and prometheus_client cost ~100 ms to import.
    try:
        from .otel import OTelExporter

        return OTelExporter(
            ctx,
            prometheus_port=config.prometheus_port,
            prometheus_host=config.prometheus_host,
            otlp=None if config.otel else False,
            # The session gives every exporter the same shutdown budget; its flush uses it.
            shutdown_timeout_s=1.0,
        )
    except ImportError as e:
        logger.warning(
            "metrics export is off: %s. Install it with: pip install opentelemetry-sdk "
            "opentelemetry-exporter-otlp prometheus_client", e,
        )
    except ValueError as e:  # a bad OTEL_* value: named in the message
        logger.warning("metrics export is off: %s", e)
    return None


def _given(e: Exporter) -> Exporter:
    return e


def _tracking_sinks(config: "Config", ctx: "RunContext") -> list[ExporterSpec]:
    """TensorBoard when asked for; W&B unless turned off, inert until the script has a run of its
    own (docs/sinks.md). Neither library is imported here."""
    out: list[ExporterSpec] = []
    if isinstance(config.tensorboard, str):
        out.append(ExporterSpec("tensorboard", functools.partial(_tensorboard, config, ctx)))
    # W&B's and MLflow's exporters, and TensorBoard's into a writer of the user's, are started with
    # the session's features (_session.py): their probes of the active run, and the writer's
    # wrapped close, must be on the training thread from the first step.
    return out


def _tensorboard(config: "Config", ctx: "RunContext") -> Exporter | None:
    import importlib.util

    if isinstance(config.tensorboard, str) and importlib.util.find_spec("tensorboard") is None:
        logger.warning(
            "STEPWATCH_TENSORBOARD=%s: TensorBoard export is off: the tensorboard package is not "
            "installed. Install it with: pip install tensorboard", config.tensorboard,
        )
        return None
    from .tensorboard import TensorBoardExporter

    return TensorBoardExporter(ctx, config.tensorboard)


def otlp_configured() -> bool:
    """Whether the environment turns OTLP export on (no OTel import): ``_otlp_env`` decides."""
    import os

    from ._otlp_env import otlp_endpoint

    return otlp_endpoint(os.environ) is not None

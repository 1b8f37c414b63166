"""Communication: AllReduce time and overlap with backward, bus bandwidth, stragglers (docs/comm.md).

``install(hub)`` wires everything in through the session's hub (``_feature.py``): a collector
on the training thread (spans of DDP buckets and FSDP2 collectives, and the training thread's
time blocked in the job's own collectives and in ``Work.wait()``), an enricher on the
background thread (comm_s, allreduce_s, comm_exposed_s, overlap, algbw/busbw, comm_wait_s), and
detectors (overlap, busbw, the cross-rank straggler exchange). Importing this package is cheap; torch loads at install.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .._feature import Hub

from .. import _dist

__all__ = ["CommFeature", "install"]


class CommFeature:
    """What ``install`` started; ``stop()`` undoes the patches (called at shutdown)."""

    name = "comm"  # its key in run.json's features (the config's name)

    def __init__(self) -> None:
        self.collector: Any = None
        self.ddp: Any = None
        self.collectives: Any = None
        self.blocked: Any = None
        self.enricher: Any = None
        self.stragglers: Any = None
        self.overlap: Any = None
        self.busbw: Any = None
        self.nccl_log: Any = None
        self.final_pass: Any = lambda: False  # the hub's: True during shutdown's last pass

    def stop(self) -> None:
        # The blocked-time wrappers sit above fsdp.py's (installed after them): removed first.
        for part in (self.blocked, self.collectives, self.ddp):
            if part is not None:
                part.uninstall()

    def status(self) -> dict[str, Any]:
        out = {
            "ddp_models": len(self.ddp.models) if self.ddp is not None else 0,
            "not_measured": list(self.ddp.unmeasured) if self.ddp is not None else [],
        }
        if self.busbw is not None:
            out["busbw_judged"] = self.busbw.why_not or f"{self.busbw.judged} batch(es) of collectives judged"
        if self.nccl_log is not None:
            out["nccl_debug_file"] = self.nccl_log.status()
        return out

    def collect(self, records: list[Any]) -> tuple[list[Any], list[Any]]:
        """Each background pass: NCCL's own warnings from the user's NCCL_DEBUG_FILE, if set."""
        # Only on passes that carry records: the pipeline opens its exporters with the first record,
        # and a finding of an earlier pass would have nowhere to go.
        found: list[Any] = []
        if self.stragglers is not None and self.final_pass():
            # Shutdown: the straggler exchange's last window, bounded (comm/stragglers.py, finish).
            found = self.stragglers.finish()
        if self.nccl_log is None or not records:
            return [], found
        return [], found + self.nccl_log.poll(records[-1].step)


def install(hub: "Hub") -> CommFeature | None:
    """Register the comm collector, enricher and detectors through ``hub``; None when off."""
    cfg = hub.config
    if not getattr(cfg, "comm", True):
        return None
    import torch.distributed as dist

    if not dist.is_available():
        from .._log import logger

        logger.info("torch.distributed is not available: communication is not measured")
        return None
    from .blocked import BlockedTimer
    from .findings import LowBusbwDetector, OverlapDetector
    from .fsdp import CollectivePatches
    from .hooks import DDPCommHooks
    from .overlap import CommEnricher
    from .spans import CommCollector
    from .stragglers import StragglerDetector

    feat = CommFeature()
    feat.final_pass = lambda: hub.final_pass
    # The progress board (the capture feature may set it after this) is read when a collective starts.
    # The collector joins the step tracker's at the first collective (or forward-end event).
    feat.collector = CommCollector(progress_getter=lambda: hub.progress,
                                   on_first=lambda: hub.add_collector(feat.collector))
    feat.busbw = LowBusbwDetector(None)
    timeline = None
    if cfg.records:
        from .timeline import TimelineWriter

        timeline = TimelineWriter(hub.ctx.run_dir, cfg.window)
    feat.enricher = CommEnricher(cfg.window, large_sink=_large_sink(feat.busbw), timeline=timeline)
    feat.ddp = DDPCommHooks(feat.collector, hub.report_error)
    feat.collectives = CollectivePatches(feat.collector, hub.report_error, hub.tracker)
    # The training thread's time blocked in the job's own collectives and in Work.wait():
    # exposed communication, not compute (blocked.py).
    feat.blocked = BlockedTimer(feat.collector, hub.tracker, hub.report_error)
    feat.ddp.install()
    feat.collectives.install()
    feat.blocked.install()
    # A collective inside an evaluation span is held until the span is judged (spans.step_part).
    hub.add_eval_span_listener(feat.collector.eval_judged)
    hub.add_enricher(feat.enricher)
    feat.overlap = OverlapDetector(cfg.window, cfg.overlap_threshold, exposed_of=feat.enricher.ddp_exposed_s)
    ctx = hub.ctx
    enricher = feat.enricher

    def on_floor(floor_s: float) -> None:
        enricher.global_floor_s = floor_s

    feat.stragglers = StragglerDetector(
        every=cfg.straggler_every,
        margin=cfg.straggler_margin,
        windows=cfg.straggler_windows,
        rank=ctx.rank,
        host=ctx.host,
        store_factory=_dist.default_store,
        world_factory=lambda: _dist.world()[1],
        namespace=_dist.namespace(ctx.run_id, getattr(ctx, "attempt", 0), "strag"),
        on_floor=on_floor,
    )
    for det in (feat.overlap, feat.busbw, feat.stragglers):
        hub.add_detector(det)
    from .nccl_log import NcclLogWatch

    # Read where the user sent NCCL's output; never set it for them (that would take NCCL's
    # messages out of their stderr).
    feat.nccl_log = NcclLogWatch.from_env(os.environ, rank=ctx.rank, host=ctx.host)
    return feat  # the session calls stop() at shutdown


def _large_sink(det: Any) -> Any:
    """Feed large CUDA collectives to the busbw detector, resolving the baseline on first use."""
    from .findings import baseline

    state = {"resolved": False}

    def sink(rec: Any, span: Any, algbw: float, busbw: float) -> None:
        if not state["resolved"]:
            state["resolved"] = True
            import torch

            name = torch.cuda.get_device_name() if torch.cuda.is_available() else None
            local = int(os.environ.get("LOCAL_WORLD_SIZE", span.world) or span.world)
            det.base = baseline(name, span.world, max(1, span.world // max(local, 1)))
            if det.base is None:
                from .._log import logger

                logger.info("stepwatch: low_busbw: no healthy busbw baseline for %s x%d (the reference has "
                            "H100 SXM numbers only): bus bandwidth is measured, not judged", name, span.world)
        det.note(rec, span, algbw, busbw)

    return sink

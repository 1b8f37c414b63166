"""FLOPs, MFU, tokens and grad-norm as a session feature: wires the measuring parts
(``metrics/flops.py``, ``metrics/peaks.py``, ``metrics/grads.py``, ``metrics/tokens.py``) into the
tracker and the background pipeline. Measures nothing itself.

Training thread: each root module's call is handed to the throughput collector
(FLOPs counted once per input signature on fake tensors — the count's one-off time is kept out
of the step — tokens and samples read from the batch); the optimizer pre-hook queues the
grad-norm probe *before* the optimizer phase opens, so its cost shows in ``other_s``, not in
``optimizer_s``. Background thread: the enrichers fill ``flops``/``mfu``/``hfu``/``tokens``/
``samples`` and ``grad_norm``; the detectors raise grad-norm spikes, non-finite grads and MFU drops.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

from .. import _dist
from ..record import Finding, StepRecord

if TYPE_CHECKING:
    from .._feature import Hub


class TrainingMetrics:
    name = "training_metrics"

    def __init__(self, hub: "Hub") -> None:
        from .grads import GradNormCollector, GradNormEnricher, GradNormSources, GradNormSpikeDetector, clipping
        from .tokens import ThroughputCollector
        from .lowmfu import LowMfuDetector
        from .peaks import MfuDropDetector, MfuEnricher, PeakResolver

        cfg = hub.config
        self.hub = hub
        self.resolver = PeakResolver(cfg.peak_tflops)
        self.grads = GradNormCollector(every=cfg.grad_norm_every).install()
        # A FLOP count on a cache miss is stepwatch's own one-off time, kept out of the step; the
        # lookup on every other forward is part of the step like any hook.
        self.throughput = ThroughputCollector(flops=cfg.flops, exclude=hub.exclude,
                                              watch_trainable=lambda: hub.add_listener(self.throughput.recheck))
        self.mfu = MfuEnricher(None)
        self.device: str | None = None
        self._lint_done = False
        hub.add_collector(self.grads)
        hub.add_collector(self.throughput)
        hub.add_listener(self._first_step)
        hub.add_enricher(self.mfu)
        sources = GradNormSources()  # which optimizers made a norm, from the enricher to the detector
        hub.add_enricher(GradNormEnricher(self._exchange, sources=sources))
        hub.add_detector(GradNormSpikeDetector(cfg.grad_norm_spike_abs, cfg.grad_norm_spike_factor, cfg.grad_norm_window,
                                               sources=sources, clipping=clipping))
        hub.add_detector(MfuDropDetector(cfg.mfu_drop_points, cfg.mfu_drop_window_s))
        hub.add_detector(LowMfuDetector(cfg.low_mfu, cfg.window, captures_dir=os.path.join(hub.ctx.run_dir, "captures"),
                                        device=lambda: self.device))
        hub.add_forward_observer(self._first_forward)
        hub.add_forward_observer(self.throughput.on_forward)
        hub.add_reevaluation_observer(self.throughput.on_reevaluation)
        hub.add_recompute_observer(self.throughput.on_recompute)
        hub.add_exception_observer(self.throughput.on_exception)
        hub.add_eval_span_listener(self.throughput.on_eval_span)
        hub.add_optimizer_observer(self.grads.on_optimizer_step)
        hub.add_manual_update_observer(self.grads.on_manual_update)
        # The peak before step 0's record reaches the pipeline thread, where it can be: a given
        # peak needs no device, and a job without CUDA has none to wait for (at the end of the
        # first step, a listener, the record was often built already: step 0's MFU was null).
        if cfg.peak_tflops is not None:
            self.mfu.peaks = self.resolver.peaks(None)
        torch = sys.modules.get("torch")
        if torch is not None and not torch.cuda.is_available():
            self._device_known()

    # -- training thread --------------------------------------------------------------------------

    def _first_forward(self, module: Any, args: Any, kwargs: Any) -> None:
        """Once, at the first root forward (an FSDP1 model is wrapped by then): the grad-norm tap
        takes FSDP1's clip if the job imported FSDP after stepwatch started."""
        self.hub.remove_forward_observer(self._first_forward)
        self.grads.probe.patch_late()
        torch = sys.modules.get("torch")
        if self.device is None and torch is not None and torch.cuda.is_initialized():
            self._device_known()  # a GPU model is on its device by its first forward

    def _first_step(self, step: int) -> None:
        """The device is known once training ran a step (if not at the first forward)."""
        self.hub.remove_listener(self._first_step)
        if self.device is None:
            self._device_known()

    def _device_known(self) -> None:
        """Ask for the device's name on the training thread (never creating a CUDA context: only
        when CUDA is already initialized), and its peak."""
        torch = sys.modules.get("torch")
        name = None
        if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
            name = torch.cuda.get_device_name(torch.cuda.current_device())
        self.device = name or "cpu"
        self.hub.set_device(self.device)
        self.mfu.peaks = self.resolver.peaks(name)

    # -- background thread -------------------------------------------------------------------------

    def _exchange(self) -> Any:
        rank, world = _dist.world()
        if world < 2:
            return None
        from .grads import StoreNormExchange

        return StoreNormExchange(_dist.default_store(), rank, world,
                                 prefix=_dist.namespace(self.hub.ctx.run_id, "gradnorm"))

    def collect(self, records: list[StepRecord]) -> tuple[list[dict[str, Any]], list[Finding]]:
        findings: list[Finding] = []
        if not self._lint_done and self.throughput.first_count is not None:
            self._lint_done = True
            from .flops import alignment_finding

            f = alignment_finding(self.throughput.first_count, rank=self.hub.ctx.rank,
                                  step=records[0].step if records else None)
            if f is not None:
                findings.append(f)
        return [], findings

    def stop(self) -> None:
        self.grads.uninstall()
        self.throughput.detach()

    def status(self) -> dict[str, Any]:
        peaks = self.mfu.peaks
        cache = self.throughput.cache
        # The FLOP replays are kept out of the steps (stepwatch's own one-off time): said here.
        return {"device": self.device, "peak_tflops": peaks if not isinstance(peaks, dict) else dict(peaks),
                "flop_replays": cache.replays, "flop_replay_s": round(cache.replay_ns / 1e9, 3),
                "flop_predicted": cache.predicted}


def install(hub: "Hub") -> TrainingMetrics:
    return TrainingMetrics(hub)

"""Grad-norm probe on CPU: equals ``torch.nn.utils.get_total_norm`` of the unscaled grads, reuses
``clip_grad_norm_``'s tensor, sees through GradScaler (fused and not), flags non-finite grads and
skipped steps, and leaves the training result bit-identical."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
from torch.nn.utils import clip_grad_norm_ as clip_imported_early  # as scripts do, before any install
from torch.optim.optimizer import register_optimizer_step_pre_hook

from stepwatch.metrics.grads import GradNormProbe, StoreNormExchange, combine_sharded


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))


def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


class Hooked:
    """A probe wired the way the session wires it: the global optimizer step pre-hook."""

    def __init__(self, **kw) -> None:
        self.skipped: list = []
        self.probe = GradNormProbe(on_skipped=self.skipped.append, **kw).install()
        self.pending: list = []
        self.handle = register_optimizer_step_pre_hook(lambda opt, a, k: self._pre(opt))

    def _pre(self, opt) -> None:
        p = self.probe.on_optimizer_step(opt)
        self.pending.append(p)

    def values(self) -> list:
        return [None if p is None else self.probe.resolve(p) for p in self.pending]

    def close(self) -> None:
        self.handle.remove()
        self.probe.uninstall()


@pytest.fixture
def hooked():
    made = []

    def make(**kw):
        h = Hooked(**kw)
        made.append(h)
        return h

    yield make
    for h in made:
        h.close()


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def test_plain_equals_get_total_norm(hooked):
    h = hooked()
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    want = []
    for step in range(3):
        x, y = data(step)
        opt.zero_grad()
        nn.functional.mse_loss(m(x), y).backward()
        want.append(torch.nn.utils.get_total_norm([p.grad for p in m.parameters()]).item())
        opt.step()
    got = h.values()
    assert all(not r.from_clip and not r.nonfinite and not r.skipped for r in got)
    for r, w in zip(got, want):
        assert rel(r.norm, w) < 1e-5


def test_clip_grad_norm_tensor_is_reused_and_is_pre_clip(hooked):
    h = hooked()
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    x, y = data(0)
    nn.functional.mse_loss(m(x), y).backward()
    pre = torch.nn.utils.get_total_norm([p.grad for p in m.parameters()]).item()
    returned = torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm=pre / 10)
    after = torch.nn.utils.get_total_norm([p.grad for p in m.parameters()]).item()
    opt.step()
    (r,) = h.values()
    assert r.from_clip
    assert rel(r.norm, pre) < 1e-6 and r.norm == returned.item()
    assert after < pre / 5  # clipping did happen; we report the pre-clip norm


def test_clip_of_other_params_is_not_reused(hooked):
    h = hooked()
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    x, y = data(0)
    nn.functional.mse_loss(m(x), y).backward()
    full = torch.nn.utils.get_total_norm([p.grad for p in m.parameters()]).item()
    torch.nn.utils.clip_grad_norm_(m[0].parameters(), max_norm=1e9)  # only the first layer
    opt.step()
    (r,) = h.values()
    assert not r.from_clip and rel(r.norm, full) < 1e-5


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("explicit_unscale", [False, True])
def test_grad_scaler_gives_unscaled_norm(hooked, fused, explicit_unscale):
    """GradScaler("cpu") works in torch 2.13; fused Adam on CPU takes the scale-passing path."""
    h = hooked()
    m = model()
    opt = torch.optim.Adam(m.parameters(), lr=1e-3, fused=fused)
    assert getattr(opt, "_step_supports_amp_scaling", False) == fused
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    x, y = data(0)
    scaler.scale(nn.functional.mse_loss(m(x), y)).backward()
    want = torch.nn.utils.get_total_norm([p.grad for p in m.parameters()]).item() / 2.0**12
    if explicit_unscale:
        scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    (r,) = h.values()
    assert rel(r.norm, want) < 1e-5
    assert not r.skipped and not h.skipped


def test_grad_scale_of_an_optimizer_that_delegates_attributes_is_still_read(hooked):
    """The probe reads ``optimizer.grad_scale`` from the instance's dict (no exception raised
    and caught per step), except for a class that could give it another way: a wrapper whose
    ``__getattr__`` answers from an inner object still has its norm unscaled, and a plain
    optimizer with the attribute set on the instance too."""

    class Plain(torch.optim.Optimizer):  # SGD's own step refuses a grad_scale unless fused
        def __init__(self, params):
            super().__init__(params, dict(lr=0.1))

        @torch.no_grad()
        def step(self, closure=None):
            for g in self.param_groups:
                for p in g["params"]:
                    p.add_(p.grad, alpha=-g["lr"])

    class Delegating(Plain):
        def __init__(self, params, inner):
            super().__init__(params)
            self.__dict__["_inner"] = inner

        def __getattr__(self, name):
            return getattr(self.__dict__["_inner"], name)

    class Inner:
        grad_scale = torch.tensor(4.0)

    for make in (lambda ps: Delegating(ps, Inner()), Plain):
        h = hooked()
        m = model()
        opt = make(m.parameters())
        if not isinstance(opt, Delegating):
            opt.grad_scale = torch.tensor(4.0)  # what GradScaler.step sets for a fused optimizer
        x, y = data(0)
        nn.functional.mse_loss(m(x), y).backward()
        want = torch.nn.utils.get_total_norm([p.grad for p in m.parameters()]).item() / 4.0
        opt.step()
        (r,) = h.values()
        assert rel(r.norm, want) < 1e-5, type(opt).__name__
        h.close()


def test_grad_scaler_with_unscale_and_clip_reuses_clip(hooked):
    h = hooked()
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    x, y = data(0)
    scaler.scale(nn.functional.mse_loss(m(x), y)).backward()
    scaler.unscale_(opt)
    want = torch.nn.utils.get_total_norm([p.grad for p in m.parameters()]).item()
    torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
    scaler.step(opt)
    scaler.update()
    (r,) = h.values()
    assert r.from_clip and rel(r.norm, want) < 1e-6


def test_nonfinite_grads_flagged_and_scaler_skipped_step_reported(hooked):
    h = hooked()
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    # Plain optimizer: a NaN grad reaches the pre-hook.
    x, y = data(0)
    nn.functional.mse_loss(m(x), y).backward()
    m[0].weight.grad[0, 0] = float("nan")
    opt.step()
    (r,) = h.values()
    assert r.nonfinite and math.isnan(r.norm)
    # GradScaler: it skips optimizer.step, so the pre-hook never fires; the tap reports it.
    scaler = torch.amp.GradScaler("cpu")
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    scaler.scale(nn.functional.mse_loss(m(x), y)).backward()
    m[2].bias.grad[0] = float("inf")
    before = [p.detach().clone() for p in m.parameters()]
    scaler.step(opt)
    scaler.update()
    assert len(h.pending) == 1  # no pre-hook call for the skipped step
    assert all(torch.equal(a, b) for a, b in zip(before, m.parameters()))
    (pending,) = h.skipped
    res = h.probe.resolve(pending)
    assert res.skipped and res.nonfinite


def test_every_n(hooked):
    h = hooked(every=3)
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for step in range(7):
        x, y = data(step)
        opt.zero_grad()
        nn.functional.mse_loss(m(x), y).backward()
        opt.step()
    assert [p is not None for p in h.pending] == [True, False, False, True, False, False, True]
    with pytest.raises(ValueError, match="every must be"):
        GradNormProbe(every=0)


def train(steps: int, probe: bool) -> tuple[list[float], list[torch.Tensor]]:
    h = Hooked() if probe else None
    try:
        m = model()
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        losses = []
        for step in range(steps):
            x, y = data(step)
            opt.zero_grad()
            loss = nn.functional.mse_loss(m(x), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
            opt.step()
            losses.append(loss.item())
        return losses, [p.detach().clone() for p in m.parameters()]
    finally:
        if h is not None:
            assert len(h.pending) == steps and all(r.from_clip for r in h.values())
            h.close()


def test_losses_bit_identical_with_probe_on_and_off():
    off_losses, off_params = train(6, probe=False)
    on_losses, on_params = train(6, probe=True)
    assert on_losses == off_losses
    assert all(torch.equal(a, b) for a, b in zip(on_params, off_params))


def test_uninstall_restores_torch_functions():
    orig_clip = torch.nn.utils.clip_grad_norm_
    orig_step = torch.amp.GradScaler.step
    a, b = GradNormProbe().install(), GradNormProbe().install()
    assert torch.nn.utils.clip_grad_norm_ is not orig_clip
    a.uninstall()
    assert torch.nn.utils.clip_grad_norm_ is not orig_clip  # b still needs it
    b.uninstall()
    assert torch.nn.utils.clip_grad_norm_ is orig_clip and torch.amp.GradScaler.step is orig_step


def test_combine_sharded_math():
    # Two ranks with shards of squares 9 and 16, plus a replicated part of norm 12 on both.
    assert combine_sharded([(9.0, 12.0), (16.0, 12.0)]) == pytest.approx(13.0)
    assert combine_sharded([9.0, 16.0]) == pytest.approx(5.0)
    with pytest.raises(ValueError, match="local_by_rank"):
        combine_sharded([])


def test_store_exchange_single_process_two_ranks():
    """Two exchange objects on one real HashStore stand in for two ranks."""
    import torch.distributed as dist

    store = dist.HashStore()
    r0, r1 = StoreNormExchange(store, 0, 2, slots=4), StoreNormExchange(store, 1, 2, slots=4)
    r0.publish(5, (9.0, 0.0))
    assert r0.poll(5) is None and r1.poll(5) is None  # rank 1 not in yet
    r1.publish(5, (16.0, 0.0))
    assert r1.poll(5) is None  # rank 0 has not combined yet
    assert r0.poll(5) == pytest.approx(5.0)
    assert r1.poll(5) == pytest.approx(5.0)
    # Step 9 reuses slot 1: stale values from step 5 are not taken for step 9.
    r0.publish(9, (1.0, 0.0))
    assert r0.poll(9) is None


def _res(norm, skipped=False):
    from stepwatch.metrics.grads import GradNormResult

    return GradNormResult(norm, (0.0, norm), False, not math.isfinite(norm), skipped, False)


def test_spike_detector_absolute_relative_and_nonfinite():
    from stepwatch.metrics.grads import GradNormSpikeDetector

    d = GradNormSpikeDetector(abs_threshold=10.0, factor=5.0, window=20)
    assert all(d.observe_result(i, _res(1.0 + 0.01 * i)) is None for i in range(12))
    f = d.observe_result(12, _res(6.0))  # 5.x times the median of ~1.05
    assert f.kind == "grad_norm_spike" and "rolling median" in f.summary
    assert d.observe_result(13, _res(7.0)).kind == "grad_norm_spike"  # each step: the rate limit counts them
    assert d.observe_result(14, _res(1.0)) is None  # recovered
    f = d.observe_result(15, _res(11.0))
    assert f.kind == "grad_norm_spike" and "above 10" in f.summary
    f = d.observe_result(16, _res(float("inf"), skipped=True))
    assert f.kind == "nonfinite_grads" and f.severity == "critical" and f.data["skipped"]
    with pytest.raises(ValueError, match="factor"):
        GradNormSpikeDetector(factor=1.0)


def test_a_norm_high_all_along_is_said_so_and_triggers_no_capture():
    """A fresh ResNet-18's norm is 45-62 every step, a WGAN-GP critic's ~13: above the absolute
    threshold (10, reference B.7) at each one. Each step's finding said "spike" and asked for a
    capture of the next steps, which are like the ones before. Once the rolling median is known
    and the norm is not a jump from it, the finding says the norm is high all along
    (``data.steady``), and it asks for no capture; a jump still does."""
    from stepwatch.capture.triggers import triggers_capture
    from stepwatch.metrics.grads import GradNormSpikeDetector

    d = GradNormSpikeDetector(abs_threshold=10.0, factor=5.0, window=20)
    first = [d.observe_result(i, _res(50.0 + i % 7)) for i in range(10)]
    assert all(f.kind == "grad_norm_spike" and not f.data["steady"] for f in first)  # no median yet
    assert all(triggers_capture(f) for f in first)
    f = d.observe_result(10, _res(52.0))
    assert f.data["steady"] and "high all along" in f.summary and "rolling median 52" in f.summary, f.summary
    assert not triggers_capture(f)
    f = d.observe_result(11, _res(400.0))  # a jump from ~52: a spike
    assert not f.data["steady"] and "above 10" in f.summary and triggers_capture(f), f.summary


def test_a_jump_under_the_relative_factor_from_a_low_median_is_a_spike_not_high_all_along():
    """Norms of 2.0-2.5 (rolling median 2.25), then one bad batch at 10.93: 4.9x the median, under
    the factor of 5, above the absolute 10. It was called "high all along" (``steady``), and no
    capture was asked for, while 12.1 (5.4x) was a spike. High all along is a norm near its
    rolling median (at most twice it); this one is a jump."""
    from stepwatch.capture.triggers import triggers_capture
    from stepwatch.metrics.grads import GradNormSpikeDetector

    d = GradNormSpikeDetector(abs_threshold=10.0, factor=5.0, window=20)
    for i in range(30):
        assert d.observe_result(i, _res(2.0 + 0.05 * (i % 11))) is None
    f = d.observe_result(30, _res(10.93))
    assert not f.data["steady"] and "high all along" not in f.summary and triggers_capture(f), f.summary
    # hovering around the threshold, the median just under it: high all along, no capture
    d = GradNormSpikeDetector(abs_threshold=10.0, factor=5.0, window=20)
    for i in range(30):
        d.observe_result(i, _res(9.0 + 0.2 * (i % 7)))
    f = d.observe_result(30, _res(11.0))
    assert f.data["steady"] and "high all along" in f.summary and not triggers_capture(f), f.summary


def test_collector_hands_over_a_steps_probes_including_skipped():
    """The shape the session uses: pre-hook feeds the collector, take() at step end, resolve off-thread."""
    from stepwatch.metrics.grads import GradNormCollector

    col = GradNormCollector().install()
    handle = register_optimizer_step_pre_hook(lambda o, a, k: col.on_optimizer_step(o))
    try:
        m = model()
        head = torch.optim.SGD(m[2].parameters(), lr=0.1)
        body = torch.optim.SGD(m[0].parameters(), lr=0.1)
        x, y = data(0)
        nn.functional.mse_loss(m(x), y).backward()
        want = torch.nn.utils.get_total_norm([p.grad for p in m.parameters()]).item()
        body.step()
        head.step()  # two optimizers, one step: one norm over both
        step = col.take()
        assert len(step) == 2 and col.take() is None
        r = GradNormCollector.resolve_step(step)
        assert rel(r.norm, want) < 1e-5
        scaler = torch.amp.GradScaler("cpu")
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        opt.zero_grad()
        scaler.scale(nn.functional.mse_loss(m(x), y)).backward()
        m[0].bias.grad[0] = float("nan")
        scaler.step(opt)
        r = GradNormCollector.resolve_step(col.take())
        assert r.skipped and r.nonfinite
        assert GradNormCollector.resolve_step(None) is None
    finally:
        handle.remove()
        col.uninstall()


def test_uninstall_under_a_foreign_wrapper_leaves_a_pass_through():
    """stepwatch's step tracker also wraps GradScaler.step; uninstall order must not matter."""
    orig = torch.amp.GradScaler.step
    probe = GradNormProbe().install()
    mine = torch.amp.GradScaler.step

    def foreign(self, *a, **k):
        return mine(self, *a, **k)

    torch.amp.GradScaler.step = foreign
    probe.uninstall()
    assert torch.amp.GradScaler.step is foreign  # not clobbered
    torch.amp.GradScaler.step = orig  # the foreign tool's own uninstall
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    x, y = data(0)
    scaler.scale(nn.functional.mse_loss(m(x), y)).backward()
    mine(scaler, opt)  # the left-over wrapper just calls through
    scaler.update()


def test_probe_does_not_keep_optimizers_alive():
    import gc
    import weakref

    probe = GradNormProbe()
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    x, y = data(0)
    nn.functional.mse_loss(m(x), y).backward()
    assert probe.on_optimizer_step(opt) is not None
    ref = weakref.ref(opt)
    del opt
    gc.collect()
    assert ref() is None


def _rec(step, **kw):
    from stepwatch.record import StepRecord

    return StepRecord(step=step, rank=0, time=1000.0 + step, step_s=0.1, **kw)


def test_enricher_fills_grad_norm_and_waits_for_sharded_ranks():
    import torch.distributed as dist

    from stepwatch.metrics.grads import GradNormEnricher, PendingGradNorm

    # Plain: the probe's value, as is.
    col_vals = torch.tensor([0.0, 3.0])
    rec = _rec(1)
    assert GradNormEnricher().enrich(rec, {"grad_norm": [PendingGradNorm(col_vals)]}, force=False)
    assert rec.grad_norm == 3.0
    # Sharded, two ranks on one real HashStore: rank 1 holds until rank 0 has combined.
    store = dist.HashStore()
    e0 = GradNormEnricher(StoreNormExchange(store, 0, 2))
    e1 = GradNormEnricher(lambda: StoreNormExchange(store, 1, 2))  # made on first need
    r0, r1 = _rec(7), _rec(7)
    p0 = PendingGradNorm(torch.tensor([9.0, 12.0]), sharded=True)
    p1 = PendingGradNorm(torch.tensor([16.0, 12.0]), sharded=True)
    assert not e1.enrich(r1, {"grad_norm": [p1]}, force=False)
    assert e0.enrich(r0, {"grad_norm": [p0]}, force=False) and r0.grad_norm == pytest.approx(13.0)
    assert e1.enrich(r1, {"grad_norm": [p1]}, force=False) and r1.grad_norm == pytest.approx(13.0)
    # Without an exchange a sharded value is unknown, never this rank's partial norm.
    r = _rec(8)
    assert GradNormEnricher().enrich(r, {"grad_norm": [p0]}, force=False) and r.grad_norm is None
    # A rank that never answers: `force` gives up with None.
    r = _rec(9)
    assert not e1.enrich(r, {"grad_norm": [p1]}, force=False)
    assert e1.enrich(r, {"grad_norm": [p1]}, force=True) and r.grad_norm is None


def test_spike_detector_record_interface():
    from stepwatch.metrics.grads import GradNormSpikeDetector

    d = GradNormSpikeDetector()
    assert d.observe(_rec(1, grad_norm=1.0)) == [] and d.observe(_rec(2)) == []
    (f,) = d.observe(_rec(3, grad_norm=float("nan"), skipped=True))
    assert f.kind == "nonfinite_grads" and f.step == 3 and f.time == 1003.0
    (f,) = d.observe(_rec(4, grad_norm=25.0))
    assert f.kind == "grad_norm_spike"


def test_sparse_grads_norm_on_cpu_and_unknown_for_uncoalesced_cuda(hooked, caplog):
    """nn.Embedding(sparse=True): on CPU the norm is the coalesced grad's (duplicate ids summed).
    A CUDA sparse grad that is not coalesced would need a device sync to coalesce: unknown, with
    one warning (that case faked at the grad: no GPU here)."""
    h = hooked()
    emb = nn.Embedding(10, 4, sparse=True)
    opt = torch.optim.SGD(emb.parameters(), lr=0.1)
    emb(torch.tensor([1, 1, 3])).sum().backward()  # id 1 twice: an uncoalesced grad
    want = emb.weight.grad.coalesce()._values().norm().item()
    opt.step()
    (r,) = h.values()
    assert rel(r.norm, want) < 1e-6

    class UncoalescedCudaGrad:
        is_sparse = is_cuda = True

        def is_coalesced(self):
            return False

    class Param:
        grad = UncoalescedCudaGrad()

    with caplog.at_level("WARNING", logger="stepwatch.metrics.grads"):
        assert h.probe._compute([Param()]) == (None, False)
        assert h.probe._compute([Param()]) == (None, False)
    assert len([m for m in caplog.messages if "sparse" in m]) == 1


def _total(params) -> float:
    return torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None]).item()


def test_probe_follows_the_params_that_have_grads_from_step_to_step(hooked):
    """The probe keeps each optimizer's parameter list across steps; which of them have a grad
    is read every step (a layer frozen or unfrozen mid-run changes the norm at once)."""
    h = hooked()
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.0)
    first, last = m[0], m[2]
    want = []
    for step in range(4):
        x, y = data(step)
        opt.zero_grad()
        for p in first.parameters():
            p.requires_grad_(step % 2 == 0)  # frozen on odd steps: no grad there
        nn.functional.mse_loss(m(x), y).backward()
        want.append(_total(m.parameters()))
        opt.step()
    got = [r.norm for r in h.values()]
    assert all(rel(g, w) < 1e-6 for g, w in zip(got, want)), (got, want)
    assert rel(want[0], want[1]) > 1e-3  # the frozen steps really had fewer grads


def test_probe_notices_a_changed_parameter_list(hooked):
    """A new param group, or a group's list swapped for another of the same length, is seen."""
    h = hooked()
    a, b = model(), model()
    for p in b.parameters():
        p.data.mul_(3.0)
    opt = torch.optim.SGD(a.parameters(), lr=0.0)
    want = []

    def step(params) -> None:
        x, y = data(len(want))
        opt.zero_grad()
        for net in (a, b):
            net.zero_grad()
            nn.functional.mse_loss(net(x), y).backward()
        want.append(_total(params))
        opt.step()

    step(list(a.parameters()))
    opt.param_groups[0]["params"] = list(b.parameters())  # same length, other tensors
    step(list(b.parameters()))
    opt.add_param_group({"params": list(a.parameters())})
    step(list(b.parameters()) + list(a.parameters()))
    got = [r.norm for r in h.values()]
    assert all(rel(g, w) < 1e-6 for g, w in zip(got, want)), (got, want)


_FSDP1_JOB = r"""
import json, os, sys
import torch, torch.nn as nn, torch.distributed as dist
import stepwatch

run = sys.argv[1]
stepwatch.init(dir=run, console="off")
imported_by_stepwatch = "torch.distributed.fsdp" in sys.modules
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1  # after stepwatch, as a job would

torch.manual_seed(0)
model = FSDP1(nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2)), device_id=torch.device("cpu"))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
clipped = []
for step in range(4):
    model(torch.randn(4, 8)).pow(2).mean().backward()
    clipped.append(float(model.clip_grad_norm_(max_norm=100.0)))
    opt.step()
    opt.zero_grad()
stepwatch.shutdown()
dist.destroy_process_group()
with open(os.path.join(run, "steps.rank0.jsonl")) as f:
    norms = [json.loads(line)["grad_norm"] for line in f]
print(json.dumps({"imported_by_stepwatch": imported_by_stepwatch, "clipped": clipped, "norms": norms}))
"""


def test_fsdp_is_not_imported_by_stepwatch_and_fsdp1s_clip_is_still_reused(tmp_path):
    """Importing torch.distributed.fsdp costs about 1 s of every process's start-up: stepwatch
    never imports it. A job that imports it after stepwatch.init still gets FSDP1's clip norm
    reused from the first step (the tap wraps the clip at the model's first forward), without
    the warning meant for jobs that never call model.clip_grad_norm_(). And the job trains: the
    FLOP count used to replay FSDP1 on fakes, which initialized it on the meta device, and the
    next forward raised "An FSDP-managed module unexpectedly has parameters on meta"."""
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEPWATCH_")}
    env.update({"PYTHONPATH": os.path.join(root, "src"), "OMP_NUM_THREADS": "1", "STEPWATCH_GPU_TELEMETRY": "0"})
    r = subprocess.run([sys.executable, "-c", _FSDP1_JOB, str(tmp_path / "run")], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["imported_by_stepwatch"] is False
    assert out["norms"] == pytest.approx(out["clipped"], rel=1e-6)
    assert "grad_norm is null under FSDP1" not in r.stderr
    assert r.stderr.count("FLOPs are not counted") == 1  # said once; MFU stays null


def test_spike_detector_keeps_the_rolling_median_without_sorting_per_record():
    """The detector keeps its window sorted (one insertion per record, not a median of 100 per
    record: ~10 us a record before). Its findings are those of a plain statistics.median
    over the same window, on a long random run of norms with spikes, NaN, inf and skipped steps."""
    import random
    import statistics
    from collections import deque
    from types import SimpleNamespace

    from stepwatch.metrics.grads import GradNormSpikeDetector

    def reference(norms, window, abs_threshold, factor):
        recent, out = deque(maxlen=window), []
        for step, norm in enumerate(norms):
            if norm is None:
                continue
            if not math.isfinite(norm):
                out.append((step, "nonfinite_grads"))
                continue
            median = statistics.median(recent) if len(recent) >= min(window, 10) else None
            recent.append(norm)
            if norm > abs_threshold or (median is not None and median > 0 and norm > factor * median):
                out.append((step, "grad_norm_spike", median))
        return out

    rng = random.Random(7)
    norms = []
    for _ in range(3000):
        r = rng.random()
        norms.append(None if r < 0.05 else float("nan") if r < 0.06 else float("inf") if r < 0.065
                     else rng.uniform(5, 40) if r < 0.1 else rng.choice([1.0, 2.0]) if r < 0.2 else rng.lognormvariate(0, 0.3))
    for window in (2, 7, 100):
        det = GradNormSpikeDetector(abs_threshold=12.0, factor=3.0, window=window)
        got = []
        for step, norm in enumerate(norms):
            rec = SimpleNamespace(grad_norm=norm, step=step, rank=0, time=0.0, skipped=False)
            for f in det.observe(rec):
                got.append((step, f.kind, f.data["median"]) if f.kind == "grad_norm_spike" else (step, f.kind))
        want = reference(norms, window, 12.0, 3.0)
        assert got == want and len(want) > 20
        assert len(det._sorted) == len(det._recent) == window and det._sorted == sorted(det._recent)


def _pre_clip(params) -> float:
    """The norm of the grads now, in float64: what the probe must report once they are clipped."""
    gs = [p.grad if p.grad.is_complex() else p.grad.double() for p in params if p.grad is not None]
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in gs])).item()


def test_clip_imported_before_install_still_gives_the_pre_clip_norm(hooked):
    """`from torch.nn.utils import clip_grad_norm_` at the top of a script keeps torch's own
    function; it still calls clip_grad.py's helpers through that module, where the tap sees the
    pre-clip norm: the norm it returned is reused, not the clipped grads' (max_norm every step)."""
    h = hooked()
    assert clip_imported_early is torch.nn.utils.clip_grad_norm_.__wrapped__  # really the unwrapped one
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    returned = []
    for step in range(4):
        x, y = data(step)
        opt.zero_grad()
        nn.functional.mse_loss(m(x), 10 * y).backward()
        returned.append(clip_imported_early(m.parameters(), max_norm=0.5).item())
        opt.step()
    got = h.values()
    assert all(r > 1.0 for r in returned)  # every step really clipped
    assert all(r.from_clip for r in got) and [r.norm for r in got] == returned


def test_a_clip_is_recorded_once_though_both_wrappers_see_it(hooked):
    """The wrapped clip_grad_norm_ calls the wrapped clip_grads_with_norm_: one clip, not two (a
    second would divide the norm by the clip's factor twice)."""
    from stepwatch.metrics.grads import _TAP

    hooked()
    m = model()
    x, y = data(0)
    nn.functional.mse_loss(m(x), y).backward()
    try:
        for clip in (torch.nn.utils.clip_grad_norm_, clip_imported_early):
            _TAP.local.clips = None
            total = clip(m.parameters(), 0.5, norm_type=2)
            (c,) = _TAP.local.clips
            assert c.total is total and c.norm_type == 2.0
    finally:
        _TAP.local.clips = None


def test_the_two_step_clip_api_gives_the_pre_clip_norm(hooked):
    """torch's documented split of clip_grad_norm_: get_total_norm, then clip_grads_with_norm_.
    Its total is reused; a total computed some other way (unknown norm type) is not, but the
    clipped grads are scaled back by the factor the clip applied."""
    h = hooked()
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    want = []
    for step in range(4):
        x, y = data(step)
        opt.zero_grad()
        nn.functional.mse_loss(m(x), 10 * y).backward()
        want.append(_pre_clip(m.parameters()))
        grads = [p.grad for p in m.parameters()]
        if step < 2:
            total = torch.nn.utils.get_total_norm(grads)
        else:  # the norm of the grads as one vector, by hand
            total = torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads]))
        torch.nn.utils.clip_grads_with_norm_(m.parameters(), 0.5, total)
        opt.step()
    got = h.values()
    assert [r.from_clip for r in got] == [True, True, False, False]
    assert all(rel(r.norm, w) < 1e-5 for r, w in zip(got, want)), ([r.norm for r in got], want)


@pytest.mark.parametrize("early", [False, True])
def test_a_clip_of_some_of_the_optimizers_parameters_gives_the_whole_pre_clip_norm(hooked, early):
    """Clipping one layer (the optimizer holds all): the clipped grads are scaled back, the others
    read as they are; never the clipped layer's norm presented as the whole norm."""
    h = hooked()
    clip = clip_imported_early if early else torch.nn.utils.clip_grad_norm_
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    want, clipped = [], []
    for step in range(3):
        x, y = data(step)
        opt.zero_grad()
        nn.functional.mse_loss(m(x), 10 * y).backward()
        want.append(_pre_clip(m.parameters()))
        clipped.append(clip(m[2].parameters(), max_norm=0.1).item())
        opt.step()
    got = h.values()
    assert all(c > 1.0 for c in clipped)
    assert all(not r.from_clip and rel(r.norm, w) < 1e-5 for r, w in zip(got, want)), ([r.norm for r in got], want)


def test_a_clip_of_the_same_parameters_in_another_order_is_reused(hooked):
    """AdamW's usual two groups (decay, no decay) and a clip of model.parameters(): the same
    parameters, another order."""
    h = hooked()
    m = model()
    no_decay = [p for p in m.parameters() if p.dim() < 2]
    decay = [p for p in m.parameters() if p.dim() >= 2]
    opt = torch.optim.AdamW([{"params": no_decay, "weight_decay": 0.0}, {"params": decay}])
    x, y = data(0)
    nn.functional.mse_loss(m(x), 10 * y).backward()
    returned = torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5).item()
    opt.step()
    (r,) = h.values()
    assert r.from_clip and r.norm == returned


def test_one_clip_over_two_optimizers_and_two_clips_before_one_step():
    """A clip of every parameter, two optimizers (Muon for the matrices, AdamW for the rest is the
    usual shape): each optimizer's part is scaled back, and the step's norm is the pre-clip one.
    Then one optimizer after two clips, of two parts and of one part twice."""
    from stepwatch.metrics.grads import GradNormCollector

    col = GradNormCollector().install()
    handle = register_optimizer_step_pre_hook(lambda o, a, k: col.on_optimizer_step(o))
    try:
        m = model()
        mats = torch.optim.SGD([p for p in m.parameters() if p.dim() >= 2], lr=0.1)
        rest = torch.optim.SGD([p for p in m.parameters() if p.dim() < 2], lr=0.1)
        whole = torch.optim.SGD(m.parameters(), lr=0.1)

        def step(i, clips, opts):
            x, y = data(i)
            m.zero_grad()
            nn.functional.mse_loss(m(x), 10 * y).backward()
            want = _pre_clip(m.parameters())
            for params, max_norm in clips:
                torch.nn.utils.clip_grad_norm_(params, max_norm)
            for o in opts:
                o.step()
            r = GradNormCollector.resolve_step(col.take())
            assert not r.from_clip and rel(r.norm, want) < 1e-5, (i, r.norm, want)

        step(0, [(m.parameters(), 0.5)], (mats, rest))
        step(1, [(m.parameters(), 0.5)], (rest, mats))
        step(2, [(m[0].parameters(), 0.2), (m[2].parameters(), 0.3)], (whole,))
        step(3, [(m[0].parameters(), 0.2), (m.parameters(), 0.3)], (whole,))  # m[0] clipped twice
    finally:
        handle.remove()
        col.uninstall()


def test_a_clip_left_over_from_an_earlier_step_is_not_applied(hooked):
    """A clip of parameters of which one has a grad but no optimizer: what the optimizer did not
    take waits for another optimizer; the next backward makes it stale, never applied."""
    h = hooked()
    m = model()
    opt = torch.optim.SGD(m[0].parameters(), lr=0.1)  # m[2] trains in no optimizer
    want = []
    for step in range(3):
        x, y = data(step)
        m.zero_grad()
        nn.functional.mse_loss(m(x), 10 * y).backward()
        want.append(_pre_clip(m[0].parameters()))
        if step == 0:
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.1)
        opt.step()
    got = h.values()
    assert all(rel(r.norm, w) < 1e-5 for r, w in zip(got, want)), ([r.norm for r in got], want)


def test_float64_and_complex_grads_are_not_narrowed(hooked):
    """A float64 model (scientific ML) once disabled the probe: the norm asked _foreach_norm for
    float32, which torch refuses for a float64 (or complex) input. Each grad's norm is now taken
    in its own precision; float32 and lower keep their float32 norms."""
    h = hooked()
    torch.manual_seed(0)
    cases = {
        "float64": nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)).double(),
        "mixed": nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1).double()),
        "complex": nn.Linear(8, 1, dtype=torch.complex128),
    }
    for name, m in cases.items():
        opt = torch.optim.Adam(m.parameters(), lr=1e-3)
        h.pending.clear()
        want = []
        for step in range(3):
            x = torch.randn(32, 8, dtype=torch.float64)
            opt.zero_grad()
            if name == "complex":
                m(x.to(torch.complex128)).abs().pow(2).mean().backward()
            elif name == "mixed":
                m[2](m[1](m[0](x.float())).double()).pow(2).mean().backward()
            else:
                m(x).pow(2).mean().backward()
            want.append(_pre_clip(m.parameters()))
            opt.step()
        got = h.values()
        assert all(r is not None and not r.nonfinite for r in got), name
        tol = 1e-12 if name != "mixed" else 1e-6
        assert all(rel(r.norm, w) < tol for r, w in zip(got, want)), (name, [r.norm for r in got], want)


def test_a_clip_of_another_model_or_an_earlier_session_leaves_the_norm_reused_exactly(sw):
    """A clip no optimizer took (another model's, clipped and never stepped; or one an earlier
    session on this thread left, its grads still alive) made the step's clip one of two: the
    norm was computed again instead of reused, one float rounding off clip_grad_norm_'s value (a
    fresh CI run's framework tests failed so, depending on the tests run before them)."""
    stepwatch, mem, start = sw
    torch.manual_seed(0)
    a, b, stale = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
    probe = GradNormProbe().install()  # an earlier session's probe: a clip it saw, never taken
    stale(torch.randn(2, 4)).sum().backward()
    torch.nn.utils.clip_grad_norm_(stale.parameters(), 0.1)
    probe.uninstall()
    start()
    opt = torch.optim.SGD(a.parameters(), lr=0.01)
    b(torch.randn(2, 4)).sum().backward()
    torch.nn.utils.clip_grad_norm_(b.parameters(), 0.1)  # b never steps; its grads stay
    norms = []
    for _ in range(3):
        (a(torch.randn(8, 4)) * 100).sum().backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(a.parameters(), 0.1)))
        opt.step()
        opt.zero_grad()
    stepwatch.shutdown()
    assert [r.grad_norm for r in mem.records if not r.tail] == norms


@pytest.mark.parametrize("shape", ["whole", "subset", "value_then_norm", "norm_then_value", "two_optimizers"])
def test_clip_grad_value_gives_the_pre_clamp_norm(shape):
    """``clip_grad_value_`` clamps each element: no factor to divide out afterwards, so the
    grad_norm was the clamped grads' norm (a grad_norm_spike could never show). Its wrapper takes
    each grad's norm before the clamp (the kernels the probe would run anyway; the probe reuses
    them): the norm is the pre-clip one for the optimizer's parameters, alone, as a subset, with a
    clip_grad_norm_ before or after it, and over two optimizers."""
    from stepwatch.metrics.grads import GradNormCollector

    col = GradNormCollector().install()
    handle = register_optimizer_step_pre_hook(lambda o, a, k: col.on_optimizer_step(o))
    try:
        m = model()
        if shape == "two_optimizers":
            opts = [torch.optim.SGD([p for p in m.parameters() if p.dim() >= 2], lr=0.1),
                    torch.optim.SGD([p for p in m.parameters() if p.dim() < 2], lr=0.1)]
        else:
            opts = [torch.optim.SGD(m.parameters(), lr=0.1)]
        for step in range(3):
            x, y = data(step)
            m.zero_grad()
            nn.functional.mse_loss(m(x), 10 * y).backward()
            want = _pre_clip(m.parameters())
            after = None
            if shape == "subset":
                torch.nn.utils.clip_grad_value_(m[2].parameters(), 0.01)
            elif shape == "value_then_norm":
                torch.nn.utils.clip_grad_value_(m.parameters(), 0.05)
                torch.nn.utils.clip_grad_norm_(m[0].parameters(), 0.1)
            elif shape == "norm_then_value":
                torch.nn.utils.clip_grad_norm_(m[0].parameters(), 0.1)
                torch.nn.utils.clip_grad_value_(m.parameters(), 0.01)
            else:
                torch.nn.utils.clip_grad_value_(m.parameters(), 0.01)
            after = _pre_clip(m.parameters())
            assert after < want * 0.9  # the clamp did happen
            for o in opts:
                o.step()
            r = GradNormCollector.resolve_step(col.take())
            assert r is not None and rel(r.norm, want) < 1e-5, (shape, step, r and r.norm, want, after)
    finally:
        handle.remove()
        col.uninstall()


class _Lookahead(torch.optim.Optimizer):
    """timm's Lookahead in small: an optimizer whose step runs its base optimizer's step, on the
    same ``param_groups`` list (SAM and Ranger are written the same way)."""

    def __init__(self, base, k=2):
        self._base = base
        self.param_groups = base.param_groups
        self.defaults = dict(base.defaults)
        self.state = {}
        self._optimizer_step_pre_hooks = {}
        self._optimizer_step_post_hooks = {}
        self.k, self.n = k, 0

    @torch.no_grad()
    def step(self, closure=None):
        loss = self._base.step(closure)
        self.n += 1
        if self.n % self.k == 0:
            for g in self.param_groups:
                for p in g["params"]:
                    p.mul_(0.99)
        return loss


@pytest.mark.parametrize("wrapper", ["lookahead", "zero"])
def test_an_optimizer_that_steps_its_base_optimizer_gets_one_norm(sw, wrapper):
    """Both steps pass torch's global pre-hook, on the same grads: the norm was the root of both
    probes' squares summed, sqrt(2) times the real one (ZeroRedundancyOptimizer: its shard's
    added, a different number on each rank; one rank here, its shard all parameters). The inner
    step runs inside the outer, on grads unchanged since: probed once, on every step (the C
    common step once took the outer's every other step, and the inner was probed again)."""
    import torch.distributed as dist

    stepwatch, mem, start = sw
    start()
    m = model()
    if wrapper == "zero":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        opt = ZeroRedundancyOptimizer(m.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3)
    else:
        opt = _Lookahead(torch.optim.AdamW(m.parameters(), lr=1e-3))
    try:
        _step_six_times(m, opt, stepwatch, mem)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _step_six_times(m, opt, stepwatch, mem):
    want = []
    for step in range(6):
        x, y = data(step)
        opt.zero_grad()
        nn.functional.mse_loss(m(x), y).backward()
        want.append(_pre_clip(m.parameters()))
        if step == 5:
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.01)  # the clip's path too
        opt.step()
    stepwatch.shutdown()
    got = [r.grad_norm for r in mem.records if not r.tail]
    assert len(got) == 6 and all(rel(g, w) < 1e-5 for g, w in zip(got, want)), (got, want)


class _Refuse(Exception):
    pass


class _GuardedSGD(torch.optim.SGD):
    """An optimizer that refuses a step by raising (a NaN/OOM guard the loop catches)."""

    refuse = False

    def step(self, closure=None):
        if self.refuse:
            raise _Refuse("non-finite update refused")
        return super().step(closure)


@pytest.mark.parametrize("shape", ["stepped twice", "a step that raised"])
def test_one_optimizer_probed_twice_in_a_record_reports_its_last_norm(sw, shape):
    """The same optimizer probed twice before a record ends: stepped twice on the same
    gradients (the two squares summed gave sqrt(2) times the norm), or a step that raised and was
    skipped by the loop, merged into the next record (both iterations' squares summed; that
    iteration is now a record of its own, ``skipped``, with the norm its step was refused on,
    of that optimizer's parameters alone: the other never stepped). Also in
    every record here: the subclass's step calls SGD.step, which torch wraps too once an SGD
    exists (opt2), so the pre-hook ran twice a step. A record's norm is each optimizer's last
    probe; two optimizers' (disjoint parameters) still add up."""
    stepwatch, mem, start = sw
    start()
    torch.manual_seed(0)
    m, other = nn.Linear(16, 4), nn.Linear(4, 1)
    opt, opt2 = _GuardedSGD(m.parameters(), lr=0.01), torch.optim.SGD(other.parameters(), lr=0.01)
    truth = []
    for i in range(4):
        opt.refuse = shape == "a step that raised" and i == 1
        other(m(torch.randn(8, 16))).pow(2).mean().backward()
        n = float(torch.nn.utils.get_total_norm([p.grad for p in (*m.parameters(), *other.parameters())]))
        try:
            opt.step()
            if shape == "stepped twice":
                opt.step()
        except _Refuse:
            truth.append(float(torch.nn.utils.get_total_norm([p.grad for p in m.parameters()])))
            opt.zero_grad()
            other.zero_grad()
            continue
        opt2.step()
        opt.zero_grad()
        opt2.zero_grad()
        truth.append(n)
    stepwatch.shutdown()
    got = [r.grad_norm for r in mem.records if not r.tail]
    assert got == pytest.approx(truth, rel=1e-5)
    assert [r.skipped for r in mem.records if not r.tail] == [False, shape == "a step that raised", False, False]


@pytest.mark.parametrize("bad", [["nan", "inf"], ["inf"], ["nan"], ["inf", "inf"]])
def test_a_nonfinite_grad_reads_as_torchs_own_norm_would(hooked, bad):
    """The common probe queues each grad's norm and the norm is their root sum of squares, taken
    where it is read: NaN and inf come out as torch's reduction of the stacked norms gives them
    (NaN wins over inf there, as it does not in ``math.hypot``), and are marked non-finite."""
    h = hooked()
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    x, y = data(0)
    nn.functional.mse_loss(m(x), y).backward()
    for p, v in zip(m.parameters(), bad):
        p.grad.view(-1)[0] = float(v)
    grads = [p.grad for p in m.parameters()]
    want = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0)), 2.0).item()
    opt.step()
    (r,) = h.values()
    assert r.nonfinite
    assert (math.isnan(r.norm) and math.isnan(want)) or r.norm == want == math.inf, (r.norm, want)


def test_the_common_probe_matches_get_total_norm_in_float64_and_bfloat16(hooked):
    """Each grad's norm in the probe's dtype (fp64 for fp64 grads, else fp32), the root sum of
    squares on read: within fp32 (fp64) rounding of torch's own total norm."""
    for dtype, tol in ((torch.float64, 1e-12), (torch.bfloat16, 1e-5)):
        h = hooked()
        m = model().to(dtype)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        x, y = data(0)
        nn.functional.mse_loss(m(x.to(dtype)), y.to(dtype)).backward()
        want = torch.nn.utils.get_total_norm([p.grad.float() if dtype == torch.bfloat16 else p.grad
                                              for p in m.parameters()]).item()
        opt.step()
        (p,) = h.pending
        # CPU grads: each one's norm, read as a Python float on the training thread (no tensor
        # outlives the step); the tolerance shows the dtype it was taken in
        assert p.per_tensor and type(p.values) is list and len(p.values) == len(list(m.parameters()))
        assert all(type(v) is float for v in p.values)
        assert rel(h.values()[0].norm, want) < tol, dtype


def test_a_spike_that_lasts_50_steps_is_counted_as_50_in_the_findings_file(sw):
    """The loss scaled by 1e4 for steps 100-149: 50 steps with a grad norm above 10. The detector
    gave one finding for the whole spike (it held the others back itself), so the rate limit had
    nothing to count: the findings file said one step. Every step over the threshold is a finding
    now; the rate limit writes the episode's opening and its closing "N in all"."""
    import json
    import os

    stepwatch, _, start = sw
    s = start(console="off", grad_norm_every=1)
    torch.manual_seed(0)
    m = nn.Linear(8, 1)
    opt = torch.optim.SGD(m.parameters(), lr=1e-6)
    for step in range(200):
        loss = m(torch.randn(16, 8)).pow(2).mean() * (1e4 if 100 <= step < 150 else 1.0)
        opt.zero_grad()
        loss.backward()
        opt.step()
    stepwatch.shutdown()
    with open(os.path.join(s.ctx.run_dir, "steps.rank0.jsonl")) as f:
        over = [r["step"] for r in map(json.loads, f) if (r.get("grad_norm") or 0) > 10]
    assert over == list(range(100, 150))
    with open(os.path.join(s.ctx.run_dir, "findings.rank0.jsonl")) as f:
        spikes = [x for x in map(json.loads, f) if x["kind"] == "grad_norm_spike"]
    assert spikes[0]["step"] == 100 and spikes[-1]["data"]["episode"]["final"], spikes
    assert spikes[-1]["data"]["episode"]["count"] == 50 and "[episode over: 50 in all over steps 100-149]" in \
        spikes[-1]["summary"], spikes[-1]["summary"]


@pytest.mark.parametrize("clip", [None, "clip_grad_norm_", "clip_grad_value_"])
def test_a_spikes_action_is_for_a_job_that_clips_when_it_clips(sw, clip):
    """A job that clips already was told to "clip gradients (clip_grad_norm_)" at each spike of
    its (pre-clip) norm. Where the job clips, the action says so, with its threshold, and what is
    left to look at; a job that does not clip keeps the table's action."""
    from stepwatch.analysis.kinds import KINDS

    stepwatch, mem, start = sw
    start(grad_norm_spike_abs=1e9)  # the rolling median's spike only
    torch.manual_seed(0)
    m = nn.Linear(16, 4)
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    x = torch.randn(8, 16)
    for i in range(30):
        (m(x).pow(2).mean() * (1000.0 if i == 25 else 1.0)).backward()
        if clip == "clip_grad_norm_":
            torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm=1.5)
        elif clip == "clip_grad_value_":
            torch.nn.utils.clip_grad_value_(m.parameters(), clip_value=0.25)
        opt.step()
        opt.zero_grad()
    stepwatch.shutdown()
    (f,) = [f for f in mem.findings if f.kind == "grad_norm_spike"]
    assert f.step == 25, f
    table = KINDS["grad_norm_spike"].action
    if clip is None:
        assert f.action == table and "clip_max" not in f.data, f
    elif clip == "clip_grad_norm_":
        assert f.action != table and "clip_grad_norm_" in f.action and "1.5" in f.action, f.action
        assert "clip gradients" not in f.action and f.data["clip_max"] == 1.5, f
    else:
        assert f.action != table and "clip_grad_value_" in f.action and "0.25" in f.action, f.action
        assert "clip gradients" not in f.action and f.data["clip_max"] == 0.25, f

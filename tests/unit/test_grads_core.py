"""The grad-norm collector's optimizer step in C (metrics/_cmetrics.c's GradNormCore) against its
Python (grads.py's _PyGradNormCore, which runs GradNormProbe's path): two identical models and
optimizers, one collector each, stepped side by side through the scripts' shapes that take the
common path and those that leave it. Every pending probe and every probe state must agree."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from torch.nn.utils import clip_grad_norm_ as clip_imported_early  # as scripts do, before any install

from stepwatch.metrics import grads as G

C_BUILT = G._GradNormCore is not G._PyGradNormCore
pytestmark = pytest.mark.skipif(not C_BUILT, reason="metrics/_cmetrics.c not built here")


@pytest.fixture
def fresh_tap(monkeypatch):
    """The tap's `used` is process-wide and set for good by any clip or GradScaler step (other tests
    in this process): each test here starts from a process that has done neither."""
    monkeypatch.setattr(G._TAP, "used", False)
    monkeypatch.setattr(G._TAP.local, "clips", None, raising=False)
    monkeypatch.setattr(G._TAP.local, "total", None, raising=False)


class Full:
    """Counts the steps the C core hands to the Python (re-binds _bind_grads around it)."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self, collector, optimizer):
        self.n += 1
        return G._PyGradNormCore.on_optimizer_step(collector, optimizer)


@pytest.fixture
def full():
    f = Full()
    assert G._bind_grads(f, G._TAP, G.GradNormProbe, G._OptState, G.PendingGradNorm) is True
    yield f
    G._bind_grads(G._PyGradNormCore.on_optimizer_step, G._TAP, G.GradNormProbe, G._OptState, G.PendingGradNorm)


def _model(seed: int = 0, *, sparse: bool = False, dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(seed)
    if sparse:
        return nn.ModuleDict({"emb": nn.Embedding(10, 4, sparse=True), "lin": nn.Linear(4, 3)})
    return nn.Sequential(nn.Linear(6, 5), nn.GELU(), nn.Linear(5, 3)).to(dtype)


def _loss(m: nn.Module, i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + i)
    if isinstance(m, nn.ModuleDict):
        idx = torch.randint(0, 10, (7,), generator=g)
        return m["lin"](m["emb"](idx)).pow(2).mean()
    return m(torch.randn(8, 6, generator=g).to(m[0].weight.dtype)).pow(2).mean()


def _same(a: G.PendingGradNorm, b: G.PendingGradNorm, opt_a, opt_b) -> None:
    assert type(a) is type(b) is G.PendingGradNorm
    # CPU grads: each grad's norm as Python floats, read on the training thread
    assert type(a.values) is type(b.values)
    assert a.values == b.values, (a.values, b.values)
    assert (a.host, a.event, a.device) == (b.host, b.event, b.device) == (None, None, -1)
    assert (a.sharded, a.from_clip, a.skipped, a.per_tensor) == (b.sharded, b.from_clip, b.skipped, b.per_tensor)
    assert a.optimizer_id == id(opt_a) and b.optimizer_id == id(opt_b)


def _states(col, opt) -> tuple:
    st = col.probe._state[opt]
    return st.calls, st.plain, st.fsdp1, st.norm_dtype, len(st.params)


def _lockstep(make_opt, steps: int, *, every: int = 1, sparse: bool = False, dtype: torch.dtype = torch.float32,
              between=None, clip=None, after=None):
    """Both collectors over identical models; returns the C collector's pendings per step."""
    ma = _model(sparse=sparse, dtype=dtype)
    mb = copy.deepcopy(ma)
    oa, ob = make_opt(ma), make_opt(mb)
    ca, cb = G.GradNormCollector(every).install(), G.PyGradNormCollector(every).install()
    assert type(ca).on_optimizer_step is G._GradNormCore.on_optimizer_step
    per_step = []
    try:
        for i in range(steps):
            for m, o, c in ((ma, oa, ca), (mb, ob, cb)):
                o.zero_grad()
                _loss(m, i).backward()
                if between is not None:
                    between(i, m, o)
                if clip is not None:
                    clip(i, m)
                c.on_optimizer_step(o)
                if after is not None:
                    after(i, m, o)
                o.step()
            a, b = ca.take(), cb.take()
            assert (a is None) == (b is None), (i, a, b)
            if a is not None:
                assert len(a) == len(b)
                for x, y in zip(a, b):
                    _same(x, y, oa, ob)
            assert _states(ca, oa) == _states(cb, ob), i
            per_step.append(a)
    finally:
        ca.uninstall()
        cb.uninstall()
    return per_step, ma, oa


def _norm(pendings) -> float:
    return G.GradNormCollector.resolve_step(pendings).norm


def test_the_common_step_runs_in_c_and_equals_the_python(fresh_tap, full):
    steps, m, _ = _lockstep(lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), 6)
    assert all(s is not None and len(s) == 1 for s in steps)
    # the first step meets the optimizer (its state is made in the Python); every later one is C's
    assert full.n == 1
    want = torch.nn.utils.get_total_norm([p.grad for p in m.parameters()]).item()
    assert abs(_norm(steps[-1]) - want) <= 1e-6 * want


@pytest.mark.parametrize("scaled", [False, True], ids=["plain", "grad_scale"])
def test_a_cpu_probe_keeps_no_tensor_past_its_step(fresh_tap, full, scaled):
    """On CPU the probe kept each step's per-grad norms as small 0-d tensors until the background
    thread read them, up to a pass later: hundreds of steps' worth on a fast loop. Those small
    allocations, alive among each step's freed activation and grad buffers, kept glibc's heap from
    shrinking: 316 -> 462 MiB over 800 steps of a loop that keeps nothing (flat without the probe,
    flat with MALLOC_MMAP_THRESHOLD_ fixed), and a memory_growth finding blamed the user's code.
    The norms are Python floats before the step goes on, in both cores."""
    def between(i, m, o):
        if scaled:
            o.grad_scale = torch.tensor(4.0)

    def after(i, m, o):
        if scaled:
            del o.grad_scale

    steps, m, _ = _lockstep(lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), 4, between=between, after=after)
    for pendings in steps:
        for p in pendings:
            vals = p.values if isinstance(p.values, list) else [p.values]
            assert all(type(x) is float for x in vals), p.values
    want = torch.nn.utils.get_total_norm([p.grad for p in m.parameters()]).item() / (4.0 if scaled else 1.0)
    assert abs(_norm(steps[-1]) - want) <= 1e-5 * want


def test_every_n_counts_the_same(fresh_tap, full):
    steps, _, _ = _lockstep(lambda m: torch.optim.SGD(m.parameters(), lr=1e-2), 7, every=3)
    assert [s is not None for s in steps] == [True, False, False, True, False, False, True]


def test_frozen_parameters_and_a_step_with_no_grad_at_all(fresh_tap, full):
    def between(i, m, o):
        m[0].weight.grad = None  # a frozen layer
        if i == 2:
            o.zero_grad()  # a step with no grads
    steps, _, _ = _lockstep(lambda m: torch.optim.SGD(m.parameters(), lr=1e-2), 4, between=between)
    assert steps[2] is None and all(steps[i] is not None for i in (0, 1, 3))


def test_two_parameter_groups_run_in_c(fresh_tap, full):
    """AdamW's common recipe, decay and no-decay groups (nanoGPT's configure_optimizers, HF's
    Trainer): the Python ran every step, a call per parameter tensor on top of the floor."""
    def make(m):
        decay = [p for p in m.parameters() if p.dim() >= 2]
        no_decay = [p for p in m.parameters() if p.dim() < 2]
        return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                 lr=1e-2)
    steps, m, _ = _lockstep(make, 5)
    assert all(s is not None for s in steps)
    assert full.n == 1  # the first step meets the optimizer; every later one is C's
    want = torch.nn.utils.get_total_norm([p.grad for p in m.parameters()]).item()
    assert abs(_norm(steps[-1]) - want) <= 1e-6 * want


def test_a_replaced_list_in_the_second_of_three_groups_is_noticed(fresh_tap, full):
    def make(m):
        return torch.optim.SGD([{"params": [m[0].weight]}, {"params": [m[0].bias, m[2].weight]},
                                {"params": [m[2].bias]}], lr=1e-2)

    def between(i, m, o):
        if i == 2:  # another list object of the same length in the middle group
            o.param_groups[1]["params"] = list(reversed(o.param_groups[1]["params"]))
    steps, _, _ = _lockstep(make, 5, between=between)
    assert all(s is not None for s in steps)
    assert full.n == 2  # the first step, and the step that met the new list


def test_a_parameter_group_added_mid_run_is_followed(fresh_tap, full):
    def between(i, m, o):
        if i == 2 and len(o.param_groups) == 1:
            extra = nn.Parameter(torch.ones(3))
            m.register_parameter("extra", extra)
            o.add_param_group({"params": [extra]})
            extra.grad = torch.full((3,), 2.0)
    def make(m):
        return torch.optim.SGD(list(m[0].parameters()) + list(m[2].parameters()), lr=1e-2)
    _lockstep(make, 5, between=between)


def test_a_new_list_of_the_same_length_is_noticed(fresh_tap, full):
    def between(i, m, o):
        if i == 2:  # the group's list replaced: another list object, the same length
            o.param_groups[0]["params"] = list(reversed(o.param_groups[0]["params"]))
    steps, _, _ = _lockstep(lambda m: torch.optim.SGD(m.parameters(), lr=1e-2), 4, between=between)
    assert all(s is not None for s in steps)


def test_clip_grad_norm_is_reused_through_the_python(fresh_tap, full):
    def clip(i, m):
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
    steps, _, _ = _lockstep(lambda m: torch.optim.SGD(m.parameters(), lr=1e-2), 3, clip=clip)
    assert all(s[0].from_clip for s in steps)
    assert full.n == 3  # once any thread clipped, every step takes the Python


def test_a_clip_imported_before_install_is_reused_through_the_python(fresh_tap, full):
    """clip_grad_norm_ imported before install is torch's own: the tap sees its pre-clip norm
    through clip_grad.py's helpers, once (not a second time through the wrapper)."""
    returned = []

    def clip(i, m):
        returned.append(clip_imported_early(m.parameters(), 0.05).item())
    steps, _, _ = _lockstep(lambda m: torch.optim.SGD(m.parameters(), lr=1e-2), 3, clip=clip)
    assert all(len(s) == 1 and s[0].from_clip for s in steps)
    assert [_norm(s) for s in steps] == returned[::2]  # the C collector's model is stepped first
    assert full.n == 3


@pytest.mark.parametrize("early", [False, True])
def test_a_clip_of_a_subset_is_scaled_back_in_both(fresh_tap, full, early):
    want = []

    def clip(i, m):
        want.append(_whole(m))  # before the clip; the C collector's model first
        (clip_imported_early if early else torch.nn.utils.clip_grad_norm_)(m[0].parameters(), 0.05)
    steps, _, _ = _lockstep(lambda m: torch.optim.SGD(m.parameters(), lr=1e-2), 3, clip=clip)
    assert all(not s[0].from_clip for s in steps)
    assert all(abs(_norm(s) - w) <= 1e-5 * w for s, w in zip(steps, want[::2])), ([_norm(s) for s in steps], want)


def test_a_float64_model_stays_on_the_common_path_in_c(fresh_tap, full):
    """float64 grads: their norm in float64 (float32 was refused by torch), in C as in Python (read
    as floats: float64's precision below shows it was not float32)."""
    steps, m, _ = _lockstep(lambda m: torch.optim.Adam(m.parameters(), lr=1e-2), 4, dtype=torch.float64)
    assert all(s is not None and all(type(v) is float for v in s[0].values) for s in steps)
    assert full.n == 1
    want = _whole(m)
    assert abs(_norm(steps[-1]) - want) <= 1e-12 * want


def _whole(m: nn.Module) -> float:
    return torch.linalg.vector_norm(torch.stack([p.grad.double().norm() for p in m.parameters()])).item()


def test_a_sparse_grad_leaves_the_plain_path_in_both(fresh_tap, full):
    steps, m, o = _lockstep(lambda m: torch.optim.SGD(m.parameters(), lr=1e-2), 3, sparse=True)
    assert all(s is not None for s in steps)
    dense = [p.grad.to_dense() if p.grad.is_sparse else p.grad for p in m.parameters()]
    want = torch.nn.utils.get_total_norm(dense).item()
    assert abs(_norm(steps[-1]) - want) <= 1e-5 * want


def test_a_fused_optimizers_grad_scale_is_divided_out_in_both(fresh_tap, full):
    def between(i, m, o):
        o.grad_scale = torch.tensor(4.0)  # what GradScaler.step sets for a fused optimizer

    def after(i, m, o):
        del o.grad_scale  # this SGD is not fused: its step must not see it

    steps, m, _ = _lockstep(lambda m: torch.optim.SGD(m.parameters(), lr=1e-2), 3, between=between, after=after)
    want = torch.nn.utils.get_total_norm([p.grad for p in m.parameters()]).item() / 4.0
    assert abs(_norm(steps[-1]) - want) <= 1e-5 * want


def test_grads_of_a_tensor_subclass_take_the_python(fresh_tap, full):
    class Marked(torch.Tensor):
        pass

    def between(i, m, o):
        for p in m.parameters():
            p.grad = p.grad.as_subclass(Marked)
    steps, _, _ = _lockstep(lambda m: torch.optim.SGD(m.parameters(), lr=1e-2), 3, between=between)
    assert all(s is not None for s in steps)


def test_two_optimizers_in_turn(fresh_tap, full):
    ma = _model()
    mb = copy.deepcopy(ma)
    ca, cb = G.GradNormCollector().install(), G.PyGradNormCollector().install()
    try:
        opts = [(torch.optim.SGD(m[0].parameters(), lr=0.1), torch.optim.SGD(m[2].parameters(), lr=0.1))
                for m in (ma, mb)]
        for i in range(4):
            for m, (o1, o2), c in ((ma, opts[0], ca), (mb, opts[1], cb)):
                o1.zero_grad()
                o2.zero_grad()
                _loss(m, i).backward()
                c.on_optimizer_step(o1)
                c.on_optimizer_step(o2)
            a, b = ca.take(), cb.take()
            assert len(a) == len(b) == 2
            for x, y, oa, ob in zip(a, b, opts[0], opts[1]):
                _same(x, y, oa, ob)
        assert full.n == 8  # the optimizer is not the last one stepped: the Python finds its state
    finally:
        ca.uninstall()
        cb.uninstall()


def test_a_probe_subclass_is_left_to_the_python(fresh_tap, full):
    class Mine(G.GradNormProbe):
        seen = 0

        def on_optimizer_step(self, optimizer):
            Mine.seen += 1
            return super().on_optimizer_step(optimizer)

    m = _model()
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    c = G.GradNormCollector()
    c.probe = Mine()
    c.install()
    try:
        for i in range(3):
            o.zero_grad()
            _loss(m, i).backward()
            c.on_optimizer_step(o)
        assert Mine.seen == 3 and len(c.take()) == 3
    finally:
        c.uninstall()


def test_take_is_the_cores_and_hands_over_an_untracked_list(fresh_tap, full):
    import gc

    assert G.GradNormCollector.take is G._GradNormCore.take and G.PyGradNormCollector.take is G._PyGradNormCore.take
    for cls in (G.GradNormCollector, G.PyGradNormCollector):
        m = _model()
        o = torch.optim.SGD(m.parameters(), lr=0.1)
        c = cls().install()
        try:
            assert c.take() is None
            _loss(m, 0).backward()
            c.on_optimizer_step(o)
            c.on_optimizer_step(o)
            got = c.take()
            assert type(got) is list and len(got) == 2 and not gc.is_tracked(got)
            assert not any(gc.is_tracked(p) for p in got)
            assert c.take() is None and c._buf == []
        finally:
            c.uninstall()

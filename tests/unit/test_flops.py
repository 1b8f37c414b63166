"""FLOPs counting against hand-computed ground truth (2*m*n*k per matmul; backward = grad-weight
+ grad-input where the input needs grad), on CPU with real modules and fake-tensor replay."""

from __future__ import annotations

import logging
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as ckpt
from torch.utils.flop_counter import FlopCounterMode

from stepwatch.metrics import flops as fl
from stepwatch.metrics.flops import FlopCache, FlopCount, count_step_flops, sum_counts, transformer_flops


def mm(m: int, k: int, n: int) -> int:
    return 2 * m * k * n


def close(got: float, want: float, rel: float = 0.02) -> bool:
    return abs(got - want) <= rel * want


# ----------------------------------------------------------------------------- models


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32))


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.c2 = nn.Conv2d(8, 16, 3, padding=1)
        self.fc = nn.Linear(16 * 16 * 16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(F.relu(self.c2(F.relu(self.c1(x)))).flatten(1))


class Block(nn.Module):
    def __init__(self, d: int, h: int, kv_heads: int | None = None) -> None:
        super().__init__()
        self.h, self.kv = h, kv_heads or h
        self.hd = d // h
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q = nn.Linear(d, d)
        self.kvp = nn.Linear(d, 2 * self.kv * self.hd)
        self.o = nn.Linear(d, d)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        y = self.ln1(x)
        q = self.q(y).view(b, t, self.h, self.hd).transpose(1, 2)
        k, v = self.kvp(y).view(b, t, 2, self.kv, self.hd).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv != self.h)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class TinyLM(nn.Module):
    def __init__(self, vocab=96, d=64, h=4, layers=2, kv_heads=None, checkpoint=False) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, h, kv_heads) for _ in range(layers))
        self.head = nn.Linear(d, vocab, bias=False)
        self.checkpoint = checkpoint

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for blk in self.blocks:
            x = ckpt.checkpoint(blk, x, use_reentrant=False) if self.checkpoint else blk(x)
        return self.head(x)


def lm_truth(b, t, vocab=96, d=64, h=4, layers=2, kv_heads=None):
    """(forward FLOPs of the blocks, forward FLOPs of the head, attention score-rebuild FLOPs)."""
    bt = b * t
    kv_dim = 2 * (kv_heads or h) * (d // h)
    per_block = mm(bt, d, d) + mm(bt, d, kv_dim) + mm(bt, d, d) + 2 * mm(bt, d, 4 * d)
    attn = 2 * mm(b * h * t, d // h, t)  # QK^T and PV over the full T x T score matrix
    rebuild = mm(b * h * t, d // h, t)
    return layers * (per_block + attn), mm(bt, d, vocab), layers * rebuild


# ----------------------------------------------------------------------------- ground truth


def test_mlp_matches_hand_count_and_skips_input_grad():
    b = 16
    c = count_step_flops(mlp(), (torch.randn(b, 64),))
    fwd = mm(b, 64, 128) + mm(b, 128, 32)
    # Layer 1: weight grad only (x needs no grad); layer 2: weight grad + input grad.
    bwd = mm(b, 64, 128) + 2 * mm(b, 128, 32)
    assert close(sum(c.forward.values()), fwd)
    assert close(sum(c.backward.values()), bwd)
    assert close(c.total, fwd + bwd)
    assert c.by_dtype.keys() == {"fp32"}
    assert c.recompute == {}


def test_mlp_input_requiring_grad_adds_grad_input():
    b = 16
    x = torch.randn(b, 64, requires_grad=True)
    c = count_step_flops(mlp(), (x,))
    assert close(sum(c.backward.values()), 2 * mm(b, 64, 128) + 2 * mm(b, 128, 32))


def test_frozen_layers_get_no_weight_grad():
    b = 16
    m = mlp()
    m[0].requires_grad_(False)  # e.g. a frozen base: no grad-weight, and nothing upstream needs grad
    c = count_step_flops(m, (torch.randn(b, 64),))
    assert sum(c.backward.values()) == mm(b, 128, 32)  # layer 2's grad-weight only
    m[0].requires_grad_(True)
    m[2].requires_grad_(False)  # frozen head: grad-input still flows back to layer 1
    c = count_step_flops(m, (torch.randn(b, 64),))
    assert sum(c.backward.values()) == mm(b, 128, 32) + mm(b, 64, 128)


def test_conv_net_matches_hand_count():
    b = 4
    c = count_step_flops(ConvNet(), (torch.randn(b, 3, 16, 16),))
    conv1 = 2 * b * 16 * 16 * 8 * 3 * 9
    conv2 = 2 * b * 16 * 16 * 16 * 8 * 9
    fc = mm(b, 16 * 16 * 16, 10)
    fwd = conv1 + conv2 + fc
    bwd = conv1 + 2 * conv2 + 2 * fc  # conv1: no grad-input (the image needs none)
    assert close(sum(c.forward.values()), fwd)
    assert close(c.total, fwd + bwd)


def test_transformer_with_sdpa_on_cpu():
    b, t = 2, 32
    c = count_step_flops(TinyLM(), (torch.randint(0, 96, (b, t)),))
    blocks, head, rebuild = lm_truth(b, t)
    fwd = blocks + head
    # Everything downstream of the embedding needs grad, so backward = 2x forward, attention too.
    assert close(sum(c.forward.values()), fwd)
    assert close(c.total, 3 * fwd)
    # The attention share alone (FlopCounterMode would count 0 of it on CPU) is there.
    attn = 2 * 2 * mm(b * 4 * t, 64 // 4, t)
    assert sum(c.forward.values()) - (fwd - attn) == attn
    assert close(c.hfu_total - c.total, rebuild)


def test_flop_counter_mode_alone_misses_cpu_sdpa():
    """The bug we fix: plain FlopCounterMode counts 0 for SDPA on CPU."""
    q = torch.randn(1, 2, 16, 8)
    with FlopCounterMode(display=False) as fc:
        F.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert fc.get_total_flops() == 0
    c = count_step_flops(nn.Identity(), (q,), backward=False)  # sanity: the identity does no math
    assert c.total == 0


def test_gqa_counts_query_heads():
    b, t, h, kv = 2, 16, 8, 2
    c = count_step_flops(TinyLM(h=h, kv_heads=kv, layers=1), (torch.randint(0, 96, (b, t)),))
    blocks, head, _ = lm_truth(b, t, h=h, kv_heads=kv, layers=1)
    assert close(sum(c.forward.values()), blocks + head)
    assert close(c.total, 3 * (blocks + head))


def test_checkpoint_does_not_change_mfu_flops():
    b, t = 2, 32
    ids = torch.randint(0, 96, (b, t))
    plain = count_step_flops(TinyLM(), (ids,))
    ck = count_step_flops(TinyLM(checkpoint=True), (ids,))
    blocks, head, rebuild = lm_truth(b, t)
    assert close(ck.total, 3 * (blocks + head))
    assert ck.total == plain.total
    # The recompute is visible for HFU: each block's forward once more, except its last matmul
    # (`down`): non-reentrant checkpoint stops recomputing once every saved tensor is back
    # (torch.utils.checkpoint early stop), and `down`'s output is not saved for backward.
    downs = 2 * mm(b * t, 4 * 64, 64)
    assert close(ck.hfu_total - ck.total, blocks - downs + rebuild)


class _ReentrantWrap(nn.Module):
    """``m`` run through a reentrant checkpoint."""

    def __init__(self, m) -> None:
        super().__init__()
        self.m = m

    def forward(self, x):
        return ckpt.checkpoint(self.m, x, use_reentrant=True)


def test_reentrant_checkpoint_too():
    m = mlp()
    x = torch.randn(8, 64, requires_grad=True)
    a, c = count_step_flops(m, (x,)), count_step_flops(_ReentrantWrap(m), (x,))
    assert c.total == a.total
    assert sum(c.recompute.values()) == sum(a.forward.values())


@pytest.mark.parametrize("real", [False, True], ids=["fake", "real"])
def test_a_reentrant_checkpoint_replay_leaves_the_real_grads_alone(real):
    """A reentrant checkpoint runs its block's forward again inside backward, with the
    parameters the block holds at that moment. The replay's backward must run while the
    replay's own parameters are in place: else the recompute reads the real ones, and the
    replay's gradients (fake tensors, or real ones of the replay's batch) land in the user's
    ``.grad``. Found training a model whose blocks call ``checkpoint(block, x,
    use_reentrant=True)``: the grad-norm read a fake tensor."""
    m = mlp()
    x = torch.randn(8, 64, requires_grad=True)
    fc = count_step_flops(_ReentrantWrap(m), (x,), real=real)
    assert fc.total == count_step_flops(m, (x,)).total
    assert all(p.grad is None for p in m.parameters())
    assert x.grad is None


def test_grad_accumulation_x4_is_additive():
    cache = FlopCache()
    model = TinyLM()
    micro = [torch.randint(0, 96, (2, 32)) for _ in range(4)]
    step = sum_counts([cache.get(model, (ids,)) for ids in micro])
    one = count_step_flops(model, (micro[0],))
    assert step.total == 4 * one.total == one.scaled(4).total
    assert cache.misses == 1  # one count, three lookups
    blocks, head, _ = lm_truth(2, 32)
    assert close(step.total, 4 * 3 * (blocks + head))
    # Variable micro-batch sizes add up too.
    mixed = sum_counts([cache.get(model, (torch.randint(0, 96, (bsz, 32)),)) for bsz in (1, 2, 3, 2)])
    assert close(mixed.total, 8 * 3 * (blocks + head) / 2)


def test_mlp_count_equals_real_flop_counter_over_four_microbatches():
    """Where FlopCounterMode is right (no attention), the fake replay equals a real run."""
    model = mlp()
    xs = [torch.randn(8, 64) for _ in range(4)]
    with FlopCounterMode(display=False) as real:
        for x in xs:
            model(x).sum().backward()
    cache = FlopCache()
    ours = sum_counts([cache.get(model, (x,)) for x in xs])
    assert ours.total == real.get_total_flops()


# ----------------------------------------------------------------------------- no side effects


class Stateful(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.bn = nn.BatchNorm1d(16)
        self.drop = nn.Dropout(0.5)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        self.cache = x * 2
        return self.drop(self.bn(self.lin(x)))


def test_replay_touches_no_rng_parameter_buffer_or_grad():
    torch.manual_seed(0)
    m = Stateful().train()
    m(torch.randn(4, 16)).sum().backward()  # real grads and running stats exist
    before = {k: v.clone() for k, v in m.state_dict().items()}
    grads = {n: p.grad.clone() for n, p in m.named_parameters()}
    x = torch.randn(4, 16)
    rng = torch.get_rng_state()
    calls, cache = m.calls, m.cache
    c = count_step_flops(m, (x,))
    assert c.total > 0
    assert torch.equal(torch.get_rng_state(), rng)
    for k, v in m.state_dict().items():
        assert torch.equal(v, before[k]), k
        assert not isinstance(v, torch._subclasses.fake_tensor.FakeTensor)
    for n, p in m.named_parameters():
        assert torch.equal(p.grad, grads[n]), n
    assert m.calls == calls and m.cache is cache
    # And the next real random draw is the one it would have been.
    torch.set_rng_state(rng)
    want = torch.rand(3)
    torch.set_rng_state(rng)
    count_step_flops(m, (x,))
    assert torch.equal(torch.rand(3), want)


class SharedBlock(nn.Module):
    """One block reached under several names: ALBERT-style sharing (``ModuleList([blk] * 3)``)
    and an alias attribute (``self.first = blk``), as Lightning Fabric's ``_FabricModule`` holds
    the model as ``_forward_module`` and ``_original_module``."""

    def __init__(self) -> None:
        super().__init__()
        blk = nn.Sequential(nn.Linear(16, 16), nn.GELU())
        self.blocks = nn.ModuleList([blk] * 3)
        self.first = blk
        self.head = nn.Linear(16, 4)
        self.register_buffer("scale", torch.ones(16))

    def forward(self, x):
        for b in self.blocks:
            x = b(x) * self.scale
        return self.head(x)


@pytest.mark.parametrize("real", [False, True])
def test_a_module_reached_by_two_names_keeps_its_own_parameters(real):
    """torch's functional_call(tie_weights=True) swaps a shared module's tensors once per name and
    puts them back in the same order: the last name's "original" was the replay's tensor, and the
    user's model kept a FakeTensor for a parameter (the job's next loss.item() raised)."""
    torch.manual_seed(0)
    m = SharedBlock()
    before = {n: p for n, p in m.named_parameters(remove_duplicate=False)}
    bufs = {n: b for n, b in m.named_buffers(remove_duplicate=False)}
    c = count_step_flops(m, (torch.randn(8, 16),), real=real)
    assert c.forward == {"fp32": 3 * mm(8, 16, 16) + mm(8, 16, 4)}
    for n, p in m.named_parameters(remove_duplicate=False):
        assert p is before[n], n
    for n, b in m.named_buffers(remove_duplicate=False):
        assert b is bufs[n], n
    loss = m(torch.randn(8, 16)).sum()
    loss.backward()
    assert isinstance(loss.item(), float)


@pytest.mark.parametrize("real", [False, True])
def test_the_users_hooks_do_not_run_in_the_replay(real):
    """A hook that keeps activations, counts calls or logs gradients sees only the user's own
    forwards and backwards: the replay ran them once more per input signature (a fake tensor in
    the user's list, a counter one too high, a gradient statistic logged twice). Module hooks,
    full backward hooks and global module hooks alike; the count is the one without hooks."""
    want = count_step_flops(mlp(), (torch.randn(4, 64),))
    m = mlp()
    acts, pre, grads, glob = [], [], [], []
    m[0].register_forward_hook(lambda mod, a, out: acts.append(out))
    m.register_forward_pre_hook(lambda mod, a: pre.append(1))
    m[2].register_full_backward_hook(lambda mod, gi, go: grads.append(go[0].norm().item()))
    h = torch.nn.modules.module.register_module_forward_hook(lambda mod, a, out: glob.append(type(mod).__name__))
    try:
        got = count_step_flops(m, (torch.randn(4, 64),), real=real)
        assert (acts, pre, grads, glob) == ([], [], [], [])
        assert got.total == want.total and got.backward == want.backward
        m(torch.randn(4, 64)).sum().backward()  # the user's own call: every hook runs, on real tensors
        assert len(acts) == 1 and not isinstance(acts[0], torch._subclasses.FakeTensor)
        assert pre == [1] and len(grads) == 1 and glob == ["Linear", "ReLU", "Linear", "Sequential"]
    finally:
        h.remove()


def test_a_hook_the_forward_needs_runs_in_the_replay():
    """A pre-hook that reshapes the input (the forward fails without it) is run after all: the
    replay is tried again with the user's hooks, seeing ``is_counting()``, as before."""
    m = mlp()
    seen = []

    def flatten(mod, args):
        seen.append(fl.is_counting())
        return (args[0].flatten(1),)

    m.register_forward_pre_hook(flatten)
    got = count_step_flops(m, (torch.randn(2, 4, 16),))
    assert got.total == count_step_flops(mlp(), (torch.randn(2, 64),)).total
    m(torch.randn(2, 4, 16))
    assert seen == [True, False]


def test_torchs_own_module_hooks_run_in_the_replay():
    """torch.nn.utils.weight_norm computes ``weight`` in a forward pre-hook: it is torch's, so it
    stays; the replay's backward reaches ``weight_g``/``weight_v`` as the real one does."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        m = nn.Sequential(torch.nn.utils.weight_norm(nn.Linear(64, 128)), nn.ReLU(), nn.Linear(128, 32))
    x = torch.randn(4, 64)
    with FlopCounterMode(display=False) as real:
        m(x).sum().backward()
    assert count_step_flops(m, (x,)).total == real.get_total_flops()


def test_a_replay_on_one_thread_leaves_another_threads_hooks_alone(sw):
    """The replay flag is per thread (hooks/replay.py: a plain "some thread replays" flag, then
    the thread's own): while one thread replays, a root forward on another is still timed, and
    the replaying thread's own calls are left alone."""
    import threading

    from stepwatch.hooks import replay

    stepwatch, mem, start = sw
    start()
    m = mlp()
    opt = torch.optim.SGD(m.parameters(), lr=0.0)  # the scan hooks m as a root
    inside, go, done = [], threading.Event(), threading.Event()

    def replayer():
        replay.set_counting(True)
        inside.append((replay.is_counting(), replay.REPLAY.active))
        go.set()
        done.wait(10)
        replay.set_counting(False)

    t = threading.Thread(target=replayer)
    t.start()
    assert go.wait(10)
    try:
        assert inside == [(True, True)] and replay.is_counting() is False  # the flag is that thread's
        m(torch.randn(2, 64)).sum().backward()
        opt.step()
        opt.zero_grad()
        stepwatch.step()
    finally:
        done.set()
        t.join(10)
    assert replay.REPLAY.active is False and replay.is_counting() is False
    stepwatch.shutdown()
    assert len(mem.records) == 1 and mem.records[0].forward_s > 0 and mem.records[0].backward_s > 0


def _on_a_fresh_thread(fn):
    """``fn()`` on a new thread (its thread-local state starts empty and dies with it)."""
    import threading

    out = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join(60)
    assert out, "the thread failed"
    return out[0]


class _SetsFunctorchState(nn.Module):
    """Its forward writes functorch's thread-local state, as a fake-tensor replay does (the flag
    is one that the state holds and Python can read back)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        torch._C._functorch.set_inplace_requires_grad_allowed(True)
        return self.lin(x)


def test_replay_leaves_no_thread_local_state_behind():
    """After a count, later backwards on the thread would deep-copy functorch's state at every
    autograd node (~1000 instructions a node): the replay runs inside an autograd node, whose end
    drops the state it created. The real forward, for contrast, leaves it. (Forward only: a
    backward's nodes restore a copy of the state that keeps its layer stack, not this flag.)"""
    read = torch._C._functorch.get_inplace_requires_grad_allowed

    def counted():
        c = count_step_flops(_SetsFunctorchState(), (torch.randn(4, 8),), backward=False)
        return c.total, read()

    def real():
        _SetsFunctorchState()(torch.randn(4, 8))
        return read()

    total, left = _on_a_fresh_thread(counted)
    assert total == mm(4, 8, 8)
    assert left is False
    assert _on_a_fresh_thread(real) is True


def test_replay_runs_with_the_callers_grad_mode_and_raises_what_the_forward_raises():
    seen = []

    class Probe(nn.Module):
        def forward(self, x):
            seen.append((torch.is_grad_enabled(), torch.is_inference_mode_enabled(), fl.is_counting()))
            if x.shape[0] == 3:
                raise KeyboardInterrupt  # not an Exception: passes through the engine unchanged
            return x * 2

    x = torch.randn(2, 4, requires_grad=True)
    count_step_flops(Probe(), (x,))
    with torch.no_grad():
        count_step_flops(Probe(), (x,))
    with torch.inference_mode():  # no autograd graph can be built: replayed as it is
        count_step_flops(Probe(), (torch.randn(2, 4),))
    assert seen == [(True, False, True), (False, False, True), (False, True, True)]
    with pytest.raises(KeyboardInterrupt):
        count_step_flops(Probe(), (torch.randn(3, 4),))
    assert fl.is_counting() is False


# ----------------------------------------------------------------------------- dtypes, wrappers, lint


def test_autocast_bf16_is_attributed_to_bf16():
    with torch.autocast("cpu", dtype=torch.bfloat16):
        c = count_step_flops(mlp(), (torch.randn(16, 64),))
    assert set(c.by_dtype) == {"bf16"}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        k1 = FlopCache.key(object(), (torch.randn(2),), None)
    k2 = FlopCache.key(object(), (torch.randn(2),), None)
    assert k1[2:] != k2[2:]


def test_compiled_module_is_unwrapped():
    m = mlp()
    compiled = torch.compile(m)  # lazy: nothing is compiled unless called
    assert fl.unwrap_module(compiled) is m
    assert count_step_flops(compiled, (torch.randn(4, 64),)).total == count_step_flops(m, (torch.randn(4, 64),)).total


def test_ddp_is_unwrapped(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        m = mlp()
        ddp = nn.parallel.DistributedDataParallel(m)
        c = count_step_flops(ddp, (torch.randn(4, 64),))
        assert c.total == count_step_flops(m, (torch.randn(4, 64),)).total
        assert all(p.grad is None for p in m.parameters())
    finally:
        dist.destroy_process_group()


def test_loss_fn_and_kwargs():
    m = mlp()
    target = torch.randn(8, 32)
    c = count_step_flops(m, (), {"input": torch.randn(8, 64)}, loss_fn=lambda out: F.mse_loss(out, target))
    assert c.total == count_step_flops(m, (torch.randn(8, 64),)).total


def test_no_grad_counts_forward_only():
    with torch.no_grad():
        c = count_step_flops(mlp(), (torch.randn(8, 64),))
    assert c.backward == {} and c.total == mm(8, 64, 128) + mm(8, 128, 32)


def test_alignment_lint_names_the_layer():
    m = nn.Sequential(nn.Linear(64, 100), nn.ReLU(), nn.Linear(100, 64)).to(torch.bfloat16)
    c = count_step_flops(m, (torch.randn(8, 64, dtype=torch.bfloat16),), lint_devices=("cpu",))
    modules = {a["module"] for a in c.alignment}
    assert any(name.endswith(".0") for name in modules) and any(name.endswith(".2") for name in modules)
    assert all("multiples of 8" in a["problem"] for a in c.alignment)
    f = fl.alignment_finding(c, rank=0)
    assert f.kind == "tensor_core_alignment" and ".0" in f.summary and f.data["layers"]
    ok = nn.Linear(64, 128).to(torch.bfloat16)
    good = count_step_flops(ok, (torch.randn(8, 64, dtype=torch.bfloat16),), lint_devices=("cpu",))
    assert good.alignment == () and fl.alignment_finding(good, rank=0) is None


# ----------------------------------------------------------------------------- cache and overrides


def test_cache_failure_is_logged_once_and_remembered(caplog):
    class DataDependent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x) if x.sum().item() > -1e9 else x

    class NotReplayable(nn.Module):
        """Fails on fake and on real tensors alike whenever stepwatch replays it."""

        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            if fl.is_counting():
                raise RuntimeError("no replay here")
            return self.lin(x)

    cache = FlopCache()
    # Data-dependent control flow cannot run on fake tensors: counted once on real tensors instead.
    dd = DataDependent()
    assert cache.get(dd, (torch.randn(2, 4),)).total == 2 * (2 * 2 * 4 * 4)
    m = NotReplayable()
    with caplog.at_level(logging.WARNING, logger="stepwatch"):
        assert cache.get(m, (torch.randn(2, 4),)) is None
        # One failed call is no reason to speak: a malformed batch the loop catches fails the
        # user's own forward too. The line comes when the signature is seen again.
        assert not [r for r in caplog.records if "stepwatch.init(flops=" in r.getMessage()]
        assert cache.get(m, (torch.randn(2, 4),)) is None
        assert cache.get(m, (torch.randn(2, 4),)) is None
    assert cache.errors == 1
    assert sum("stepwatch.init(flops=" in r.getMessage() for r in caplog.records) == 1


def test_cache_miss_budget(caplog):
    cache = FlopCache(max_misses=2)
    m = mlp()
    with caplog.at_level(logging.WARNING, logger="stepwatch"):
        assert cache.get(m, (torch.randn(1, 64),)) is not None
        assert cache.get(m, (torch.randn(2, 64),)) is not None
        assert cache.get(m, (torch.randn(3, 64),)) is None
        assert cache.get(m, (torch.randn(4, 64),)) is None
        assert cache.get(m, (torch.randn(1, 64),)) is not None  # known shapes still answer
    assert sum("input shapes changed" in r.getMessage() for r in caplog.records) == 1


def test_transformer_formula_matches_counted_model_flops():
    b, t, d, layers = 2, 32, 64, 2
    model = TinyLM(d=d, layers=layers)
    # Non-embedding matmul parameters (biases do no matmul work in 2*m*n*k accounting).
    n = sum(mod.weight.numel() for mod in model.modules() if isinstance(mod, nn.Linear))
    formula = transformer_flops(n, b * t, n_layers=layers, d_model=d, seq_len=t)
    counted = count_step_flops(model, (torch.randint(0, 96, (b, t)),)).total
    assert close(counted, formula)


def test_overrides_and_bad_values():
    assert fl.resolve_override(1e12, None, "bf16").by_dtype == {"bf16": 10**12}
    assert fl.resolve_override(lambda batch: 3 * len(batch), [1, 2], "fp32").total == 6
    assert fl.resolve_override(lambda batch: None, [1], "fp32") is None
    with pytest.raises(ValueError, match="flops must be a number"):
        fl.resolve_override("lots", None, "bf16")
    with pytest.raises(ValueError, match="n_params"):
        transformer_flops(-1, 10)
    with pytest.raises(ValueError, match="k must be"):
        FlopCount().scaled(-2)


# ----------------------------------------------------------------------------- tokens and samples
# (metrics/tokens.py: what tokens/s and samples/s divide by; rules in docs/mfu.md)


def test_tokens_from_input_ids_and_attention_mask():
    from stepwatch.metrics.tokens import infer_batch_counts

    ids = torch.randint(1, 100, (3, 10))
    mask = torch.ones(3, 10, dtype=torch.long)
    mask[0, 7:] = 0  # 3 padding positions
    mask[2, 4:] = 0  # 6 more
    c = infer_batch_counts((), {"input_ids": ids, "attention_mask": mask}).resolve()
    assert (c.samples, c.tokens) == (3, 30 - 9)
    # The same batch as a dict passed positionally (HF style model(batch) / BatchEncoding).
    c = infer_batch_counts(({"input_ids": ids, "attention_mask": mask},)).resolve()
    assert (c.samples, c.tokens) == (3, 21)
    # No mask: every position counts, unless a pad id is given.
    assert infer_batch_counts((), {"input_ids": ids}).resolve().tokens == 30
    ids[1, 5:] = 0
    assert infer_batch_counts((ids,), pad_token_id=0).resolve().tokens == 25


def test_tokens_from_plain_tensors_and_tuples():
    from stepwatch.metrics.tokens import infer_batch_counts

    ids = torch.randint(0, 50, (4, 16))
    assert infer_batch_counts((ids,)).resolve().tokens == 64
    assert infer_batch_counts(((ids, torch.randint(0, 50, (4, 16))),)).resolve().samples == 4
    img = torch.randn(8, 3, 32, 32)
    c = infer_batch_counts((img,)).resolve()
    assert (c.samples, c.tokens) == (8, None)  # images: samples known, tokens not
    labels = torch.randint(0, 10, (8,))
    assert infer_batch_counts((labels,)).resolve().tokens is None  # 1-D ints are not tokens
    assert infer_batch_counts(("text",)).resolve().samples is None


def test_tokens_add_up_over_micro_batches():
    from stepwatch.metrics.tokens import BatchCounts, infer_batch_counts

    micro = [torch.randint(0, 50, (b, 8)) for b in (2, 3, 1, 2)]  # variable batch sizes
    total = BatchCounts(0, 0)
    for ids in micro:
        total = total + infer_batch_counts((ids,)).resolve()
    assert (total.samples, total.tokens) == (8, 64)
    assert (total + BatchCounts(1, None)).tokens is None
    pending = infer_batch_counts((), {"input_ids": micro[0], "attention_mask": torch.ones(2, 8)})
    with pytest.raises(ValueError, match="resolve"):
        total + pending


def test_cache_get_from_a_hook_does_not_recurse():
    """FlopCache.get from a forward pre-hook the replay runs (a hook the forward needs: the replay
    is tried again with it) gets None inside the replay instead of counting again."""
    model = mlp()
    cache = FlopCache()
    got = []

    def hook(m, a, k):
        got.append(cache.get(m, a, k))
        return (a[0].flatten(1),), k

    model.register_forward_pre_hook(hook, with_kwargs=True)
    for _ in range(3):
        model(torch.randn(4, 4, 16)).sum().backward()
    assert cache.misses == 1 and len(cache) == 1
    # The hook's call from inside the replay gets None; the three real forwards get the count.
    assert got[0] is None and got[1] is not None and got[1] is got[2] is got[3]


def test_lazy_modules_are_counted_after_their_first_forward():
    m = nn.Sequential(nn.LazyLinear(32), nn.ReLU(), nn.Linear(32, 8))
    cache = FlopCache()
    x = torch.randn(4, 16)
    assert cache.get(m, (x,)) is None  # not materialized yet: no count, nothing remembered
    assert len(cache) == 0 and cache.misses == 0
    m(x)
    assert cache.get(m, (x,)).total == 3 * mm(4, 16, 32) - mm(4, 16, 32) + 3 * mm(4, 32, 8)


def test_throughput_collector_sums_micro_batches_and_ignores_loss_module_and_eval():
    """The session's forward pre-hook on each root feeds it; take() at step end."""
    from stepwatch.metrics.tokens import ThroughputCollector

    model, loss_mod = TinyLM(), nn.CrossEntropyLoss()
    col = ThroughputCollector()
    for root in (model, loss_mod):
        root.register_forward_pre_hook(lambda m, a, k: col.on_forward(m, a, k), with_kwargs=True)
    one = count_step_flops(model, (torch.randint(0, 96, (2, 32)),)).total
    for _ in range(4):  # gradient accumulation x4
        ids = torch.randint(0, 96, (2, 32))
        loss_mod(model(ids).flatten(0, 1), ids.flatten()).backward()
    with torch.no_grad():
        model(torch.randint(0, 96, (7, 32)))  # eval: not part of the step
    step = col.take()
    flops, tokens, samples = step.resolve()
    assert step.micro_batches == 4 and (tokens, samples) == (4 * 64, 8)
    assert flops.total >= 4 * one and close(flops.total, 4 * one, rel=0.01)  # + the tiny loss module
    assert col.take() is None


def test_torch_loss_modules_skip_the_signature_check_and_a_users_loss_does_not():
    """torch's own losses count no FLOPs for any input: after the first call, a loss module's
    calls (new shapes included) append that empty count without a signature check or a cache
    lookup. A user's subclass of ``_Loss`` may do anything (here, a matmul): it is counted per
    shape as any module."""
    from stepwatch.metrics.tokens import ThroughputCollector

    class ProjectedLoss(nn.modules.loss._Loss):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(8, 8, bias=False)

        def forward(self, a, b):
            return F.mse_loss(self.proj(a), b)

    col = ThroughputCollector()
    gets = []
    real_get = col.cache.get
    col.cache.get = lambda *a, **k: gets.append(type(a[0]).__name__) or real_get(*a, **k)
    model, ce, mine = nn.Linear(8, 8, bias=False), nn.CrossEntropyLoss(), ProjectedLoss()
    for n in (4, 4, 6, 7):
        col.on_forward(model, (torch.randn(n, 8),), {})  # the model first: its calls give the tokens
        logits, target = torch.randn(n, 8, requires_grad=True), torch.randint(0, 8, (n,))
        col.on_forward(ce, (logits, target), {})
        col.on_forward(mine, (torch.randn(n, 8), torch.randn(n, 8)), {})
    # n=4 twice: the second call of each is a hit; after that only the CrossEntropyLoss is
    assert gets == ["Linear", "CrossEntropyLoss", "ProjectedLoss"] + ["Linear", "ProjectedLoss"] * 2
    items = col.take().items
    assert [fc.total for fc, _ in items[1::3]] == [0, 0, 0, 0]
    assert all(c is None for _, c in items[1::3])
    assert [fc.total for fc, _ in items[2::3]] == [mm(n, 8, 8) * 2 for n in (4, 4, 6, 7)]
    assert [c.samples for _, c in items[::3]] == [4, 4, 6, 7]


def test_throughput_collector_override_number_and_callable():
    from stepwatch.metrics.tokens import ThroughputCollector

    m = mlp()
    for override, want in ((1000, 2000), (lambda batch: 10 * batch.shape[0], 2 * 10 * 8)):
        col = ThroughputCollector(flops=override)
        h = m.register_forward_pre_hook(lambda mod, a, k: col.on_forward(mod, a, k), with_kwargs=True)
        for _ in range(2):
            m(torch.randn(8, 64)).sum().backward()
        h.remove()
        flops, _, samples = col.take().resolve()
        assert flops.total == want and flops.by_dtype.keys() == {"fp32"} and samples == 16
    with pytest.raises(ValueError, match="flops must be"):
        ThroughputCollector(flops="many")


# ----------------------------------------------------------------------------- last-signature fast path


class _CountingCounter:
    """A stand-in counter: FLOPs from the call's signature, and how often it was asked."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, module, args, kwargs, **kw):
        self.calls += 1
        x = args[0]
        while isinstance(x, (tuple, list)):
            x = x[0]
        n = int(x.numel()) * (2 if x.dtype == torch.float64 else 1) + (7 if x.requires_grad else 0)
        n += 1000 * int(torch.is_grad_enabled()) + sum(v for v in (kwargs or {}).values() if type(v) is int)
        return FlopCount(forward={"fp32": n})


def _slow(cache, m, args, kwargs=None):
    """What the full key finds (no fast path)."""
    return cache._entries[FlopCache.key(m, args, kwargs)]


def test_fast_path_gives_the_slow_paths_count_without_building_the_key(monkeypatch):
    counter = _CountingCounter()
    cache = FlopCache(counter=counter)
    m = nn.Linear(4, 4)
    first = cache.get(m, (torch.randn(2, 4),))
    keys = []
    real_key = FlopCache.key
    monkeypatch.setattr(FlopCache, "key", staticmethod(lambda *a: keys.append(1) or real_key(*a)))
    for _ in range(3):
        got = cache.get(m, (torch.randn(2, 4),))
        assert got is first and got == cache._entries[real_key(m, (torch.randn(2, 4),), None)]
    assert keys == [] and counter.calls == 1  # answered by the fast path: no key, no count


@pytest.mark.parametrize(
    "change",
    ["shape", "dtype", "requires_grad", "grad_mode", "kwarg_value", "kwarg_name", "arg_count", "scalar_type", "nested"],
)
def test_fast_path_notices_a_changed_signature(change):
    counter = _CountingCounter()
    cache = FlopCache(counter=counter)
    m = nn.Linear(4, 4)
    base_args, base_kw = (torch.randn(2, 4),), {"extra": 3}
    before = cache.get(m, base_args, base_kw)
    assert cache.get(m, (torch.randn(2, 4),), {"extra": 3}) is before  # warm: the fast path holds it
    args, kw, grad = (torch.randn(2, 4),), {"extra": 3}, True
    if change == "shape":
        args = (torch.randn(3, 4),)
    elif change == "dtype":
        args = (torch.randn(2, 4, dtype=torch.float64),)
    elif change == "requires_grad":
        args = (torch.randn(2, 4, requires_grad=True),)
    elif change == "grad_mode":
        grad = False
    elif change == "kwarg_value":
        kw = {"extra": 4}
    elif change == "kwarg_name":
        kw = {"other": 3}
    elif change == "arg_count":
        args = (torch.randn(2, 4), None)
    elif change == "scalar_type":
        kw = {"extra": 3.0}
    elif change == "nested":
        args = ((torch.randn(2, 4),),)
    with torch.set_grad_enabled(grad):
        got = cache.get(m, args, kw)
        assert got == _slow(cache, m, args, kw)  # the slow path's answer for the new signature
    # a new signature: counted, not the old answer (3.0 is the same key as 3 to the slow path)
    assert counter.calls == (1 if change == "scalar_type" else 2)
    assert cache.get(m, base_args, base_kw) is before  # and the old one is still known


def test_fast_path_is_per_module_and_follows_autocast():
    counter = _CountingCounter()
    cache = FlopCache(counter=counter)
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    x = torch.randn(2, 4)
    fa, fb = cache.get(a, (x,)), cache.get(b, (x,))
    assert counter.calls == 2 and cache.get(a, (x,)) is fa and cache.get(b, (x,)) is fb
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cache.get(a, (x,))
    assert counter.calls == 3  # autocast is part of the key: a new count, not the fp32 one
    assert cache.get(a, (x,)) is fa


def test_anomaly_mode_leaves_the_fake_count_alone_and_stays_on():
    """``torch.autograd.set_detect_anomaly(True)`` for a whole run: the replay on fake tensors
    used to fail (anomaly mode's checks read values), print torch's "Error detected in
    AddmmBackward0" warning with a traceback through stepwatch, and count again on real tensors."""
    import warnings

    m, x = mlp(), torch.randn(4, 64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the one warning set_detect_anomaly(True) itself gives
        anomaly = torch.autograd.set_detect_anomaly(True)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fc = count_step_flops(m, (x,))  # on fakes: it raised FlopCountError here before
        assert [str(w.message)[:80] for w in caught] == []
        assert fc.total == count_step_flops(m, (x,), real=True).total
        assert torch.is_anomaly_enabled()
    finally:
        anomaly.__exit__(None, None, None)
    assert not torch.is_anomaly_enabled()


@pytest.mark.parametrize("real", [False, True])
def test_the_replay_leaves_the_users_saved_tensor_hooks_alone(real):
    """A forward under the user's ``saved_tensors_hooks`` (activation offload to host memory):
    the replay called the user's pack hook on its fakes, or on real copies, once more per new
    input signature. Its count is the same with the hooks on, and the hooks stay the user's."""
    m, x = mlp(), torch.randn(4, 64)
    calls = []

    def pack(t):
        calls.append(type(t).__name__)
        return t.detach().numpy().copy()

    expected = count_step_flops(m, (x,), real=real).total
    with torch.autograd.graph.saved_tensors_hooks(pack, torch.from_numpy):
        fc = count_step_flops(m, (x,), real=real)
        assert calls == []
        m(x).sum().backward()  # the user's own forward still packs through their hook
    assert fc.total == expected
    assert calls and set(calls) == {"Tensor"}


@pytest.fixture
def tf32_switches():
    """torch's two TF32 switches, put back as they were after the test."""
    mm, conv = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = mm, conv


def test_a_count_says_whether_the_tf32_switches_can_change_it():
    """Only an fp32 matmul or convolution on a CUDA device has a dtype key that follows the TF32
    switches. The CUDA tensors here are fake tensors on a CUDA device (no GPU on this machine):
    the counter reads only their device and dtype."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    assert count_step_flops(mlp(), (torch.randn(4, 64),)).tf32_sensitive is False  # CPU: never
    mode = FakeTensorMode()

    def on_cuda(dtype):
        return FakeTensor(mode, torch.empty(4, 4, dtype=dtype, device="meta"), torch.device("cuda"))

    for dtype, sensitive in ((torch.float32, True), (torch.bfloat16, False), (torch.float16, False)):
        counter = fl._make_counter(("cuda",))
        a = on_cuda(dtype)
        assert counter._key(torch.ops.aten.mm, (a, a)) in ("fp32", "tf32", "bf16", "fp16")
        assert counter.tf32_sensitive is sensitive, dtype
    # Any other count (a user's counter, an override) is taken as sensitive; a sum is if a part is.
    assert FlopCount().tf32_sensitive is True and FlopCount.from_total(10, "bf16").tf32_sensitive is True
    cpu = FlopCount({"fp32": 5}, tf32_sensitive=False)
    assert (cpu + cpu).tf32_sensitive is False and (cpu + FlopCount({"fp32": 5})).tf32_sensitive is True
    assert cpu.scaled(3).tf32_sensitive is False
    assert cpu == FlopCount({"fp32": 5})  # the flag is not part of a count's value


def test_fast_path_reads_the_tf32_switches_only_for_a_count_they_can_change(tf32_switches):
    m, x = nn.Linear(4, 4), torch.randn(2, 4)
    cache = FlopCache()  # count_step_flops: a CPU count, which the switches cannot change
    first = cache.get(m, (x,))
    assert first.tf32_sensitive is False and cache._last[id(m)][0].state[2:] == (None, None)
    torch.backends.cuda.matmul.allow_tf32 = not torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = not torch.backends.cudnn.allow_tf32
    assert cache._last[id(m)][0].matches((x,), {}) is True and cache.get(m, (x,)) is first
    counter = _CountingCounter()  # its counts are taken as sensitive: a switch is a new signature
    cache = FlopCache(counter=counter)
    cache.get(m, (x,))
    torch.backends.cuda.matmul.allow_tf32 = not torch.backends.cuda.matmul.allow_tf32
    assert cache._last[id(m)][0].matches((x,), {}) is False
    cache.get(m, (x,))
    assert counter.calls == 2


def test_throughput_collector_reuses_counts_only_for_the_same_shape_and_dtype():
    from stepwatch.metrics.tokens import ThroughputCollector

    col = ThroughputCollector(cache=FlopCache(counter=_CountingCounter()))
    m = nn.Linear(4, 4)
    got = []
    for x in (torch.randn(2, 4), torch.randn(2, 4), torch.randn(5, 4), torch.randint(0, 9, (3, 6)),
              torch.randint(0, 9, (3, 6)), torch.randint(0, 9, (3, 7))):
        col.on_forward(m, (x,), {})
        _, tokens, samples = col.take().resolve()
        got.append((tokens, samples))
    assert got == [(None, 2), (None, 2), (None, 5), (18, 3), (18, 3), (21, 3)]


def _step_of(col):
    """One step's (FLOPs total or None, tokens, samples, micro-batches) from a collector."""
    step = col.take()
    if step is None:
        return None
    fc, tokens, samples = step.resolve()
    return (None if fc is None else fc.total, tokens, samples, step.micro_batches)


def test_throughput_collectors_hot_path_gives_what_the_full_path_gives():
    """A root called as last time appends what that call left (one lookup); every other call
    takes the full path. The same calls through a collector that never keeps a hit must give
    the same steps: shapes, dtypes, grad mode, autocast, kwargs, a mask, a pad id, a loss module."""
    from stepwatch.metrics.tokens import ThroughputCollector

    def counter(module, args, kwargs, **kw):  # FLOPs from the signature and the global state
        tensors = [t for t in (*args, *(kwargs or {}).values()) if isinstance(t, torch.Tensor)]
        n = sum(t.numel() * t.element_size() for t in tensors) + 1000 * torch.is_grad_enabled()
        key = "bf16" if torch.is_autocast_enabled("cpu") else "fp32"
        return FlopCount(forward={key: n + id(module) % 7})

    model, loss_mod = TinyLM(), nn.CrossEntropyLoss()
    hot = ThroughputCollector(cache=FlopCache(counter=counter))
    full = ThroughputCollector(cache=FlopCache(counter=counter))
    padded = ThroughputCollector(cache=FlopCache(counter=counter), pad_token_id=0)
    ids = torch.randint(1, 96, (2, 8))
    calls = []
    for _ in range(3):
        calls.append(((ids,), {}))
    calls.append(((torch.randint(1, 96, (3, 8)),), {}))  # a new shape
    calls.append(((ids.float(),), {}))  # a new dtype
    calls.append(((), {"input_ids": ids, "attention_mask": torch.tensor([[1] * 8, [1] * 3 + [0] * 5])}))
    calls.append(((), {"input_ids": ids, "attention_mask": torch.tensor([[1] * 8, [1] * 6 + [0] * 2])}))  # same shapes, other mask
    calls.append(((ids.masked_fill(ids > 50, 0),), {}))
    calls.append(((ids,), {}))
    steps = {id(c): [] for c in (hot, full, padded)}
    for args, kwargs in calls:
        for grad, autocast in ((True, False), (True, True), (False, False)):
            for col in (hot, full, padded):
                with torch.set_grad_enabled(grad), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                    col.on_forward(model, args, kwargs)
                    col.on_forward(loss_mod, (torch.randn(16, 96), torch.randint(0, 96, (16,))), {})
                full._hits.clear()  # never a hit: every call takes the full path
                steps[id(col)].append(_step_of(col))
    assert steps[id(hot)] == steps[id(full)]
    assert None in steps[id(hot)]  # grad disabled: nothing for the step
    masked = [s for s in steps[id(hot)] if s is not None and s[1] == 11]
    assert masked and [s for s in steps[id(hot)] if s is not None and s[1] == 14]  # each mask counted
    # a pad id makes the counts depend on the values: counted on every call, never reused
    with_pad = [s[1] for s in steps[id(padded)] if s is not None]
    assert with_pad[:2] == [16, 16] and min(t for t in with_pad if t is not None) < 16
    assert len(hot._hits) == 2  # the model and the loss module, each with its last call


def test_throughput_collector_callable_override_reads_every_batch():
    from stepwatch.metrics.tokens import ThroughputCollector

    m = mlp()
    col = ThroughputCollector(flops=lambda batch: 10 * batch.shape[0])
    totals = []
    for b in (2, 2, 5, 5):
        col.on_forward(m, (torch.randn(b, 64),), {})
        totals.append(col.take().resolve()[0].total)
    assert totals == [20, 20, 50, 50] and not col._hits


class _RunningCenter(nn.Module):
    """Keeps a running mean and a sample counter as plain tensor attributes (not buffers), updated
    in place in ``forward``, as research code does."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 8)
        self.mean = torch.zeros(8)
        self.seen = torch.zeros((), dtype=torch.long)

    def forward(self, x):
        h = self.lin(x)
        with torch.no_grad():
            self.mean.mul_(0.9).add_(0.1 * h.mean(0))
            self.seen.add_(x.shape[0])
        return h - self.mean


@pytest.mark.parametrize("real", [False, True], ids=["fake", "real"])
def test_a_replay_leaves_tensors_held_as_plain_attributes_alone(real):
    """The replay ran non-fake tensors for real: an in-place update of such an attribute reached
    the real tensor (the counter grew by each replay's batch; losses differed from the run
    without stepwatch from the second step on)."""
    m = _RunningCenter()
    mean, seen = m.mean, m.seen
    before = mean.clone()
    fc = count_step_flops(m, (torch.randn(4, 16),), real=real)
    assert fc.total > 0
    assert m.mean is mean and m.seen is seen  # the originals back in place
    assert torch.equal(mean, before) and int(seen) == 0


def test_a_users_flop_counter_around_the_step_does_not_count_the_replay():
    """The user's own FlopCounterMode (a dispatch mode) around a step was on the mode stack while
    the replay ran inside that step's first forward: it counted the replay too, twice the truth.
    The replay runs with the user's dispatch modes set aside; stepwatch's count is unchanged."""
    m = mlp()
    x = torch.randn(4, 64)
    with FlopCounterMode(display=False) as alone:
        m(x).sum().backward()
    cache = FlopCache()
    m.register_forward_pre_hook(lambda mod, a, k: seen.append(cache.get(mod, a, k)), with_kwargs=True)
    seen = []
    for _ in range(2):
        with FlopCounterMode(display=False) as user:
            m(x).sum().backward()
        assert user.get_total_flops() == alone.get_total_flops()
    assert seen[0].total == alone.get_total_flops() and seen[1] is seen[0]


class _AuxMoE(nn.Module):
    """A forward that keeps a term in a list on the module (MoE load balancing, a KL term) and
    draws from Python's and numpy's RNG (LayerDrop written with ``random``)."""

    def __init__(self):
        super().__init__()
        self.gate, self.out = nn.Linear(8, 4), nn.Linear(8, 3)
        self.aux_losses = []
        self.by_name = {}

    def forward(self, x):
        import random

        import numpy as np

        probs = self.gate(x).softmax(-1)
        self.aux_losses.append((probs.mean(0) ** 2).sum())
        self.by_name["drop"] = random.random() + float(np.random.rand())
        return self.out(x) * probs[:, :1]


@pytest.mark.parametrize("real", [False, True])
def test_the_replay_leaves_a_modules_lists_dicts_and_pythons_rng_alone(real):
    """The replay's forward appended its (fake, or already back-propagated) term to the user's
    list before the real forward: the loop's sum of the list then failed ("backward through the
    graph a second time"). And it drew from Python's and numpy's RNG: the run changed."""
    import random

    import numpy as np

    m = _AuxMoE()
    random.seed(1), np.random.seed(1)
    want = (random.random(), float(np.random.rand()))
    random.seed(1), np.random.seed(1)
    count_step_flops(m, (torch.randn(4, 8),), real=real)
    assert m.aux_losses == [] and m.by_name == {}
    assert (random.random(), float(np.random.rand())) == want


def test_a_forward_that_fails_on_fakes_logs_no_torch_error():
    """A malformed batch the user's loop catches: the replay ran it first on fake tensors, and
    torch's fake-tensor logger printed an ERROR traceback ("failed while attempting to run meta
    for aten.mm.default") that looked like a crash of the job. The count fails quietly (it
    raises FlopCountError; the cache's one line says so); another thread's log is untouched."""
    import logging

    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    lg = logging.getLogger("torch._subclasses.fake_tensor")
    h = Keep(level=logging.DEBUG)
    lg.addHandler(h)
    try:
        with pytest.raises(fl.FlopCountError):
            count_step_flops(mlp(), (torch.randn(8, 7),))
        assert seen == []
        lg.error("the user's own line")
        assert seen == ["the user's own line"] and not lg.filters
    finally:
        lg.removeHandler(h)


class _OwnRngs(nn.Module):
    """Draws from random-number generators it holds itself: a ``torch.Generator`` (noise), a
    ``random.Random`` (LayerDrop), numpy's ``Generator`` and ``RandomState``, and one more
    ``torch.Generator`` in a list. ``data_dependent`` adds an ``.item()`` to the forward, which
    fake tensors cannot run (the count is then taken on real tensors)."""

    def __init__(self, data_dependent):
        import random

        import numpy as np

        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.gen = torch.Generator().manual_seed(1234)
        self.rng = random.Random(42)
        self.np_gen = np.random.default_rng(7)
        self.np_state = np.random.RandomState(7)
        self.gens = [torch.Generator().manual_seed(99)]
        self.data_dependent = data_dependent

    def forward(self, x):
        h = self.lin(x)
        if self.data_dependent and h.mean().item() > -1e9:
            h = h + torch.randn(h.shape, generator=self.gen) + torch.rand(h.shape, generator=self.gens[0])
        if self.rng.random() < 2 and self.np_gen.random() < 2 and self.np_state.rand() < 2:
            h = h * 2
        return h

    def draws(self):
        return (self.gen.get_state(), self.gens[0].get_state(), self.rng.random(), self.np_gen.random(),
                self.np_state.rand())


@pytest.mark.parametrize("data_dependent", [False, True], ids=["fake replay", "real replay"])
def test_the_replay_leaves_the_random_generators_a_module_holds_alone(data_dependent):
    """A module that owns its generator (``self.gen = torch.Generator().manual_seed(1234)``, a
    seeded ``random.Random`` for LayerDrop): the replay's forward drew from it, so the run's
    noise, masks and dropped layers were not those of the same run without stepwatch (only the
    default generators were saved and restored). Every generator a module holds as an
    attribute (or in a list, tuple or dict attribute) is restored now."""
    m = _OwnRngs(data_dependent)
    want = _OwnRngs(data_dependent).draws()
    fc = count_step_flops(m, (torch.randn(4, 8),), real=data_dependent)
    assert fc.total > 0
    got = m.draws()
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert got[2:] == want[2:]


def test_a_generator_that_cannot_be_saved_does_not_fail_the_count():
    """``random.SystemRandom`` (no state to save: its getstate raises) held by a module: the
    count goes on, and the generators that can be saved are restored."""
    import random

    m = _OwnRngs(False)
    m.sys_rng = random.SystemRandom()
    want = _OwnRngs(False).draws()
    assert count_step_flops(m, (torch.randn(4, 8),)).total > 0
    assert m.draws()[2:] == want[2:]


def test_a_list_of_per_sample_tensors_counts_one_sample_per_tensor():
    """A list passed first was read by its first element: a list of variable-length 1-D id
    sequences (a collate_fn that leaves the padding to the model) counted the first sequence's
    length as samples and no tokens; a list of per-sample images the first image's channels.
    A list (or tuple) of tensors of one ndim, dtype and device whose batch dims differ cannot be
    one collated batch: one sample per tensor, and 1-D ids are tokens."""
    from stepwatch.metrics.tokens import infer_batch_counts

    seqs = [torch.randint(1, 50, (n,)) for n in (5, 3, 7)]
    for given in (seqs, tuple(seqs)):
        c = infer_batch_counts((given,)).resolve()
        assert (c.samples, c.tokens) == (3, 15)
    seqs[0][3:] = 0
    seqs[2][6:] = 0
    c = infer_batch_counts((seqs,), pad_token_id=0).resolve()
    assert (c.samples, c.tokens) == (3, 15 - 3)
    feats = [torch.randn(n, 8) for n in (5, 3, 7, 2)]  # per-sample [length, features], floats
    c = infer_batch_counts((feats,)).resolve()
    assert (c.samples, c.tokens) == (4, None)
    # Images share dim 0 (their channels): per-sample when that is the unbatched input of the
    # model's first convolution (in_channels 3, [C, H, W]), which the collector reads off the model.
    images = [torch.randn(3, 20 + 4 * i, 24) for i in range(5)]
    c = infer_batch_counts((images,), conv_input=(3, 3)).resolve()
    assert (c.samples, c.tokens) == (5, None)


def test_a_collated_list_of_batch_tensors_still_counts_its_batch():
    """What stays read by the list's first element: tensors that share the batch dim (inputs with
    their lengths, mask or labels; two inputs of different widths; a seq-first model's source and
    target, whose batch is dim 1), and anything whose ndim or dtype differ."""
    from stepwatch.metrics.tokens import infer_batch_counts

    def counts(first, **kw):
        c = infer_batch_counts((first,), **kw).resolve()
        return c.samples, c.tokens

    assert counts([torch.randn(4, 5, 6), torch.full((4,), 5.0)]) == (4, None)
    assert counts([torch.randn(4, 3), torch.randn(4, 7)]) == (4, None)
    assert counts((torch.randint(0, 50, (4, 16)), torch.ones(4, 16, dtype=torch.long))) == (4, 64)
    assert counts([torch.randint(0, 50, (7, 4)), torch.randint(0, 50, (5, 4))], seq_first=True) == (4, 28)
    assert counts([torch.randn(5, 8), torch.randn(3, 8, dtype=torch.float64)]) == (5, None)
    # [B, C, H, W] batches at two scales: not the unbatched input of a Conv2d(3, ...)
    assert counts([torch.randn(2, 3, 32, 32), torch.randn(2, 3, 16, 16)], conv_input=(3, 3)) == (2, None)
    # Shared dim 0 and no convolution that says otherwise: [3, H, W] reads as a batch of 3.
    assert counts([torch.randn(3, 20, 24), torch.randn(3, 24, 24)]) == (3, None)


class _WritesItsParameters(nn.Module):
    """A forward that cannot run on fake tensors (``.item()``) and writes its own parameters in
    place: a frozen one (a momentum copy, a running statistic) and, under ``no_grad``, one that
    trains (a clamp; a scale through ``.data``)."""

    def __init__(self, catch=False):
        super().__init__()
        self.f, self.g = nn.Linear(16, 32), nn.Linear(32, 4)
        self.ema = nn.Parameter(torch.zeros(32, 16), requires_grad=False)
        self.catch = catch

    def forward(self, x):
        with torch.no_grad():
            try:
                self.ema.lerp_(self.f.weight, 0.1)
                self.f.weight.clamp_(-0.1, 0.1)
                self.g.weight.data.mul_(0.5)
            except Exception:  # noqa: BLE001 - a forward that swallows errors, as some do
                if not self.catch:
                    raise
        h = self.f(x).relu()
        if h.sum().item() > 1e9:
            h = h * 0
        return self.g(h)


def _params_of(m):
    return {k: (v.detach().clone(), v._version) for k, v in m.named_parameters()}


def _same_params(m, before):
    assert all(torch.equal(v, before[k][0]) for k, v in m.named_parameters()), "a real parameter changed"
    assert all(v._version == before[k][1] for k, v in m.named_parameters()), "a real parameter was written"


@pytest.mark.parametrize("catch", [False, True], ids=["raises", "forward_catches_it"])
def test_a_real_replay_never_writes_the_models_parameters(catch):
    """The real replay ran on detached aliases of the parameters: a write in place to a frozen
    one, or to any one under ``no_grad`` or through ``.data``, landed in the real model (MoCo's
    key encoder, a running statistic: training diverged from the run without stepwatch). The
    write is stopped before it runs; the replay runs again on copies; the count is the real one.
    ``catch``: the forward swallows what the stopped write raised -- the replay went on, but a
    count from it would be of a forward that is not the user's: it runs again on copies too."""
    m = _WritesItsParameters(catch=catch)
    before = _params_of(m)
    x = torch.randn(4, 16)
    fc = count_step_flops(m, (x,), real=True)
    _same_params(m, before)
    with FlopCounterMode(display=False) as truth:
        m(x).sum().backward()
    assert fc.total == truth.get_total_flops()


def test_a_real_replay_without_room_for_copies_is_refused(monkeypatch):
    from stepwatch.metrics import flops

    monkeypatch.setattr(flops, "_free_bytes", lambda device: 0)
    m = _WritesItsParameters()
    before = _params_of(m)
    with pytest.raises(flops.FlopCountRefused, match=r"writes 'ema' in place.*memory.*flops="):
        count_step_flops(m, (torch.randn(4, 16),), real=True)
    _same_params(m, before)
    # In the cache: null, and said with this reason (not the fake replay's), not the fake error.
    cache = FlopCache()
    assert cache.get(m, (torch.randn(4, 16),)) is None
    assert "writes 'ema' in place" in next(iter(cache._unsaid.values()))


def test_a_real_replay_that_writes_nothing_copies_nothing(monkeypatch):
    """Copies are made only for a forward that writes its parameters: a large model whose
    forward only reads them is replayed on aliases (no memory), even with no room for a copy."""
    from stepwatch.metrics import flops

    monkeypatch.setattr(flops, "_free_bytes", lambda device: 0, raising=False)
    m = mlp()
    x = torch.randn(4, 64)
    with FlopCounterMode(display=False) as truth:
        m(x).sum().backward()
    assert count_step_flops(m, (x,), real=True).total == truth.get_total_flops()


def test_a_scan_while_another_thread_replays_never_takes_the_replay_for_a_root(sw):
    """Two threads training at once: a scan on one (its optimizer's construction) ran while the
    other thread's FLOP-count replay was alive, hooked stepwatch's own ``ReplayCall`` as a root
    of the job's (``root_modules`` ['Linear', 'Linear', 'ReplayCall'] in 2 runs of 3), and took the
    model it held for its child. The replay's wrapper is neither a root nor a parent."""
    from stepwatch.metrics.flops import _replay_call

    stepwatch, _, start = sw
    start()
    net = nn.Linear(2, 2)
    held = _replay_call(net, None, False, None)  # alive, as while another thread replays
    torch.optim.SGD(net.parameters(), lr=0.1)  # this thread's scan
    inst = stepwatch.get_session().instrumentation
    assert "ReplayCall" not in inst.roots and held not in inst._hooked, inst.roots
    assert net in inst._hooked, inst.roots


# ----------------------------------------------------------------------------- lengths that change every step


class _Counted:
    """count_step_flops, keeping the shape of each call it replays (a replay of a 12-layer GPT-2
    on fakes takes ~1 s on this machine: a helper's HF Trainer run with dynamic padding spent 10.5
    of its 12.9 s in them, one per step, kept out of the records)."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, ...]] = []

    def __call__(self, module, args, kwargs, **kw):
        self.calls.append(tuple(args[0].shape) if args else tuple(tuple(v.shape) for v in kwargs.values()))
        return count_step_flops(module, args, kwargs, **kw)


def _same_count(got, want) -> bool:
    return got is not None and (got.forward, got.backward, got.recompute) == (want.forward, want.backward, want.recompute)


def test_lengths_that_change_every_step_follow_a_checked_law_with_few_replays():
    """Dynamic padding: the batch's length changes every step. After four replays agree with the
    quadratic through three of them, new lengths within a factor 2 of the checked range are
    computed (exactly: attention is quadratic in the length, the rest linear); one further out is
    replayed, and checks the law again. Every count is the replay's own number."""
    torch.manual_seed(0)
    model = TinyLM()
    counter = _Counted()
    cache = FlopCache(counter=counter)
    lengths = [8, 9, 11, 12, 20, 13, 40, 64, 7, 30, 5, 17, 33, 48, 47, 10, 3, *range(50, 80)]
    for t in lengths:
        ids = torch.randint(0, 96, (4, t))
        got, want = cache.get(model, (ids,)), count_step_flops(model, (ids,))
        assert _same_count(got, want), t
    blocks, head, _ = lm_truth(4, 77)
    assert cache.get(model, (torch.randint(0, 96, (4, 77)),)).forward == {"fp32": blocks + head}
    assert counter.calls == [(4, 8), (4, 9), (4, 11), (4, 12), (4, 40), (4, 3)]
    assert (cache.replays, cache.predicted) == (6, len(set(lengths)) - 6)


class _Branchy(nn.Module):
    """FLOPs that are no polynomial of the length: a second layer runs on sequences over 12."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        x = self.a(x)
        return self.b(x) if x.shape[1] > 12 else x


def test_a_law_that_a_replay_contradicts_is_dropped_and_every_length_replayed():
    torch.manual_seed(0)
    model, counter = _Branchy(), _Counted()
    cache = FlopCache(counter=counter)
    # 30 lies beyond twice the checked 11: replayed, and breaks the law; from then on every length
    # is replayed, those over 12 too (a new law of those alone would have computed 11 and 10 wrong)
    lengths = (8, 9, 10, 11, 30, 14, 20, 13, 15, 16, 17, 18, 19, 21, 7, 6)
    for t in lengths:
        x = torch.randn(2, t, 16)
        assert _same_count(cache.get(model, (x,)), count_step_flops(model, (x,))), t
    assert len(counter.calls) == len(lengths) and cache.predicted == 0


def test_batch_and_length_changing_together_follow_a_two_size_law_once_it_is_checked():
    """Two sizes that change independently (a token-budget sampler): no one-size law fits, and
    the work is a batch times a length squared (attention), degree 3 in all. The two-size law
    (degree <= 2 in each) is determined by 9 replays and checked by a 10th; until then every
    shape is replayed, after it every count is the replay's own number."""
    torch.manual_seed(0)
    model, counter = TinyLM(), _Counted()
    cache = FlopCache(counter=counter)
    shapes = [(4, 8), (4, 9), (2, 10), (3, 11), (2, 12), (5, 13), (4, 14), (3, 9), (5, 10), (2, 14),
              (3, 13), (4, 12), (5, 9), (2, 8)]
    for b, t in shapes:
        ids = torch.randint(0, 96, (b, t))
        assert _same_count(cache.get(model, (ids,)), count_step_flops(model, (ids,))), (b, t)
    assert counter.calls == [(b, t) for b, t in shapes[:10]]
    assert cache.predicted == len(shapes) - 10


class _Seq2Seq(nn.Module):
    """An encoder-decoder as HF's are called: ``input_ids``/``attention_mask`` of the source length,
    ``labels`` of the target length, padded apart (DataCollatorForSeq2Seq)."""

    def __init__(self, vocab=96, d=32, h=4) -> None:
        super().__init__()
        self.h, self.hd = h, d // h
        self.emb = nn.Embedding(vocab, d)
        self.enc, self.dec = Block(d, h), Block(d, h)
        self.q, self.kv, self.o = nn.Linear(d, d), nn.Linear(d, 2 * d), nn.Linear(d, d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, input_ids, attention_mask, labels):
        src = self.enc(self.emb(input_ids))
        tgt = self.dec(self.emb(labels))
        b, s, d = src.shape
        t = tgt.shape[1]
        q = self.q(tgt).view(b, t, self.h, self.hd).transpose(1, 2)
        k, v = self.kv(src).view(b, s, 2, self.h, self.hd).permute(2, 0, 3, 1, 4)
        mask = attention_mask[:, None, None, :].bool()
        x = tgt + self.o(F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(b, t, d))
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def test_source_and_target_lengths_padded_apart_follow_a_two_size_law():
    """Seq2seq fine-tuning pads the source and the target to their own longest: a replay per
    (source, target) pair, and after 32 of them (about 30 steps) FLOPs and MFU were null for every
    new pair. The counts are a polynomial in the two lengths (self-attention squares each, cross-
    attention multiplies them): after 10 replays they are computed, each the replay's own."""
    import random

    torch.manual_seed(0)
    rng = random.Random(0)
    model, counter = _Seq2Seq(), _Counted()
    cache = FlopCache(counter=counter)
    pairs = [(rng.randint(6, 40), rng.randint(3, 20)) for _ in range(30)]
    for s, t in pairs:
        kw = dict(input_ids=torch.randint(0, 96, (4, s)), attention_mask=torch.ones(4, s, dtype=torch.long),
                  labels=torch.randint(0, 96, (4, t)))
        assert _same_count(cache.get(model, (), kw), count_step_flops(model, (), kw)), (s, t)
    assert cache.replays == 10 and cache.predicted == len(set(pairs)) - 10, (cache.replays, cache.predicted)


def test_a_training_loop_with_dynamic_padding_gets_every_steps_flops(tmp_path):
    """The loop as written with a collator that pads to the longest sequence: 40 steps of 40
    lengths. Every record's FLOPs are the count at its length (48 steps over 32 lengths gave
    null from the 33rd on, after 32 replays), and run.json says how many replays there were and
    how long they took (kept out of the steps, they were said nowhere)."""
    import json

    import stepwatch

    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    out = stepwatch.InMemoryExporter()
    stepwatch.init(dir=str(tmp_path), console="off", comm=False, memory=False, gpu_telemetry=False,
                   watchdog="off", capture="off", exporters=[out])
    lengths = [8 + (i * 7) % 40 for i in range(40)]
    try:
        for t in lengths:
            ids = torch.randint(0, 96, (4, t))
            model(ids).float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    finally:
        stepwatch.shutdown()
    want = {t: count_step_flops(model, (torch.randint(0, 96, (4, t)),)).total for t in set(lengths)}
    assert [r.flops for r in out.records] == [want[t] for t in lengths]
    run = json.load(open(tmp_path / "run.json"))
    tm = run["features"]["training_metrics"]
    assert 4 <= tm["flop_replays"] <= 8 and tm["flop_replays"] + tm["flop_predicted"] == len(set(lengths)), tm
    assert 0 < tm["flop_replay_s"] < 60, tm


_WARNING_SCRIPT = r'''
import os, sys, warnings
if sys.argv[1] == "on":
    import stepwatch
    stepwatch.init(dir=sys.argv[2], console="off")
import torch, torch.nn as nn

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 2)

    def forward(self, x):
        warnings.warn("Net.forward: inside the model", UserWarning)
        return self.fc(x)

def loss_fn(out):
    warnings.warn("loss_fn: this reduction is deprecated", FutureWarning)
    return out.sum()

torch.manual_seed(0)
model = Net()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for i in range(12):
    opt.zero_grad()
    loss_fn(model(torch.randn(4 + i // 3, 8))).backward()  # 4 batch shapes: 4 FLOP counts
    opt.step()
'''


def test_the_flop_count_shows_none_of_the_jobs_warnings_again(tmp_path):
    """Python shows a warning once per place by default. Each FLOP count (a new batch shape) ran
    under ``warnings.catch_warnings()``, whose exit resets every module's shown-once registry: a
    warning of the loop's own (outside the model) showed again after each count, and one inside
    the model's forward showed again from the count's replay. The count now leaves the registry
    alone: each warning shows once, as without stepwatch."""
    import subprocess
    import sys

    script = tmp_path / "train.py"
    script.write_text(_WARNING_SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEPWATCH_")}
    env["PYTHONPATH"] = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "src")
    out = {}
    for how in ("off", "on"):
        r = subprocess.run([sys.executable, str(script), how, str(tmp_path / "run")], env=env, capture_output=True,
                           text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        out[how] = [line for line in r.stderr.splitlines() if "Warning:" in line and "stepwatch" not in line]
    assert len(out["off"]) == 2, out["off"]  # each warning once
    assert out["on"] == out["off"], out


def test_a_sparse_matmul_counts_the_work_of_its_stored_elements(sw):
    """pytorch/examples' gcn multiplies by a sparse adjacency (``torch.spmm(adj, support)``).
    torch's formula takes every operand as dense: a 1%-dense adjacency counted 100 times its
    work, and MFU with it. A matrix product with a sparse operand counts 2 x its stored elements
    x the dense operand's columns (on real tensors: a fake sparse tensor holds no elements)."""
    stepwatch, mem, start = sw
    start()
    torch.manual_seed(0)
    n, f, h = 300, 16, 8
    adj = (torch.rand(n, n) < 0.01).float().to_sparse()
    nnz = adj._nnz()

    class GCN(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(f, h) * 0.1)

        def forward(self, x, a):
            return torch.spmm(a, torch.mm(x, self.w))

    model = GCN()
    opt = torch.optim.Adam(model.parameters())
    x = torch.randn(n, f)
    for _ in range(4):
        opt.zero_grad()
        model(x, adj).pow(2).mean().backward()
        opt.step()
    stepwatch.shutdown()
    # forward: x @ w and adj @ support; backward: adj^T @ grad and x^T @ grad (x takes no grad)
    want = 2 * (2 * n * f * h) + 2 * (2 * nnz * h)
    assert [r.flops for r in mem.records if not r.tail] == [want] * 4, (want, 2 * (2 * n * f * h + 2 * n * n * h))


def test_a_global_full_backward_hook_of_the_jobs_gets_no_warning_from_the_replay():
    """``register_module_full_backward_hook`` in the job: torch warned "For backward hooks to be
    called, module output should be a Tensor ... received <class 'NoneType'>" at each replay (the
    replay's own wrapper module returned None), a warning the job without stepwatch never shows."""
    import warnings

    from torch.nn.modules.module import register_module_full_backward_hook

    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    handle = register_module_full_backward_hook(lambda m, gi, go: None)
    try:
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            c = count_step_flops(model, (torch.randn(8, 16, requires_grad=True),))
    finally:
        handle.remove()
    assert c.forward == {"fp32": mm(8, 16, 32) + mm(8, 32, 4)}
    assert not [str(w.message) for w in got if "backward hooks" in str(w.message)], [str(w.message) for w in got]


def test_the_replay_inside_the_jobs_own_profiler_is_one_range_that_says_whose_it_is():
    """The job's ``torch.profiler`` saw the replay's fake forward and backward as the job's work
    (523 events where the step has 34, addmm three times over). torch has no way to keep them
    out; they come inside one range that names them stepwatch's."""
    from torch.profiler import profile

    model, x = nn.Linear(4, 4), torch.randn(2, 4)
    with profile() as prof:
        count_step_flops(model, (x,))
    events = prof.events()
    (rng,) = [e for e in events if e.name == fl.REPLAY_RANGE]
    ops = [e for e in events if e.name.startswith("aten::")]
    assert ops and all(rng.time_range.start <= e.time_range.start and e.time_range.end <= rng.time_range.end
                       for e in ops), [e.name for e in ops]

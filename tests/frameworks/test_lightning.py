"""Lightning ``Trainer`` (automatic optimization: ``optimizer.step(closure)``, gradient
accumulation, gradient clipping) with stepwatch, on CPU, against the framework's own numbers.

Proves the Lightning row of docs/frameworks.md. Nothing is mocked.
"""

import json
import os
import statistics

import pytest
import torch

import stepwatch
from fw_common import (
    identity_holds,
    no_internal_errors,
    plain_loop_flops,
    batch_of,
    make_model,
    read_jsonl,
    start,
    torchrun,
)
from lit_common import ACCUM, BS, LR, STEPS, fit

HERE = os.path.dirname(os.path.abspath(__file__))
SLEEP = 0.03  # seconds slept in each forward (a Sleep module inside the model)


def _stepwatch_callbacks(trainer):
    from stepwatch.integrations._lightning_base import CallbackMixin

    return [c for c in trainer.callbacks if isinstance(c, CallbackMixin)]


def check_records_match(recs, lit, ref_flops):
    """What the callback adds (forward time, FLOPs, tokens, loss, lr) and what the core hooks give."""
    # One record per optimizer step (not per micro-batch), numbered like trainer.global_step.
    assert [r.step for r in recs] == list(range(STEPS))
    for i, r in enumerate(recs):
        assert identity_holds(r), r
        assert not r.skipped
        # The closure's forward and backward run inside optimizer.step(): they are counted in
        # forward_s/backward_s, and not again in optimizer_s.
        assert r.forward_s >= ACCUM * SLEEP * 0.95, r
        assert r.backward_s > 0
        assert r.optimizer_s < SLEEP or i == 0, r  # step 0: the optimizer's one-off state set-up
        assert r.data_wait_s > 0
        micro = slice(i * ACCUM, (i + 1) * ACCUM)
        assert r.tokens == sum(lit.tokens[micro])
        assert r.flops == pytest.approx(ACCUM * ref_flops, rel=0.02)
        # Lightning's own grad norm (before its clipping at 0.5): the clip's norm, reused.
        assert r.grad_norm == pytest.approx(lit.norms[i], rel=1e-5)
        assert r.scalars["loss"] == pytest.approx(sum(lit.losses[micro]) / ACCUM, rel=1e-6)
        assert r.scalars["lr"] == LR
    assert statistics.median(r.optimizer_s for r in recs) < SLEEP / 2


def test_lightning_records_match_what_lightning_did(tmp_path):
    """The callback passed by hand; the automatic one (entry point) stands down for it."""
    from stepwatch.integrations.lightning import StepwatchCallback

    ref_flops = plain_loop_flops(tmp_path, make_model(), batch_of(range(BS)))
    mem = start(tmp_path, "on")
    mine = StepwatchCallback()
    lit, trainer = fit([mine], sleep_s=SLEEP)
    stepwatch.shutdown()
    no_internal_errors(mem)
    assert trainer.global_step == STEPS
    check_records_match(mem.records, lit, ref_flops)
    auto = [c for c in _stepwatch_callbacks(trainer) if c is not mine]
    assert len(auto) == 1 and auto[0].automatic and not auto[0].active and mine.active
    # Same losses, bit for bit, with stepwatch off.
    lit_off, _ = fit([], sleep_s=SLEEP)
    assert lit_off.losses == lit.losses


def test_lightning_one_line_import_adds_the_callback(tmp_path):
    """With a session running, every Trainer gets the callback through Lightning's
    callbacks_factory entry point: the same records as with the callback passed by hand."""
    ref_flops = plain_loop_flops(tmp_path, make_model(), batch_of(range(BS)))
    mem = start(tmp_path, "on")
    lit, trainer = fit([], sleep_s=SLEEP)
    stepwatch.shutdown()
    no_internal_errors(mem)
    (cb,) = _stepwatch_callbacks(trainer)
    assert cb.automatic and cb.active
    check_records_match(mem.records, lit, ref_flops)


@pytest.mark.parametrize("by_hand", [False, True], ids=["automatic", "by hand"])
def test_standalone_pytorch_lightning_gets_its_own_callback(tmp_path, by_hand):
    """``import pytorch_lightning as pl``: its Trainer reads the ``pytorch_lightning.callbacks_factory``
    group and takes only its own Callback class. The one-line import adds a callback built on it,
    with the same records as under ``lightning.pytorch``; one passed by hand wins."""
    pytest.importorskip("pytorch_lightning")
    from pytorch_lightning.callbacks import Callback as PLCallback

    from stepwatch.integrations.pytorch_lightning import StepwatchCallback

    ref_flops = plain_loop_flops(tmp_path, make_model(), batch_of(range(BS)))
    mem = start(tmp_path, "on")
    mine = [StepwatchCallback()] if by_hand else []
    lit, trainer = fit(list(mine), sleep_s=SLEEP, pkg="pytorch_lightning")  # a copy: the Trainer extends it
    stepwatch.shutdown()
    no_internal_errors(mem)
    cbs = _stepwatch_callbacks(trainer)
    auto = [c for c in cbs if c.automatic]
    assert len(auto) == 1 and isinstance(auto[0], StepwatchCallback) and isinstance(auto[0], PLCallback)
    assert len(cbs) == 1 + by_hand and auto[0].active is not by_hand and all(c.active for c in mine)
    check_records_match(mem.records, lit, ref_flops)


def test_lightning_adapter_serves_the_standalone_package_when_it_is_the_only_one(tmp_path):
    """Without ``lightning`` (blocked here in a fresh interpreter), ``stepwatch.integrations.lightning``
    hands out the ``pytorch_lightning`` adapter's callback: the one its Trainer accepts."""
    import subprocess
    import sys

    pytest.importorskip("pytorch_lightning")
    code = (
        "import sys; sys.modules['lightning'] = None\n"
        "from stepwatch.integrations import lightning, pytorch_lightning\n"
        "from pytorch_lightning.callbacks import Callback\n"
        "assert lightning.StepwatchCallback is pytorch_lightning.StepwatchCallback\n"
        "assert issubclass(lightning.StepwatchCallback, Callback)\n"
        "assert lightning.callbacks_factory is pytorch_lightning.callbacks_factory\n"
        "print('ok')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


def test_lightning_without_any_session_gets_no_callback():
    assert stepwatch.get_session() is None
    _, trainer = fit([], steps=1)
    assert _stepwatch_callbacks(trainer) == []


def test_lightning_without_the_callback(tmp_path):
    """STEPWATCH_LIGHTNING_CALLBACK=0 and no callback: step boundaries, the optimizer phase and
    the grad norm are still right (they come from the core hooks). Lightning calls
    ``training_step``, never the LightningModule: forward time, FLOPs and tokens are unknown
    (null, never wrong) until a step with a backward and no root forward has the LightningModule's
    submodules hooked (hooks/install.py ``_UnseenForward``), as the callback declares them; from
    the step after, they are the callback's (see docs/frameworks.md). Until the thirty-eighth
    session they stayed null for the whole run."""
    ref_flops = plain_loop_flops(tmp_path, make_model(), batch_of(range(BS)))
    mem = start(tmp_path, "on", lightning_callback=False)
    lit, trainer = fit([], sleep_s=SLEEP)
    stepwatch.shutdown()
    no_internal_errors(mem)
    assert _stepwatch_callbacks(trainer) == []
    recs = mem.records
    assert [r.step for r in recs] == list(range(STEPS))
    # Step 0 is not judged; step 1's end hooks the submodules, before step 2's first fetch.
    for i, r in enumerate(recs):
        assert identity_holds(r), r
        assert r.optimizer_s < SLEEP or i == 0, r
        assert r.grad_norm == pytest.approx(lit.norms[i], rel=1e-5)
        assert "loss" not in r.scalars
        micro = slice(i * ACCUM, (i + 1) * ACCUM)
        if i < 2:
            assert r.flops is None and r.tokens is None and r.forward_s == 0, r
        else:
            assert r.forward_s >= ACCUM * SLEEP * 0.95, r
            assert r.tokens == sum(lit.tokens[micro])
            assert r.flops == pytest.approx(ACCUM * ref_flops, rel=0.02)


@pytest.mark.integration
@pytest.mark.parametrize("callback", ["by hand", "automatic"])
def test_lightning_ddp_two_ranks_gloo(tmp_path, callback):
    """The callback passed by hand, or added by the entry point to a script that has only the
    one-line import: under DDP the wrappers are declared not-the-model either way."""
    ref_flops = plain_loop_flops(tmp_path, make_model(), batch_of(range(BS)))
    job = os.path.join(HERE, "lightning_ddp_job.py")
    run = tmp_path / "run"
    env = {"STEPWATCH_DIR": str(run), "STEPWATCH_WATCHDOG": "off", "STEPWATCH_CAPTURE": "off"}
    # One launch, stepwatch on (bit-identical losses with DDP are proven by the single-process test
    # above and by tests/integration/test_ddp_job.py; a second launch costs ~15 s on 2 cores).
    torchrun(job, [str(tmp_path / "on")] + (["--no-callback"] if callback == "automatic" else []), env, cwd=tmp_path)
    for rank in (0, 1):
        on = json.loads((tmp_path / f"on.rank{rank}.json").read_text())
        recs = read_jsonl(run / f"steps.rank{rank}.jsonl")
        assert [r["step"] for r in recs] == list(range(STEPS)) and on["steps"] == STEPS
        findings = read_jsonl(run / f"findings.rank{rank}.jsonl") if (run / f"findings.rank{rank}.jsonl").exists() else []
        assert not [f for f in findings if f["kind"] == "internal_error"], findings
        for i, r in enumerate(recs):
            assert r["rank"] == rank
            micro = slice(i * ACCUM, (i + 1) * ACCUM)
            assert r["tokens"] == sum(on["tokens"][micro])
            assert r["flops"] == pytest.approx(ACCUM * ref_flops, rel=0.02)
            # DDP averaged the grads before Lightning read them: the same norm on both ranks.
            assert r["grad_norm"] == pytest.approx(on["norms"][i], rel=1e-5)
            # DDP's AllReduce, timed through its comm hook (once per step: no_sync on micro-steps).
            assert r["comm_s"] is not None and r["comm_s"] > 0
            assert r["allreduce_s"] is not None and r["allreduce_s"] > 0
            assert r["forward_s"] > 0 and r["backward_s"] > 0


@pytest.mark.integration
def test_lightning_ddp_one_line_import_without_callback_trains_safely(tmp_path):
    """The one-line import under Lightning DDP with the automatic callback turned off
    (STEPWATCH_LIGHTNING_CALLBACK=0): Lightning calls its DDP wrapper with training_step as
    forward, which stepwatch refuses to replay for FLOPs (a replay on fake tensors could leak fakes
    into Lightning's logging state; a crash of that kind was seen once during development). The
    job trains to the end; steps and grad norms still come out."""
    ref_flops = plain_loop_flops(tmp_path, make_model(), batch_of(range(BS)))
    job = os.path.join(HERE, "lightning_ddp_job.py")
    run = tmp_path / "run"
    env = {"STEPWATCH_DIR": str(run), "STEPWATCH_WATCHDOG": "off", "STEPWATCH_CAPTURE": "off",
           "STEPWATCH_LIGHTNING_CALLBACK": "0"}
    torchrun(job, [str(tmp_path / "nocb"), "--no-callback"], env, cwd=tmp_path)
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"nocb.rank{rank}.json").read_text())
        recs = read_jsonl(run / f"steps.rank{rank}.jsonl")
        assert [r["step"] for r in recs] == list(range(STEPS)) and seen["steps"] == STEPS
        assert all(v == v for v in seen["losses"])  # finite, real losses
        for i, r in enumerate(recs):
            assert r["grad_norm"] == pytest.approx(seen["norms"][i], rel=1e-5)
            # The wrapper is not a model forward: unknown, never a wrong number. (Roots are also
            # found when the optimizer is built, before Lightning wraps the module: then the
            # LightningModule's own forward is counted, and that number is right.)
            assert r["flops"] is None or r["flops"] == pytest.approx(ACCUM * ref_flops, rel=0.02)


def test_callback_starts_stepwatch_when_none_runs(tmp_path):
    """``ddp_spawn`` workers never run the script's import: the callback starts the session."""
    from stepwatch.integrations.lightning import StepwatchCallback

    assert stepwatch.get_session() is None
    mem = stepwatch.InMemoryExporter()
    cb = StepwatchCallback(dir=str(tmp_path / "cb"), console="off", exporters=[mem], watchdog="off", capture="off")
    fit([cb], steps=2)
    assert stepwatch.get_session() is not None
    stepwatch.shutdown()
    assert [r.step for r in mem.records] == [0, 1]
    assert all(r.flops and r.tokens for r in mem.records)


def _fabric_loop(steps=4):
    """A Lightning Fabric loop as its docs write one: ``fabric.setup``, ``fabric.backward``,
    ``fabric.clip_gradients``. Returns (losses, pre-clip norms, final parameters)."""
    import torch.nn.functional as F
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    model, opt = fabric.setup(model, opt)
    g = torch.Generator().manual_seed(1)
    losses, norms = [], []
    for _ in range(steps):
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
        loss = F.cross_entropy(model(x), y)
        fabric.backward(loss)
        norms.append(fabric.clip_gradients(model, opt, max_norm=0.5).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())  # raised with stepwatch on until the thirty-first session
    return losses, norms, [p.detach().clone() for p in opt.param_groups[0]["params"]]


def test_fabric_loop_trains_as_without_stepwatch(tmp_path):
    """Fabric's ``_FabricModule`` holds the model twice (``_forward_module``, ``_original_module``):
    the FLOP replay left FakeTensors in the model, and the first ``loss.item()`` raised
    DataDependentOutputException (every Fabric loop, 1 or 2 processes)."""
    mem = start(tmp_path, "on")
    losses, norms, params = _fabric_loop()
    stepwatch.shutdown()
    no_internal_errors(mem)
    recs = mem.records
    assert [r.step for r in recs] == [0, 1, 2, 3]
    assert [r.grad_norm for r in recs] == pytest.approx(norms, rel=1e-5)
    assert all(r.flops == recs[0].flops and r.flops > 0 for r in recs)
    losses_off, _, params_off = _fabric_loop()
    assert losses == losses_off
    assert all(torch.equal(a, b) for a, b in zip(params, params_off))

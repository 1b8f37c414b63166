"""``accelerate`` in a user's loop: ``accelerator.accumulate(model)`` (its optimizer wrapper calls the
real ``optimizer.step()`` only on sync steps), ``accelerator.backward``, ``accelerator.clip_grad_norm_``.

Anchors (issue 10): throughput tools have divided by the accumulation factor, or counted micro-steps
as steps. Here one record covers all ACCUM micro-batches: their tokens, their FLOPs.
Proves the accelerate row of docs/frameworks.md. Nothing is mocked.
"""

import pytest
import torch
from torch.utils.data import DataLoader

import stepwatch
from fw_common import TokenData, batch_of, identity_holds, make_model, no_internal_errors, plain_loop_flops, start, tokens_of

STEPS, ACCUM, BS = 5, 4, 4


def _train():
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    set_seed(0)
    acc = Accelerator(gradient_accumulation_steps=ACCUM, cpu=True)
    model = make_model(dropout=0.1)  # dropout: the RNG stream must be untouched by stepwatch
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = DataLoader(TokenData(STEPS * ACCUM * BS), batch_size=BS)
    model, opt, loader = acc.prepare(model, opt, loader)
    losses, norms = [], []
    for batch in loader:
        with acc.accumulate(model):
            loss = model(**batch)["loss"]
            acc.backward(loss)
            if acc.sync_gradients:
                norms.append(float(acc.clip_grad_norm_(model.parameters(), 0.5)))
            opt.step()  # accelerate's wrapper: a no-op on micro-steps
            opt.zero_grad()
            losses.append(loss.item())
    return losses, norms


def test_accelerate_gradient_accumulation(tmp_path):
    ref_flops = plain_loop_flops(tmp_path, make_model(), batch_of(range(BS)))
    mem = start(tmp_path, "on")
    losses, norms = _train()
    stepwatch.shutdown()
    no_internal_errors(mem)
    recs = mem.records
    assert len(norms) == STEPS
    assert [r.step for r in recs] == list(range(STEPS))
    for i, r in enumerate(recs):
        assert identity_holds(r), r
        assert r.forward_s > 0 and r.backward_s > 0 and r.optimizer_s > 0 and r.data_wait_s > 0
        samples = range(i * ACCUM * BS, (i + 1) * ACCUM * BS)
        assert r.tokens == tokens_of(samples)  # all micro-batches, not divided by ACCUM
        assert r.samples == ACCUM * BS
        assert r.flops == pytest.approx(ACCUM * ref_flops, rel=0.02)
        assert r.grad_norm == norms[i]  # accelerate's clip_grad_norm_ result, reused
    losses_off, norms_off = _train()
    assert (losses_off, norms_off) == (losses, norms)

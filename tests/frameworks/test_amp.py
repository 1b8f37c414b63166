"""AMP in a plain loop: ``torch.autocast`` (fp16 on CPU) with ``torch.amp.GradScaler``, including a
step the scaler skips (non-finite gradients). Proves the AMP row of docs/frameworks.md.

Nothing is mocked; the overflow is real (the loss of one step is multiplied by inf).
"""

import math

import pytest
import torch
from torch.utils.data import DataLoader

import stepwatch
from fw_common import TokenData, batch_of, identity_holds, make_model, no_internal_errors, plain_loop_flops, start, tokens_of

STEPS, BS, SKIP = 6, 4, 3


def _train():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    losses, norms, scales = [], [], []
    for i, batch in enumerate(DataLoader(TokenData(STEPS * BS), batch_size=BS)):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(**batch)["loss"]
        scaled = scaler.scale(loss * (math.inf if i == SKIP else 1.0))
        scaled.backward()
        scaler.unscale_(opt)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        losses.append(loss.item())
        scales.append(scaler.get_scale())
    return losses, norms, scales


def test_amp_gradscaler_steps_and_skips(tmp_path):
    ref_flops = plain_loop_flops(tmp_path, make_model(), batch_of(range(BS)))
    mem = start(tmp_path, "on")
    losses, norms, scales = _train()
    stepwatch.shutdown()
    no_internal_errors(mem)
    recs = mem.records
    assert scales[SKIP] == scales[SKIP - 1] / 2  # the scaler did skip that step
    assert [r.step for r in recs] == list(range(STEPS))
    for i, r in enumerate(recs):
        assert identity_holds(r), r
        assert r.skipped == (i == SKIP)
        assert r.tokens == tokens_of(range(i * BS, (i + 1) * BS))
        # The same matmuls as in fp32; only their dtype differs.
        assert r.flops == pytest.approx(ref_flops, rel=0.02)
        if i == SKIP:
            assert not math.isfinite(r.grad_norm)
        else:
            assert r.grad_norm == norms[i]  # the unscaled, pre-clip norm clip_grad_norm_ returned
            assert r.optimizer_s > 0
    losses_off, norms_off, _ = _train()
    assert losses_off == losses
    assert norms_off[:SKIP] == norms[:SKIP] and norms_off[SKIP + 1 :] == norms[SKIP + 1 :]

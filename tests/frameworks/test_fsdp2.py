"""FSDP2 (``torch.distributed.fsdp.fully_shard``) in a plain loop, 2 gloo ranks on CPU, with the
one-line import: records per optimizer step, sharded grad-norm equal to ``clip_grad_norm_``'s,
FSDP's all-gather/reduce-scatter time, tokens and FLOPs per rank, and identical losses with
stepwatch off. Proves the FSDP2 row of docs/frameworks.md. Nothing is mocked.
"""

import json
import os

import pytest

from fw_common import batch_of, make_model, plain_loop_flops, read_jsonl, torchrun

pytestmark = pytest.mark.integration
HERE = os.path.dirname(os.path.abspath(__file__))
STEPS, ACCUM, BS = 4, 2, 4  # as in fsdp2_job.py


@pytest.mark.parametrize("blocks", ["resharded", "kept"])
def test_fsdp2_two_ranks_gloo(tmp_path, blocks):
    """``kept``: the blocks' ``reshard_after_forward=False``. Their modules hold the unsharded
    parameters at the first backward, where stepwatch looks for an optimizer of the model's
    parameters; until the thirty-first session it found none, each backward ended a step, and
    step 0 was two records of one micro-batch each."""
    ref_flops = plain_loop_flops(tmp_path, make_model(), batch_of(range(BS)))
    job = os.path.join(HERE, "fsdp2_job.py")
    run = tmp_path / "run"
    env = {"STEPWATCH_DIR": str(run), "STEPWATCH_WATCHDOG": "off", "STEPWATCH_CAPTURE": "off"}
    torchrun(job, [str(tmp_path / "out"), blocks], env, cwd=tmp_path)
    for rank in (0, 1):
        both = json.loads((tmp_path / f"out.rank{rank}.json").read_text())
        on = both["on"]
        assert on == both["off"], f"rank {rank}: losses/norms differ with stepwatch on"
        recs = read_jsonl(run / f"steps.rank{rank}.jsonl")
        assert [r["step"] for r in recs] == list(range(STEPS))
        fpath = run / f"findings.rank{rank}.jsonl"
        findings = read_jsonl(fpath) if fpath.exists() else []
        assert not [f for f in findings if f["kind"] == "internal_error"], findings
        for i, r in enumerate(recs):
            micro = slice(i * ACCUM, (i + 1) * ACCUM)
            assert r["tokens"] == sum(on["tokens"][micro])
            assert r["flops"] == pytest.approx(ACCUM * ref_flops, rel=0.02)
            # Sharded grads: each rank's sum of squares, combined through the c10d store.
            assert r["grad_norm"] == pytest.approx(on["norms"][i], rel=1e-5)
            # FSDP2's all-gathers and reduce-scatters (wrapped functions; no exposure: docs/comm.md).
            assert r["comm_s"] is not None and r["comm_s"] > 0
            assert r["forward_s"] > 0 and r["backward_s"] > 0 and r["optimizer_s"] > 0

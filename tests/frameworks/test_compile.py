"""``torch.compile`` in a plain loop (the wrapper ``torch.compile(model)``, and ``model.compile()`` in
place): records, FLOPs (counted
eagerly on fake tensors, through ``_orig_mod``), tokens and grad-norm, and no graph break or extra
graph from stepwatch. Proves the torch.compile row of docs/frameworks.md.

The ``aot_eager`` backend is used: dynamo and AOTAutograd run exactly as with inductor, without
minutes of C++ compilation on the CPU runners (inductor's code generation is not what stepwatch
touches). Nothing is mocked.
"""

import pytest
import torch
from torch.utils.data import DataLoader

import stepwatch
from fw_common import TokenData, batch_of, identity_holds, make_model, no_internal_errors, plain_loop_flops, start, tokens_of

STEPS, BS = 6, 4


def _train(how):
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    # Fetched before the model exists (the first fetch's scan is done with): the loop then has
    # no scan between the compile and the first forward, as nanoGPT's get_batch loop has none.
    batches = list(DataLoader(TokenData(STEPS * BS), batch_size=BS))
    if how == "wrapper":
        model = torch.compile(make_model(), backend="aot_eager")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    elif how == "wrapper_after_optimizer":  # nanoGPT's order: the optimizer's scan hooked the model first
        model = make_model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model = torch.compile(model, backend="aot_eager")
    else:
        model = make_model()
        model.compile(backend="aot_eager")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, norms = [], []
    for batch in batches:
        loss = model(**batch)["loss"]
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    graphs = (dict(counters["graph_break"]), counters["stats"]["unique_graphs"])
    return losses, norms, graphs


# wrapper_after_optimizer: the model was hooked when its optimizer was built, then wrapped; dynamo
# traced into stepwatch's root call (3 graph breaks, the FLOP/token observer compiled and failed:
# samples, tokens and FLOPs null all run, and with inductor and dropout another training result).
@pytest.mark.parametrize("how", ["wrapper", "wrapper_after_optimizer", "in_place"])
def test_compiled_model(tmp_path, how):
    ref_flops = plain_loop_flops(tmp_path, make_model(), batch_of(range(BS)))
    mem = start(tmp_path, "on")
    losses, norms, graphs = _train(how)
    stepwatch.shutdown()
    no_internal_errors(mem)
    recs = mem.records
    assert [r.step for r in recs] == list(range(STEPS))
    for i, r in enumerate(recs):
        assert identity_holds(r), r
        assert r.forward_s > 0 and r.backward_s > 0 and r.optimizer_s > 0
        assert r.tokens == tokens_of(range(i * BS, (i + 1) * BS))
        assert r.flops == pytest.approx(ref_flops, rel=0.02)
        assert r.grad_norm == norms[i]
    losses_off, norms_off, graphs_off = _train(how)
    assert (losses_off, norms_off) == (losses, norms)
    # stepwatch adds no graph break and no graph (no recompilation).
    assert graphs == graphs_off and graphs[0] == {}, (graphs, graphs_off)

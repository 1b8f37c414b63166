"""Step accounting on the loop shapes real scripts use (issue 15), each with a small stand-in
written here: a Dataset with an nn.Module transform, a loop without a torch optimizer,
accumulation without a DataLoader, eval and a checkpoint after the last step, seq-first inputs.
The phase identity must hold on every record of every one of them."""

import io
import json
import os
import statistics
import time

import pytest
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset

from test_phase_faults import step_or_fail  # one iteration that may raise in opt.step()

pytestmark = pytest.mark.usefixtures("both_tracker_cores")  # tests/conftest.py


def _identity_holds(r, tol=1e-6):
    parts = r.data_wait_s + r.forward_s + r.backward_s + r.optimizer_s + r.other_s
    return abs(parts - r.step_s) <= tol


def _all_identity(recs):
    bad = [r for r in recs if not _identity_holds(r)]
    assert not bad, bad[:3]


class Normalize(nn.Module):
    """Stand-in for torchvision.transforms.Normalize: an nn.Module called in __getitem__."""

    def __init__(self, mean, std):
        super().__init__()
        self.mean, self.std = mean, std

    def forward(self, x):
        time.sleep(0.002)  # a transform doing real work (decode, resize): 2 ms per sample
        return (x - self.mean) / self.std


class TransformData(Dataset):
    def __init__(self, n):
        self.n = n
        self.transform = Normalize(0.5, 0.25)

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return self.transform(torch.rand(16, generator=g)), torch.randn(4, generator=g)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def test_dataset_transform_module_is_data_loading_not_forward(sw):
    stepwatch, mem, start = sw
    start()
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    for x, y in DataLoader(TransformData(24), batch_size=4):
        nn.functional.mse_loss(m(x), y).backward()
        opt.step()
        opt.zero_grad()
    stepwatch.shutdown()
    recs = mem.records
    assert len(recs) == 6
    _all_identity(recs)
    for r in recs[1:]:
        # 4 samples x 2 ms of transform are data wait, and not forward time as well.
        assert r.data_wait_s >= 0.008 * 0.9
        assert r.data_wait_s + r.forward_s <= r.step_s + 1e-6, r  # counted once, not twice
        assert r.samples == 4  # the model's batch, not the transform's input


def test_loop_without_optimizer_gets_one_step_per_backward(sw, tmp_path):
    """word_language_model's default loop: p.data.add_(p.grad, alpha=-lr), no torch optimizer."""
    stepwatch, mem, start = sw
    start(dir=str(tmp_path / "run"))
    m = _model()
    for i in range(6):
        x = torch.randn(4, 16)
        m.zero_grad()
        m(x).pow(2).mean().backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 0.25)
        for p in m.parameters():
            p.data.add_(p.grad, alpha=-0.1)
    stepwatch.shutdown()
    recs = mem.records
    assert [r.step for r in recs] == list(range(6))
    _all_identity(recs)
    assert all(r.backward_s > 0 and r.optimizer_s == 0 for r in recs)
    # No DataLoader and no optimizer: roots are found at the first backward, so step 0's
    # forward is in its other_s (README); from step 1 on it is forward_s.
    assert all(r.forward_s > 0 for r in recs[1:])
    manifest = json.loads((tmp_path / "run" / "run.json").read_text())
    assert manifest["features"]["step_boundary"] == "backward"


def _norm_of(m):
    """The grads' global L2 norm, as the script would compute it (before its clip)."""
    return torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in m.parameters() if p.grad is not None])).item()


def test_loop_without_optimizer_has_the_pre_clip_grad_norm(sw, tmp_path):
    """word_language_model's loop: backward, clip_grad_norm_, a manual update, no torch optimizer.
    Each record's grad_norm is the norm the backward left, before the clip (until the thirty-first
    session it was null: the norm was taken only at an optimizer step)."""
    stepwatch, mem, start = sw
    start(dir=str(tmp_path / "run"))
    m = _model()
    want = []
    for i in range(6):
        m.zero_grad()
        (m(torch.randn(4, 16)).pow(2).mean() * (i + 1)).backward()
        want.append(_norm_of(m))
        got = torch.nn.utils.clip_grad_norm_(m.parameters(), 0.25)
        assert got.item() == pytest.approx(want[-1], rel=1e-5)
        for p in m.parameters():
            p.data.add_(p.grad, alpha=-0.1)
    stepwatch.shutdown()
    recs = mem.records
    assert [r.step for r in recs] == list(range(6))
    assert [r.grad_norm for r in recs] == pytest.approx(want, rel=1e-5)


def test_another_models_stale_grads_are_not_in_a_manual_loops_norm(sw, tmp_path):
    """A second model alive with grads of its own from before (a teacher backpropagated once, an
    earlier model): the manual loop's norm is its own model's, the grads its backwards wrote."""
    stepwatch, mem, start = sw
    start(dir=str(tmp_path / "run"))
    other = _model()
    m = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 2))
    other(torch.randn(4, 16)).sum().backward()  # grads that stay, untouched from here on
    want = []
    for i in range(4):
        m.zero_grad()
        m(torch.randn(4, 16)).pow(2).mean().backward()
        want.append(_norm_of(m))
        with torch.no_grad():
            for p in m.parameters():
                p -= 0.1 * p.grad
    stepwatch.shutdown()
    got = [r.grad_norm for r in mem.records if not r.tail]
    assert got[-4:] == pytest.approx(want, rel=1e-5)


def _marked_steps_have_norms(sw, tmp_path, iterate, steps=4):
    """``steps`` iterations of ``iterate(model)``, which returns the norm of the grads its update
    used, each ended by ``stepwatch.step()`` (explicit from the first step: before its first call,
    each backward of a loop without an optimizer ends a step): each record's grad_norm is it."""
    stepwatch, mem, start = sw
    start(dir=str(tmp_path / "run"), step_boundary="explicit")
    m = _model()
    want = []
    for _ in range(steps):
        want.append(iterate(m))
        stepwatch.step()
    stepwatch.shutdown()
    assert len(mem.records) == steps
    assert [r.grad_norm for r in mem.records] == pytest.approx(want, rel=1e-5)


def test_explicit_steps_without_optimizer_have_the_accumulated_grad_norm(sw, tmp_path):
    """A manual SGD loop with accumulation (two backwards a step): the norm of the grads the
    update uses, those the last backward left."""

    def iterate(m):
        for _ in range(2):
            m(torch.randn(4, 16)).pow(2).mean().backward()
        norm = _norm_of(m)
        with torch.no_grad():
            for p in m.parameters():
                p -= 0.05 * p.grad
                p.grad = None
        return norm

    _marked_steps_have_norms(sw, tmp_path, iterate)


def test_an_optimizer_made_after_the_first_backward_counts_its_grads_once(sw, tmp_path):
    """The optimizer is built lazily, after the first backward: that backward was probed as a
    loop without an optimizer, and the optimizer's probe of the same grads in the same step must
    not add to it (sqrt(2) times the norm)."""
    opts = []

    def iterate(m):
        m(torch.randn(4, 16)).pow(2).mean().backward()
        norm = _norm_of(m)
        if not opts:
            opts.append(torch.optim.SGD(m.parameters(), lr=0.01))
        opts[0].step()
        opts[0].zero_grad()
        return norm

    _marked_steps_have_norms(sw, tmp_path, iterate)


def test_one_optimizer_stepping_twice_in_a_marked_step_has_its_last_norm(sw, tmp_path):
    """Two updates of one optimizer inside one ``stepwatch.step()`` (two probes in one record,
    both on the C core's path from the second step on): the last probe's norm."""
    opts = []

    def iterate(m):
        if not opts:
            opts.append(torch.optim.SGD(m.parameters(), lr=0.01))
        for _ in range(2):
            m(torch.randn(4, 16)).pow(2).mean().backward()
            norm = _norm_of(m)
            opts[0].step()
            opts[0].zero_grad()
        return norm

    _marked_steps_have_norms(sw, tmp_path, iterate)


def test_an_earlier_models_uncollected_optimizer_does_not_take_a_manual_loops_steps(sw, tmp_path):
    """An earlier model and its optimizer, garbage a reference cycle still holds (a traceback kept
    them in the test before this one): the first backward's scan found an optimizer of a hooked
    root, and the loop without an optimizer had no step at all."""
    import gc

    class Holder:
        pass

    gc.disable()  # the garbage stays until stepwatch looks, as a cycle waits for a collection
    try:
        h = Holder()
        h.self = h
        h.model = _model()
        h.opt = torch.optim.SGD(h.model.parameters(), lr=0.1)
        del h
        stepwatch, mem, start = sw
        start(dir=str(tmp_path / "run"))
        m = _model()
        for i in range(3):
            m.zero_grad()
            m(torch.randn(4, 16)).pow(2).mean().backward()
            for p in m.parameters():
                p.data.add_(p.grad, alpha=-0.1)
        stepwatch.shutdown()
    finally:
        gc.enable()
    assert [r.step for r in mem.records] == [0, 1, 2]


def test_optimizer_loop_says_optimizer_boundary(sw, tmp_path):
    stepwatch, mem, start = sw
    start(dir=str(tmp_path / "run"))
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    for i in range(3):
        for _ in range(2):  # accumulation: the backward alone must not end a step
            m(torch.randn(4, 16)).sum().backward()
        opt.step()
        opt.zero_grad()
    stepwatch.shutdown()
    assert len(mem.records) == 3
    manifest = json.loads((tmp_path / "run" / "run.json").read_text())
    assert manifest["features"]["step_boundary"] == "optimizer"


def _accumulate(m, opt, steps=3, micro=4):
    """Gradient accumulation without a DataLoader: ``micro`` batches of 8 samples a step."""
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        for _ in range(micro):
            (m(torch.randn(8, 16, generator=g)).sum() / micro).backward()
        opt.step()
        opt.zero_grad()


def _every_micro_batch_counted(recs):
    assert len(recs) == 3
    _all_identity(recs)
    assert all(r.forward_s > 0 for r in recs)
    assert [r.samples for r in recs] == [32, 32, 32]
    assert recs[0].flops == recs[1].flops and recs[0].flops > 0


@pytest.mark.parametrize("built", ["after init", "before init"])
def test_accumulation_without_dataloader_counts_every_micro_batch_of_step_0(sw, built):
    """Before init: the model and its optimizer exist before ``stepwatch.init()``, and no
    DataLoader fetch comes before the first forward; the roots are found at init (the first
    backward was too late for step 0's first micro-batch)."""
    _accumulate_from_step_0(sw, built)


def _accumulate_from_step_0(sw, built, wrap=lambda m: m):
    """Three steps of accumulation, the model and its optimizer built before or after
    ``stepwatch.init()``; ``wrap`` the model after its optimizer was made; every micro-batch
    counted."""
    stepwatch, mem, start = sw
    if built == "after init":
        start()
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    if built == "before init":
        start()
    _accumulate(wrap(m), opt)
    stepwatch.shutdown()
    _every_micro_batch_counted(mem.records)


def test_eval_and_checkpoint_after_the_last_step_are_recorded(sw):
    stepwatch, mem, start = sw
    start()
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    for _ in range(3):
        m(torch.randn(4, 16)).sum().backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        for _ in range(5):
            m(torch.randn(4, 16))
            time.sleep(0.01)
    torch.save(m.state_dict(), io.BytesIO())
    stepwatch.shutdown()
    recs = mem.records
    steps = [r for r in recs if not r.tail]
    assert len(steps) == 3
    tail = recs[-1]
    assert tail.tail and tail.step == 3
    assert tail.eval_s >= 0.04 * 0.9
    assert tail.checkpoint_s > 0 and tail.checkpoint_bytes and tail.checkpoint_bytes > 100
    assert tail.step_s == 0 and tail.forward_s == 0 and tail.other_s == 0
    _all_identity(recs)


def test_an_evaluation_after_the_last_step_ends_at_its_last_call_not_at_shutdown(sw, both_tracker_cores):
    """A final validation, then the script's other work before it ends (plots, an upload,
    ``wandb.finish()``, the loader's workers shutting down): the evaluation's span ran to
    shutdown, so a 40 ms validation read ``eval_s`` 1.5 s in the tail record (and the report's
    eval total). It ends at its last call or fetch now; the metric work between its calls and
    fetches stays its own."""
    stepwatch, mem, start = sw
    start()
    torch.manual_seed(0)
    model = _Slow(10)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(3):
        model(torch.randn(4, 16)).sum().backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    batches = DataLoader(torch.randn(16, 16), batch_size=4)
    with torch.no_grad():
        for x in batches:
            model(x)
            time.sleep(0.005)  # the metric over the batch: the evaluation's
    time.sleep(0.5)  # the script's work after it
    stepwatch.shutdown()
    tail = mem.records[-1]
    assert tail.tail and 4 * 0.015 <= tail.eval_s < 0.3, tail  # four 10 ms calls and their metrics
    _all_identity(mem.records)


class SeqFirstLM(nn.Module):
    """word_language_model's RNNModel in small: input [seq, batch] of token ids."""

    def __init__(self, vocab=50, emb=16, hidden=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, emb)
        self.rnn = nn.LSTM(emb, hidden, num_layers=1)  # batch_first=False (torch's default)
        self.out = nn.Linear(hidden, vocab)

    def forward(self, x):
        h, _ = self.rnn(self.emb(x))
        return self.out(h)


def test_seq_first_inputs_count_samples_from_the_batch_dim(sw):
    stepwatch, mem, start = sw
    start()
    torch.manual_seed(0)
    m = SeqFirstLM()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    seq, batch = 35, 4
    for _ in range(3):
        x = torch.randint(0, 50, (seq, batch))
        m(x).sum().backward()
        opt.step()
        opt.zero_grad()
    stepwatch.shutdown()
    recs = mem.records
    _all_identity(recs)
    assert [r.samples for r in recs] == [batch] * 3
    assert [r.tokens for r in recs] == [seq * batch] * 3


class BatchFirstEncoder(nn.Module):
    """A classifier taking ``[batch, seq]`` ids that turns them to ``[seq, batch, emb]`` itself for
    torch's encoder (``batch_first=False``, its default), as many hand-written models do."""

    def __init__(self, vocab=50, emb=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, emb)
        layer = nn.TransformerEncoderLayer(emb, nhead=2, dim_feedforward=32, dropout=0.0)
        self.enc = nn.TransformerEncoder(layer, num_layers=1, enable_nested_tensor=False)
        self.out = nn.Linear(emb, 2)

    def forward(self, ids):
        return self.out(self.enc(self.emb(ids).transpose(0, 1)).mean(0))


class PermutingLSTM(nn.Module):
    """``[batch, seq, features]`` in, permuted for a seq-first LSTM."""

    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(6, 8)
        self.out = nn.Linear(8, 1)

    def forward(self, x):
        h, _ = self.rnn(x.permute(1, 0, 2))
        return self.out(h[-1])


@pytest.mark.parametrize("make, shape", [(BatchFirstEncoder, (4, 10)), (PermutingLSTM, (4, 10, 6))],
                         ids=["encoder-ids", "lstm-features"])
def test_a_batch_first_model_with_seq_first_layers_inside_counts_its_batch(sw, make, shape):
    """A model whose attention or RNN layers are sequence-first but which takes batch-first inputs
    and permutes them itself: ``samples`` was read from dim 1 (the sequence, 10) because every
    such layer in it is seq-first. The layer's own input says where the batch is."""
    stepwatch, mem, start = sw
    start()
    torch.manual_seed(0)
    m = make()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    from torch.nn.modules import module as torch_module

    for _ in range(3):
        x = torch.randint(0, 50, shape) if len(shape) == 2 else torch.randn(shape)
        m(x).sum().backward()
        # What told the layout was there for the first call only, and never on the model
        assert not torch_module._global_forward_pre_hooks and not torch_module._global_forward_hooks
        assert not any(mod._forward_pre_hooks or mod._forward_hooks for mod in m.modules())
        opt.step()
        opt.zero_grad()
    stepwatch.shutdown()
    recs = mem.records
    assert [r.samples for r in recs] == [4] * 3
    assert [r.tokens for r in recs] == ([40] * 3 if len(shape) == 2 else [None] * 3)


class TinyLM(nn.Module):
    """An HF-style model called as model(input_ids=..., attention_mask=...)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(100, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, input_ids, attention_mask):
        return self.head(self.emb(input_ids) * attention_mask.unsqueeze(-1)).mean()


class KeywordInputModel(nn.Module):
    """A Hugging Face-style model whose batch is a keyword argument other than input_ids:
    ``pixel_values`` (ViT, ConvNeXt), ``input_values`` (wav2vec2), ``input_features`` (Whisper),
    ``inputs_embeds`` (any LM fed embeddings), called as ``model(**batch)`` by Trainer and by
    hand-written loops alike."""

    def __init__(self, key):
        super().__init__()
        self.key = key
        self.head = nn.LazyLinear(1)

    def forward(self, labels=None, attention_mask=None, **inputs):
        x = inputs[self.key].flatten(1)
        if attention_mask is not None and self.key == "inputs_embeds":
            x = x * attention_mask.repeat_interleave(inputs[self.key].shape[-1], dim=1)
        return (self.head(x).squeeze(-1) - labels).square().mean()


@pytest.mark.parametrize(
    "key, shape, tokens",
    [("pixel_values", (6, 3, 8, 8), None), ("input_values", (6, 400), None),
     ("input_features", (6, 16, 30), None), ("inputs_embeds", (6, 10, 4), 6 * 7)],
)
def test_a_batch_passed_by_a_known_keyword_counts_its_samples(sw, key, shape, tokens):
    """model(pixel_values=...), model(input_values=...), model(input_features=...) and
    model(inputs_embeds=..., attention_mask=...) carry the batch in dim 0 as input_ids does:
    samples were null in every record (only input_ids was read from keywords). inputs_embeds
    are token positions (tokens: the mask's ones); the others' tokens stay unknown (pixels and
    audio frames are not tokens)."""
    stepwatch, mem, start = sw
    start()
    torch.manual_seed(0)
    m = KeywordInputModel(key)
    m(**{key: torch.randn(*shape)}, labels=torch.zeros(shape[0]))  # materialise the lazy layer
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    mask = torch.ones(shape[0], 10, dtype=torch.long)
    mask[:, 7:] = 0
    for _ in range(3):
        extra = {"attention_mask": mask} if key == "inputs_embeds" else {}
        m(**{key: torch.randn(*shape)}, labels=torch.randn(shape[0]), **extra).backward()
        opt.step()
        opt.zero_grad()
    stepwatch.shutdown()
    recs = mem.records
    assert [r.samples for r in recs[-3:]] == [6] * 3
    assert [r.tokens for r in recs[-3:]] == [tokens] * 3


def test_a_forward_that_raises_adds_nothing_to_the_step(sw):
    """A malformed batch makes model(x) raise; the loop catches it and goes on to the next batch
    (the iteration merges into the next record, as documented). Its samples were counted in
    that record (32 for 16) and its FLOPs made the record's null."""
    stepwatch, mem, start = sw
    start()
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    for i in range(5):
        x = torch.randn(16, 31 if i in (1, 3) else 32)
        try:
            loss = m(x).pow(2).mean()
        except RuntimeError:
            continue
        opt.zero_grad()
        loss.backward()
        opt.step()
    stepwatch.shutdown()
    recs = mem.records
    assert len(recs) == 3
    assert [r.samples for r in recs] == [16] * 3
    assert recs[0].flops and [r.flops for r in recs] == [recs[0].flops] * 3


def test_optimizer_steps_inside_the_backward_are_optimizer_time_and_the_backward_ends_the_step(sw):
    """PyTorch's "optimizer step in backward" recipe: one optimizer per parameter, stepped from
    register_post_accumulate_grad_hook, no optimizer.step() outside loss.backward(). The steps'
    time was in both backward_s and optimizer_s (the phases came to more than step_s) and the
    step ended at the last parameter's step, inside the backward. Now the optimizer steps are
    optimizer_s, the rest of the backward backward_s, and the step ends with the backward."""
    stepwatch, mem, start = sw
    start()
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 4))
    opts = {p: torch.optim.Adam([p], lr=1e-3) for p in m.parameters()}

    def hook(p):
        opts[p].step()
        opts[p].zero_grad()

    for p in m.parameters():
        p.register_post_accumulate_grad_hook(hook)
    ends = []
    for _ in range(6):
        m(torch.randn(32, 64)).pow(2).mean().backward()
        ends.append(time.perf_counter_ns())
    stepwatch.shutdown()
    recs = [r for r in mem.records if not r.tail]
    assert len(recs) == 6
    _all_identity(recs)
    assert all(r.optimizer_s > 0 and r.backward_s > 0 and r.forward_s > 0 for r in recs)
    # each step ends when its backward returns: steps 1..5 together span the user's clock
    span = (ends[-1] - ends[0]) * 1e-9
    assert abs(sum(r.step_s for r in recs[1:]) - span) < 0.02 * span + 5e-4


def test_step_s_agrees_with_an_independent_optimizer_step_clock(sw):
    """The user's own clock, read right after each optimizer.step(): step_s must agree with
    it within 0.5% (median), i.e. stepwatch keeps none of the step's real time out of it."""
    stepwatch, mem, start = sw
    start()
    torch.manual_seed(0)
    m = TinyLM()
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    clock = []
    ids = torch.randint(0, 100, (150, 8, 64))
    mask = torch.ones(150, 8, 64, dtype=torch.long)
    mask[:, :, 48:] = 0
    for x, am in zip(ids, mask):
        m(input_ids=x, attention_mask=am).backward()
        opt.step()
        clock.append(time.perf_counter_ns())
        opt.zero_grad()
    stepwatch.shutdown()
    recs = mem.records
    assert len(recs) == len(clock) == 150
    _all_identity(recs)
    assert recs[5].tokens == 8 * 48
    # Per 10-step window (the clocks read a few us apart, and a preempted read moves time
    # from one step to the next): each window's step_s sum over the clock's time for it.
    ratios = [
        sum(r.step_s for r in recs[k + 1 : k + 11]) / ((clock[k + 10] - clock[k]) * 1e-9)
        for k in range(1, len(recs) - 10, 10)
    ]
    assert abs(statistics.median(ratios) - 1) < 0.005, ratios


def _train(seed, *, use_stepwatch, start=None):
    torch.manual_seed(seed)
    m = SeqFirstLM()
    data = TransformData(16)
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    losses = []
    for x, _ in DataLoader(data, batch_size=4):
        ids = (x.abs() * 10).long().clamp(0, 49).T  # [seq, batch]
        for _ in range(2):
            loss = m(ids).float().logsumexp(-1).mean() / 2
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().clone())
    with torch.no_grad():
        m(ids)
    return torch.stack(losses)


def test_losses_are_bit_identical_on_and_off(sw):
    stepwatch, mem, start = sw
    off = _train(1, use_stepwatch=False)
    start()
    on = _train(1, use_stepwatch=True)
    stepwatch.shutdown()
    assert len([r for r in mem.records if not r.tail]) == 4
    assert torch.equal(on, off)


def test_a_feature_hook_keeps_only_the_users_own_activations(sw):
    """A forward hook that keeps each layer's activation (feature extraction, an activation-norm
    monitor) and a backward hook that logs the gradient's norm: with stepwatch on, they see the
    user's forwards and backwards only, real tensors each (the FLOP count's replay ran them once
    more: a fake tensor in the list, a gradient norm that raised on it), and MFU's FLOPs are counted."""
    stepwatch, mem, start = sw
    m = _model()
    acts, norms = [], []
    m[0].register_forward_hook(lambda mod, a, out: acts.append(out.detach()))
    m[2].register_full_backward_hook(lambda mod, gi, go: norms.append(go[0].norm().item()))
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    start()
    for i in range(5):
        opt.zero_grad()
        m(torch.randn(8, 16)).pow(2).mean().backward()
        opt.step()
    stepwatch.shutdown()
    assert len(acts) == 5 and len(norms) == 5
    assert not any(isinstance(a, torch._subclasses.FakeTensor) for a in acts)
    recs = [r for r in mem.records if not r.tail]
    assert len(recs) == 5 and all(r.flops for r in recs), [r.flops for r in recs]


class MaskedEncoder(nn.Module):
    """word_language_model's TransformerModel in small: nn.TransformerEncoder with a causal mask."""

    def __init__(self, d=32):
        super().__init__()
        self.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(d, 4, 64, dropout=0.1), 2,
                                         enable_nested_tensor=False)
        self.head = nn.Linear(d, 8)

    def forward(self, x):
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[0])
        return self.head(self.enc(x, mask=mask))


def test_encoder_with_a_mask_gets_flops_from_a_real_count(sw):
    """The fake-tensor replay raises DataDependentOutputException here; FlopCounterMode on a real
    step counts it, and so must stepwatch (its fallback counts on real tensors, once)."""
    from torch.utils.flop_counter import FlopCounterMode

    stepwatch, mem, start = sw
    torch.manual_seed(0)
    ref = MaskedEncoder()
    x = torch.randn(10, 4, 32)
    with FlopCounterMode(display=False) as fc:
        ref(x).sum().backward()
    start()
    torch.manual_seed(0)
    m = MaskedEncoder()
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    for _ in range(3):
        m(x).sum().backward()
        opt.step()
        opt.zero_grad()
    stepwatch.shutdown()
    recs = mem.records
    _all_identity(recs)
    assert [r.flops for r in recs] == [float(fc.get_total_flops())] * 3


def test_lstm_flops_are_counted_by_formula():
    from stepwatch.metrics.flops import count_step_flops

    m = nn.LSTM(16, 32, num_layers=2)
    fc = count_step_flops(m, (torch.randn(10, 4, 16),))
    tokens = 10 * 4
    # Per timestep: x @ W_ih^T and h @ W_hh^T for 4 gates, both layers (layer 2's input is h).
    fwd = 2 * tokens * (4 * 32 * 16 + 4 * 32 * 32 + 4 * 32 * 32 + 4 * 32 * 32)
    assert fc.forward == {"fp32": fwd} and fc.backward == {"fp32": 2 * fwd}


def test_real_count_leaves_grads_buffers_and_rng_alone():
    from stepwatch.metrics.flops import count_step_flops

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.5))
    x = torch.randn(4, 8)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    rng = torch.get_rng_state()
    fc = count_step_flops(m, (x,), real=True)
    assert fc.total == 2 * (2 * 4 * 8 * 8)  # forward, and grad-weight (the input needs no grad)
    assert all(p.grad is None for p in m.parameters())
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())
    assert torch.equal(torch.get_rng_state(), rng)


class _Trainer:
    """A trainer object holding the model and the optimizer as attributes (the loop's locals
    hold the trainer only)."""

    def __init__(self):
        self.model = _model()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01)

    def fit(self):
        _accumulate(self.model, self.opt)


@pytest.mark.parametrize("holder", ["locals", "trainer"])
def test_a_heap_frozen_by_gc_freeze_still_has_its_model_found(sw, holder):
    """``gc.freeze()`` after the model is built (servers and some training frameworks do it, to
    keep the cyclic GC off long-lived objects) hides every frozen object from
    ``gc.get_objects()``, which the root scan read: no root was found (no forward timing, no
    FLOPs) and, no optimizer being seen either, each backward of step 0 ended a step, with a
    warning that the process had no optimizer."""
    import gc
    import logging

    stepwatch, mem, start = sw
    warnings = []

    class Catch(logging.Handler):
        def emit(self, record):
            warnings.append(record.getMessage())

    handler = Catch(logging.WARNING)
    logging.getLogger("stepwatch").addHandler(handler)
    trainer = _Trainer() if holder == "trainer" else None
    if holder == "locals":
        m = _model()
        opt = torch.optim.SGD(m.parameters(), lr=0.01)
    gc.freeze()
    try:
        start()
        if trainer is not None:
            trainer.fit()
        else:
            _accumulate(m, opt)
        session = stepwatch.get_session()
        roots, boundary = list(session.instrumentation.roots), session.tracker.boundary
        stepwatch.shutdown()
    finally:
        gc.unfreeze()
        logging.getLogger("stepwatch").removeHandler(handler)
    assert roots == ["Sequential"]
    assert boundary == "optimizer"
    assert not [w for w in warnings if "no torch.optim optimizer" in w]
    _every_micro_batch_counted(mem.records)


def test_a_loop_that_takes_its_gradients_with_autograd_grad_gets_one_step_each(sw, tmp_path):
    """A manual update from ``torch.autograd.grad`` (no ``backward()``, no torch optimizer), as
    functional-style and meta-learning scripts write it: it used to give no record at all."""
    import gc

    stepwatch, mem, start = sw
    gc.collect()  # optimizers of earlier tests in this process would count as the loop's
    start(dir=str(tmp_path / "run"))
    m = _model()
    params = list(m.parameters())
    for i in range(6):
        x = torch.randn(4, 16)
        loss = m(x).pow(2).mean()
        grads = torch.autograd.grad(loss, params)
        with torch.no_grad():
            for p, g in zip(params, grads):
                p -= 0.1 * g
        stepwatch.log(loss=loss.detach())
    stepwatch.shutdown()
    recs = mem.records
    assert [r.step for r in recs] == list(range(6))
    _all_identity(recs)
    assert all(r.backward_s > 0 and r.optimizer_s == 0 and "loss" in r.scalars for r in recs)
    assert all(r.forward_s > 0 for r in recs[1:])  # roots found at the first gradient, as for backward
    manifest = json.loads((tmp_path / "run" / "run.json").read_text())
    assert manifest["features"]["step_boundary"] == "backward"


class _SlowGrad(torch.autograd.Function):
    """Identity whose gradient takes 20 ms: gradient work big enough to time."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        time.sleep(0.02)
        return g * 1.0


class _Pinn(nn.Module):
    """A physics-informed loss: the model's forward takes the gradient of its output with respect to
    its input (``create_graph=True``) inside the forward; that gradient takes 20 ms."""

    def __init__(self):
        super().__init__()
        self.net = _model()

    def forward(self, x):
        x = x.requires_grad_(True)
        u = _SlowGrad.apply(self.net(x))
        (du,) = torch.autograd.grad(u.sum(), x, create_graph=True)
        return u.pow(2).mean() + du.pow(2).mean()


def test_a_gradient_penalty_is_backward_time_and_input_gradients_inside_a_forward_stay_forward(sw):
    """WGAN-GP's gradient penalty (``autograd.grad`` between the critic's forward and the backward)
    is gradient work, timed as backward; a forward that takes input gradients itself (a PINN's
    residual) stays one forward, with nothing counted twice. One record per optimizer step."""
    stepwatch, mem, start = sw
    start()
    critic = _model()
    opt = torch.optim.SGD(critic.parameters(), lr=0.01)
    for i in range(5):
        x = torch.randn(8, 16, requires_grad=True)
        out = _SlowGrad.apply(critic(x)).sum()
        (gx,) = torch.autograd.grad(out, x, create_graph=True)  # through SlowGrad: 20 ms
        penalty = (gx.norm(2, dim=1) - 1).pow(2).mean()
        (out + 10 * penalty).backward()  # through SlowGrad again: 20 ms more
        opt.step()
        opt.zero_grad()
    pinn = _Pinn()
    opt2 = torch.optim.SGD(pinn.parameters(), lr=0.01)
    for i in range(5):
        pinn(torch.randn(8, 16)).backward()
        opt2.step()
        opt2.zero_grad()
    stepwatch.shutdown()
    recs = mem.records
    assert [r.step for r in recs] == list(range(10))
    _all_identity(recs)
    wgan, pinn_recs = recs[1:5], recs[6:]
    assert all(r.backward_s >= 0.038 for r in wgan), [r.backward_s for r in wgan]
    # the PINN's input gradient (20 ms) is forward time, and only forward time (the identity above);
    # its backward goes through the slow gradient once more
    assert all(r.forward_s >= 0.019 and r.backward_s >= 0.019 for r in pinn_recs), \
        [(r.forward_s, r.backward_s) for r in pinn_recs]


def test_a_flop_count_that_failed_keeps_no_model_or_batch_alive(sw):
    """The fake replay of MaskedEncoder fails (and the real one counts it). The failed replay's
    exception, its traceback and the frames in it (the training loop's, with its model, optimizer
    and batch) were kept alive for good through the autograd hook the replay runs in, a reference
    gc cannot follow: after shutdown the model and the batch must be collectable."""
    import gc
    import weakref

    stepwatch, mem, start = sw

    def train():
        start()
        m = MaskedEncoder()
        x = torch.randn(10, 4, 32)
        opt = torch.optim.SGD(m.parameters(), lr=0.01)
        for _ in range(2):
            m(x).sum().backward()
            opt.step()
            opt.zero_grad()
        stepwatch.shutdown()
        return weakref.ref(m), weakref.ref(x), weakref.ref(opt)

    refs = train()
    assert [r.flops for r in mem.records][-1]  # the real count ran: the fake one had failed
    gc.collect()
    assert [r() for r in refs] == [None, None, None]


def _gan():
    """DCGAN's parts, small: generator, discriminator, their Adam optimizers, the loss, a generator."""
    torch.manual_seed(0)
    G = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16))
    D = nn.Sequential(nn.Linear(16, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))
    og, od = torch.optim.Adam(G.parameters(), 1e-3), torch.optim.Adam(D.parameters(), 1e-3)
    return G, D, og, od, nn.BCEWithLogitsLoss(), torch.Generator().manual_seed(0)


def _gan_iteration(G, D, og, od, bce, g):
    """One GAN iteration as the DCGAN example writes it: the discriminator's update (its own
    forward, backward and step), then the generator's (another forward of D, backward, step)."""
    real, z = torch.randn(16, 16, generator=g), torch.randn(16, 8, generator=g)
    fake = G(z)
    od.zero_grad()
    ld = bce(D(real), torch.ones(16, 1)) + bce(D(fake.detach()), torch.zeros(16, 1))
    ld.backward()
    od.step()
    og.zero_grad()
    lg = bce(D(fake), torch.ones(16, 1))
    lg.backward()
    og.step()
    return ld, lg


@pytest.mark.parametrize("how", ["optimizer", "step() calls", "step_boundary=explicit"])
def test_a_gan_gets_one_step_an_iteration_when_the_loop_marks_its_steps(sw, tmp_path, how):
    """Two optimizers stepping in turn, each after its own forward and backward (a GAN): by the
    optimizer boundary each update is a step of its own (the generator's forward ends the
    discriminator's step). A loop that calls ``stepwatch.step()`` at the end of each iteration
    says where its steps end: from the first call on only it ends steps, so the two updates are
    one step with both optimizers' time in ``optimizer_s`` (the first iteration, before that
    call, stays two steps); ``step_boundary="explicit"`` says so from the start."""
    stepwatch, mem, start = sw
    start(dir=str(tmp_path / "run"), **({"step_boundary": "explicit"} if how == "step_boundary=explicit" else {}))
    G, D, og, od, bce, g = _gan()
    for i in range(6):
        ld, lg = _gan_iteration(G, D, og, od, bce, g)
        stepwatch.log(d_loss=ld, g_loss=lg)
        if how != "optimizer":
            stepwatch.step()
    stepwatch.shutdown()
    recs = mem.records
    _all_identity(recs)
    manifest = json.loads((tmp_path / "run" / "run.json").read_text())
    if how == "optimizer":
        assert len(recs) == 12 and manifest["features"]["step_boundary"] == "optimizer"
        return
    whole = recs if how == "step_boundary=explicit" else recs[2:]  # the first iteration: two steps
    assert len(recs) == (6 if how == "step_boundary=explicit" else 7)
    assert [r.step for r in recs] == list(range(len(recs)))
    assert manifest["features"]["step_boundary"] == "explicit"
    assert len(whole) == 5 + (how == "step_boundary=explicit")
    assert all(r.forward_s > 0 and r.backward_s > 0 and r.optimizer_s > 0 for r in whole)
    assert all(set(r.scalars) == {"d_loss", "g_loss"} for r in whole)
    # Every forward of the iteration (G, D three times) in one step: the same count each step.
    assert whole[0].flops > 0 and len({r.flops for r in whole}) == 1


def test_a_gans_sample_forward_before_its_first_step_call_is_no_step_of_its_own(sw, tmp_path):
    """DCGAN's loop: ``if i % 100 == 0: netG(fixed_noise)`` (sample images, grad enabled) after
    the generator's step, then ``stepwatch.step()`` as the README advises. At the first call the
    sample forward had opened a step of its own (the automatic boundary had ended the generator's
    step), and the call ended it: a third record for the first iteration, forward only, no
    optimizer step (a helper's dcgan run: 34 records for 32 iterations). What ran since the last
    automatic step end goes on into the next step; the first iteration stays two steps."""
    stepwatch, mem, start = sw
    start(dir=str(tmp_path / "run"))
    G, D, og, od, bce, g = _gan()
    fixed = torch.randn(16, 8, generator=g)
    for i in range(6):
        _gan_iteration(G, D, og, od, bce, g)
        if i % 3 == 0:
            G(fixed)  # the sample images
        stepwatch.step()
    stepwatch.shutdown()
    recs = mem.records
    _all_identity(recs)
    assert [r.step for r in recs] == list(range(7)), [(r.step, r.forward_s, r.optimizer_s) for r in recs]
    assert all(r.backward_s > 0 and r.optimizer_s > 0 for r in recs), recs


def test_stepwatch_step_right_after_the_optimizer_keeps_one_step_an_iteration(sw):
    """``opt.step(); stepwatch.step()`` (a loop that marks its steps although it has an
    optimizer): one record an iteration, as before the explicit boundary took over."""
    stepwatch, mem, start = sw
    start()
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    for _ in range(4):
        m(torch.randn(4, 16)).sum().backward()
        opt.step()
        opt.zero_grad()
        stepwatch.step()
    m(torch.randn(4, 16)).sum().backward()  # work after the last marked step: not a step
    stepwatch.shutdown()
    assert [r.step for r in mem.records] == [0, 1, 2, 3]
    _all_identity(mem.records)
    assert all(r.optimizer_s > 0 for r in mem.records)


@pytest.mark.parametrize("how", ["trace", "script"])
def test_a_torchscript_model_is_the_steps_forward(sw, caplog, how):
    """A model made by ``torch.jit.trace`` keeps its parameters and submodules in the script
    module it calls (``_actual_script_module``), not in ``_modules``: the scan hooked that inner
    module and its submodules' as roots, which nothing calls through ``__call__``. Every step had
    forward_s 0 and null FLOPs and samples, and the log blamed a ``model.forward(x)`` call. The
    traced model is the root now, as a ``torch.jit.script`` one is."""
    import logging

    from stepwatch import _log

    stepwatch, mem, start = sw
    _log._warned.discard("unseen-forward")
    start()
    torch.manual_seed(0)
    eager = _model()
    m = torch.jit.trace(eager, torch.randn(4, 16)) if how == "trace" else torch.jit.script(eager)
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    with caplog.at_level(logging.WARNING, logger="stepwatch"):
        for _ in range(12):  # past the 8 steps the one log line waits for
            (m(torch.randn(4, 16)) - torch.randn(4, 4)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        roots = list(stepwatch.get_session().instrumentation.roots)
        stepwatch.shutdown()
    recs = mem.records[-12:]
    _all_identity(recs)
    assert all(r.forward_s > 0 and r.samples == 4 for r in recs[1:]), recs
    # The forward (2 x 4 x 640 multiply-adds), the weight gradients (as many), and the input
    # gradient of the second layer only (2 x 4 x 32 x 4): as for the eager model.
    assert all(r.flops == 2 * 4 * 640 * 2 + 2 * 4 * 32 * 4 for r in recs[1:]), [r.flops for r in recs]
    assert not [r for r in caplog.records if "no module call was timed as forward" in r.getMessage()]
    assert type(m).__name__ in roots, roots


def test_a_step_the_scaler_skips_is_marked_under_the_explicit_boundary_too(sw):
    """With ``step_boundary="explicit"`` a GradScaler step that skips the optimizer (an inf in
    the batch) no longer ends a step itself; the step ``stepwatch.step()`` ends is marked
    ``skipped``, and only that one."""
    stepwatch, mem, start = sw
    start(step_boundary="explicit")
    torch.manual_seed(0)
    m = nn.Linear(8, 1)
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    for i in range(5):
        x = torch.randn(4, 8)
        if i == 2:
            x[0, 0] = float("inf")
        scaler.scale(m(x).pow(2).mean()).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        stepwatch.step()
    stepwatch.shutdown()
    assert [(r.step, r.skipped) for r in mem.records] == [(0, False), (1, False), (2, True), (3, False), (4, False)]
    _all_identity(mem.records)


@pytest.mark.parametrize("order", ["stepped first", "skipped first"])
def test_a_step_where_the_scaler_skipped_one_of_two_optimizers_is_not_skipped(sw, order):
    """One GradScaler, two optimizers over two halves of a model, a NaN in one half's gradients:
    ``scaler.step`` updates one and skips the other. The record said ``skipped`` when the skipped
    one stepped last (half the model was updated), and not when it stepped first. ``skipped``
    means no optimizer of the step updated; ``grad_norm`` is NaN either way."""
    stepwatch, mem, start = sw
    start()
    torch.manual_seed(0)
    a, b = nn.Linear(8, 8), nn.Linear(8, 1)
    opt_a, opt_b = torch.optim.SGD(a.parameters(), lr=0.01), torch.optim.SGD(b.parameters(), lr=0.01)
    bad = opt_b if order == "stepped first" else opt_a
    scaler = torch.amp.GradScaler("cpu")
    for i in range(5):
        scaler.scale(b(a(torch.randn(4, 8))).pow(2).mean()).backward()
        if i == 2:
            for g in bad.param_groups:
                for p in g["params"]:
                    p.grad[0].fill_(float("nan"))
        if i == 3:  # both skipped: the step is
            for o in (opt_a, opt_b):
                for g in o.param_groups:
                    for p in g["params"]:
                        p.grad[0].fill_(float("inf"))
        scaler.step(opt_a)
        scaler.step(opt_b)
        scaler.update()
        opt_a.zero_grad()
        opt_b.zero_grad()
    stepwatch.shutdown()
    recs = [r for r in mem.records if not r.tail]
    assert [r.skipped for r in recs] == [False, False, False, True, False], [(r.step, r.skipped) for r in recs]
    assert recs[2].grad_norm != recs[2].grad_norm  # NaN: a non-finite gradient all the same
    _all_identity(recs)


class _Agent(nn.Module):
    """An actor-critic that the loop calls through its methods (CleanRL's PPO agent and its
    ``get_action_and_value``), never through ``agent(x)``; ``features`` loops over a ModuleList."""

    def __init__(self):
        super().__init__()
        self.critic = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.actor = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])

    def value_and_logits(self, x):
        return self.critic(x), self.actor(x)

    def features(self, x):
        for b in self.blocks:
            x = torch.tanh(b(x))
        return x

    def forward(self, x, what="both"):
        return self.features(x) if what == "features" else self.value_and_logits(x)


@pytest.mark.parametrize("how", ["method", "forward", "layers"])
def test_a_model_called_through_its_methods_gets_its_submodules_timed(sw, caplog, how):
    """A loop that calls its model's methods (``agent.value_and_logits(x)``, ``model.forward(x)``,
    a method looping over a ModuleList) runs no root's ``__call__``: every step had forward_s 0,
    null FLOPs and samples, its forward time in other_s, and one log line. A step that runs
    backward with no root forward now has the roots' submodules hooked as roots at its end, a
    level further down at the next such step: from then on the records read as with
    ``agent(x)``: the same FLOPs, samples and a timed forward."""
    import logging

    from stepwatch import _log

    stepwatch, mem, start = sw

    def train(call):
        torch.manual_seed(0)
        agent = _Agent()
        opt = torch.optim.SGD(agent.parameters(), lr=0.01)
        for _ in range(12):  # past the 8 steps the one log line waits for
            out = call(agent, torch.randn(4, 8))
            sum(o.pow(2).mean() for o in (out if isinstance(out, tuple) else (out,))).backward()
            opt.step()
            opt.zero_grad()
        stepwatch.shutdown()
        recs = mem.records[-12:]
        _all_identity(recs)
        return recs

    what = "features" if how == "layers" else "both"
    start()
    want = train(lambda agent, x: agent(x, what))
    assert all(r.forward_s > 0 and r.flops for r in want[1:])
    _log._warned.discard("unseen-forward")
    start()
    with caplog.at_level(logging.WARNING, logger="stepwatch"):
        got = train({"method": lambda agent, x: agent.value_and_logits(x),
                     "forward": lambda agent, x: agent.forward(x),
                     "layers": lambda agent, x: agent.features(x)}[how])
    # Step 0 is not judged; a step's end is final at the next one's backward here (no
    # DataLoader), after its forward: each level hooked times the step after that one. The
    # ModuleList is never called: its layers are, a level further down.
    levels = 2 if how == "layers" else 1
    seen = got[1 + 2 * levels:]
    assert all(r.forward_s > 0 for r in seen), [(r.step, r.forward_s) for r in got]
    assert [r.flops for r in seen] == [r.flops for r in want[1 + 2 * levels:]]
    assert all(r.samples == 4 for r in seen), [r.samples for r in got]
    assert not [r for r in caplog.records if "no module call was timed as forward" in r.getMessage()]


def test_a_model_called_inside_a_compiled_function_gets_the_line_and_no_graph_break(sw, caplog):
    """``@torch.compile def loss_fn(x, y): ... model(x) ...``: dynamo inlines the module call, so
    no root call is timed, and the submodules are hooked in turn (``_UnseenForward``). dynamo
    inlines those too: the hooks it skips must cost no graph break and no recompilation, also
    when new input shapes make it trace again after they were put in. The log line says what to
    do (compile the model instead)."""
    import logging

    import torch._dynamo
    from torch._dynamo.utils import counters

    from stepwatch import _log

    stepwatch, mem, start = sw
    _log._warned.discard("unseen-forward")
    torch._dynamo.reset()
    counters.clear()
    start()
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    @torch.compile(backend="eager")
    def loss_fn(x, y):
        return (model(x) - y).pow(2).mean()

    with caplog.at_level(logging.WARNING, logger="stepwatch"):
        for bs in [4] * 12 + [5, 7, 9]:
            loss_fn(torch.randn(bs, 16), torch.randn(bs, 4)).backward()
            opt.step()
            opt.zero_grad()
        roots = list(stepwatch.get_session().instrumentation.roots)
        stepwatch.shutdown()
    assert roots.count("Linear") == 2, roots  # the descent ran
    assert dict(counters["graph_break"]) == {}
    assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])  # batch 4, then one dynamic
    said = [r.getMessage() for r in caplog.records if "torch.compile'd function" in r.getMessage()]
    assert len(said) == 1, said


def test_a_forward_of_plain_tensor_code_gets_the_same_line(sw, caplog):
    """A hand-written model with no nn.Module (``x @ W``): nothing to hook, and one line says so
    (after 8 steps with a backward: a model called through its methods is looked into first)."""
    import logging

    from stepwatch import _log

    stepwatch, mem, start = sw
    _log._warned.discard("unseen-forward")
    start()
    torch.manual_seed(0)
    W = torch.randn(16, 4, requires_grad=True)
    opt = torch.optim.SGD([W], lr=0.01)
    for _ in range(12):
        (torch.randn(4, 16) @ W).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    with caplog.at_level(logging.WARNING, logger="stepwatch"):
        stepwatch.shutdown()
    said = [r.getMessage() for r in caplog.records if "plain tensor code" in r.getMessage()]
    assert len(said) == 1 and len(mem.records) == 12


class _FFLayer(nn.Linear):
    """pytorch/examples' mnist_forward_forward layer: an ``nn.Linear`` whose training loop calls
    ``self.forward(x)``, which multiplies by its own weight and then calls a ``ReLU`` submodule."""

    def __init__(self, i, o):
        super().__init__(i, o)
        self.relu = nn.ReLU()

    def forward(self, x):
        return self.relu(torch.mm(x, self.weight.T) + self.bias.unsqueeze(0))


def test_a_descent_never_takes_a_parameterless_submodule_for_the_model(sw, caplog):
    """The loop never calls the layer (``self.forward(x)``), so its submodules were hooked a step
    in: its one submodule, the ReLU, was then timed as the step's forward, and every step recorded
    ``flops: 0.0`` (a known zero, beside 5e5 FLOPs of matmul) and the ReLU's 8 samples. A module
    with no parameters (an activation, a dropout) is never the model: nothing is hooked, FLOPs
    and samples stay null, and the log line says the forward was not seen."""
    import logging

    from stepwatch import _log

    stepwatch, mem, start = sw
    _log._warned.discard("unseen-forward")
    start()
    torch.manual_seed(0)
    layer = _FFLayer(64, 32)
    opt = torch.optim.Adam(layer.parameters(), lr=0.01)
    for _ in range(12):
        layer.forward(torch.randn(8, 64)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    with caplog.at_level(logging.WARNING, logger="stepwatch"):
        stepwatch.shutdown()
    recs = [r for r in mem.records if not r.tail]
    assert len(recs) == 12
    assert [(r.flops, r.samples, r.forward_s) for r in recs] == [(None, None, 0.0)] * 12, recs[3]
    said = [r.getMessage() for r in caplog.records if "plain tensor code" in r.getMessage()]
    assert len(said) == 1, said


class _CheckpointedBlocks(nn.Module):
    """Blocks run through ``torch.utils.checkpoint`` (activation checkpointing, as large models
    train), with an attention mask."""

    def __init__(self, reentrant: bool):
        super().__init__()
        self.reentrant = reentrant
        self.emb = nn.Embedding(50, 32)
        self.attn = nn.ModuleList([nn.MultiheadAttention(32, 4, batch_first=True) for _ in range(2)])
        self.head = nn.Linear(32, 50)

    def _block(self, i):
        def run(x, mask):
            a, _ = self.attn[i](x, x, x, key_padding_mask=mask, need_weights=False)
            return x + a
        return run

    def forward(self, ids, mask):
        x = self.emb(ids)
        for i in range(len(self.attn)):
            x = torch.utils.checkpoint.checkpoint(self._block(i), x, mask, use_reentrant=self.reentrant)
        return self.head(x)


def _train_checkpointed(reentrant):
    torch.manual_seed(0)
    m = _CheckpointedBlocks(reentrant)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(4):
        ids = torch.randint(0, 50, (4, 12), generator=g)
        mask = torch.zeros(4, 12, dtype=torch.bool)
        mask[:, 9:] = True
        loss = nn.functional.cross_entropy(m(ids, mask).flatten(0, 1), ids.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().clone())
    return torch.stack(losses), m


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_activation_checkpointing_trains_the_same_and_gets_its_grad_norms(sw, reentrant):
    """The FLOP count's replay must not touch the model: with a reentrant checkpoint, the
    replay's backward ran the blocks again on the real parameters and left its gradients in
    them; the grad-norm enricher then read a fake tensor and was disabled."""
    stepwatch, mem, start = sw
    off, m_off = _train_checkpointed(reentrant)
    start()
    on, m_on = _train_checkpointed(reentrant)
    stepwatch.shutdown()
    assert torch.equal(on, off)
    assert all(torch.equal(a, b) for a, b in zip(m_on.parameters(), m_off.parameters()))
    recs = [r for r in mem.records if not r.tail]
    assert len(recs) == 4
    assert not [f for f in mem.findings if f.kind == "internal_error"], mem.findings
    assert all(r.grad_norm is not None and r.grad_norm > 0 for r in recs), [r.grad_norm for r in recs]
    assert all(r.flops for r in recs[1:])
    _all_identity(recs)


class _SleepyStack(nn.Sequential):
    """An ``nn.Sequential`` whose first layer sleeps ``ms`` a call: a forward whose time is known,
    checkpointed whole (``checkpoint(model, x)``) or in segments (``checkpoint_sequential``)."""

    def __init__(self, ms, took=None):
        class Sleep(nn.Module):
            def forward(self, x):
                t0 = time.perf_counter()
                time.sleep(ms / 1e3)
                if took is not None:
                    took.append(time.perf_counter() - t0)  # what the sleep took on this machine, now
                return x

        super().__init__(Sleep(), nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def _train_ckpt_whole(how, reentrant, steps=5, ms=20):
    torch.manual_seed(0)
    took = []
    threads = torch.get_num_threads()
    # One intra-op thread: with the other pytest worker busy on the second core, torch's OpenMP
    # team waited a time slice for its second thread in the checkpoint's ops (15 ms in the forward,
    # 40 in the backward, with stepwatch off too), which is no part of what is measured here.
    torch.set_num_threads(1)
    try:
        return _ckpt_steps(how, reentrant, steps, ms, took)
    finally:
        torch.set_num_threads(threads)


def _ckpt_steps(how, reentrant, steps, ms, took):
    from torch.utils.checkpoint import checkpoint, checkpoint_sequential

    m = _SleepyStack(ms, took)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(3)
    forwards = []  # each step's forward sleep, as it ran (a loaded machine stretches it)
    for _ in range(steps):
        x = torch.randn(8, 16, generator=g, requires_grad=reentrant)
        if how == "whole":
            out = checkpoint(m, x, use_reentrant=reentrant)
        else:
            out = checkpoint_sequential(m, 2, x, use_reentrant=reentrant)
        forwards.append(took[-1])
        out.pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return forwards


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
@pytest.mark.parametrize("how", ["whole", "sequential"])
def test_a_checkpointed_whole_model_is_one_forward_and_its_recompute_backward(sw, how, reentrant):
    """``checkpoint(model, x)``: the backward calls the model again (the recompute). That call was
    timed as forward while the backward's clock ran too: forward_s twice the forward, the phases
    more than step_s (other_s clamped at 0), and step 0's backward held stepwatch's one-off FLOP
    count of the recompute call (kept out of step_s only).
    ``checkpoint_sequential(model, segments, x)`` runs the model's layers one by one and never
    calls the model: its forward was other_s, samples and FLOPs null, with a warning that blamed
    ``model.forward(x)``. The call is now the model's forward (torch's function looked up through
    ``torch.utils.checkpoint`` after stepwatch started, as here)."""
    stepwatch, mem, start = sw
    start()
    forwards = _train_ckpt_whole(how, reentrant)
    stepwatch.shutdown()
    recs = [r for r in mem.records if not r.tail]
    assert len(recs) == 5
    _all_identity(recs)
    # One forward (its sleep as measured, a little more), not two (the recompute's too: ~20 ms
    # more every step); the median of the steps, against a stall a step may still meet.
    over = [r.forward_s - fwd for r, fwd in zip(recs, forwards)]
    assert min(over) >= 0 and statistics.median(over) < 0.008, over
    for r in recs:
        assert r.backward_s >= 0.018, (r.step, r.backward_s)  # the (first segment's) recompute
        assert r.samples == 8, (r.step, r.samples)
    assert all(r.flops for r in recs[1:]), [r.flops for r in recs]


@pytest.mark.parametrize("how", ["whole, reentrant", "whole, non-reentrant", "blocks from the loop"])
def test_a_checkpointed_roots_recompute_is_in_hfu_not_in_flops(sw, how):
    """The recompute of a root checkpointed from the loop (``checkpoint(model, x)``, and blocks
    checkpointed one by one where the loop calls no model) is hardware work: ``hfu`` counts it,
    ``flops`` (the model's) does not. It was in neither (hfu == mfu), and a reentrant
    checkpoint's FLOPs and samples were those of its recompute, the forward itself (run without
    grad) unseen. The recompute is counted as the root's whole forward (a non-reentrant one
    stops after the last tensor it must save again: here the blocks' second matmul, whose output
    nothing saves, so it counts a little more than ran)."""
    from torch.utils.checkpoint import checkpoint

    stepwatch, mem, start = sw
    start(peak_tflops=1.0)
    torch.manual_seed(0)
    blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32)) for _ in range(3))
    head = nn.Linear(32, 4)
    model = nn.Sequential(*blocks, head)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(6):
        x = torch.randn(16, 32, requires_grad=True)
        if how == "blocks from the loop":
            h = x
            for b in blocks:
                h = checkpoint(b, h, use_reentrant=False)
            out = head(h)
        else:
            out = checkpoint(model, x, use_reentrant=how == "whole, reentrant")
        out.pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    stepwatch.shutdown()
    recs = [r for r in mem.records if not r.tail]
    assert len(recs) == 6
    _all_identity(recs)
    first_linear, fwd_head = 2 * 16 * 32 * 64, 2 * 16 * 32 * 4
    fwd = 3 * 2 * first_linear + fwd_head
    # What torch runs again: a reentrant checkpoint, the whole forward; a non-reentrant one stops
    # after the last tensor its backward needs again (the head's input; each block's ReLU output,
    # which its second Linear saves): the head, and each block's second Linear, never run again.
    again = {"whole, reentrant": fwd, "whole, non-reentrant": fwd - fwd_head,
             "blocks from the loop": 3 * first_linear}[how]
    first = 3 if how == "blocks from the loop" else 0  # the blocks are hooked once steps ran without a root call
    for r in recs[first:]:
        assert r.flops == 3 * fwd and r.samples == 16, r
        assert r.hfu / r.mfu == pytest.approx((3 * fwd + again) / (3 * fwd), rel=1e-9), (r.hfu, r.mfu)


class _Slow(nn.Module):
    """A linear layer whose forward also sleeps ``ms``: a model whose time is known."""

    def __init__(self, ms):
        super().__init__()
        self.ms = ms
        self.lin = nn.Linear(16, 4)

    def forward(self, x):
        time.sleep(self.ms / 1e3)
        return self.lin(x)


def _distill(batches, teacher, student, opt, teachers=1):
    for x in batches:
        with torch.no_grad():
            t = sum(teacher(x) for _ in range(teachers))
        loss = nn.functional.kl_div(student(x).log_softmax(-1), t.softmax(-1), reduction="batchmean")
        loss.backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("loader", [True, False], ids=["dataloader", "tensors"])
def test_a_teacher_forward_without_grad_is_the_steps_forward_not_evaluation(sw, loader):
    """Knowledge distillation (and an RLHF reference model): each step runs a frozen model under
    ``torch.no_grad()`` on its own batch, then trains the student on it. That forward is part
    of every step: it counts in ``forward_s`` and ``step_s``, and the step's fetch stays data
    time. It used to open an evaluation span: the teacher's 20 ms and the fetch went to
    ``eval_s``, outside ``step_s`` (a 27 ms step recorded as 7 ms)."""
    stepwatch, mem, start = sw
    start()
    torch.manual_seed(0)
    teacher, student = _Slow(20), _Slow(2)
    opt = torch.optim.SGD(student.parameters(), lr=0.1)
    xs = torch.randn(48, 16)
    batches = (DataLoader(TransformData(48), batch_size=8, collate_fn=lambda b: torch.stack([x for x, _ in b]))
               if loader else list(xs.split(8)))
    _distill(batches, teacher, student, opt)
    stepwatch.shutdown()
    recs = [r for r in mem.records if not r.tail]
    assert len(recs) == 6
    _all_identity(recs)
    for r in recs[1:]:  # step 0's teacher call comes before the roots are found
        assert r.eval_s == 0, r
        assert r.forward_s >= 0.020 + 0.002, r  # the teacher's and the student's
        assert r.step_s >= 0.022, r
        if loader:
            assert r.data_wait_s >= 8 * 0.002, r  # eight 2 ms transforms: still data time
    assert not [r for r in mem.records if r.tail]  # nothing left over as evaluation


@pytest.mark.parametrize("how", ["eval_mode_no_grad", "train_mode_no_grad"])
def test_the_trained_models_own_evaluation_between_steps_is_eval_time(sw, both_tracker_cores, how):
    """pytorch/examples' gcn and gat train full-batch and, after each optimizer step, evaluate the
    model being trained twice (train and validation masks), in ``model.eval()`` under
    ``torch.no_grad()``. Two grad-disabled calls look like a teacher's (IN_STEP_NO_GRAD_CALLS), so
    the evaluation went to the next step's ``forward_s`` (its 40 ms made every step slow) while
    the same evaluation after the last step was ``eval_s``. A grad-disabled call of a model an
    optimizer steps, in eval mode, is evaluation. In train mode it stays the step's work: a model
    labelling its own batch without grad first (FixMatch's pseudo-labels)."""
    stepwatch, mem, start = sw
    start()
    torch.manual_seed(0)
    model = _Slow(20)
    opt = torch.optim.Adam(model.parameters())
    x, y = torch.randn(64, 16), torch.randn(64, 4)
    for _ in range(6):
        model.train()
        opt.zero_grad()
        if how == "train_mode_no_grad":
            with torch.no_grad():
                target = model(x) + model(x + 0.1)  # the step's own work, before its backward
            nn.functional.mse_loss(model(x), target).backward()
            opt.step()
            continue
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        model.eval()
        with torch.no_grad():  # test(): twice a step, as gcn's train()
            model(x)
            model(x)
    stepwatch.shutdown()
    recs = [r for r in mem.records if not r.tail]
    assert len(recs) == 6
    _all_identity(recs)
    for r in recs[1:]:
        if how == "eval_mode_no_grad":
            assert r.forward_s < 0.035 and r.eval_s >= 0.040, r  # one 20 ms training forward
        else:
            assert r.forward_s >= 0.060 and r.eval_s == 0, r  # three forwards, all the step's


def test_a_frozen_eval_mode_teacher_called_first_counts_no_samples_at_step_0(sw):
    """Distillation with the teacher frozen by ``requires_grad_(False)`` and ``teacher.eval()``
    (grad left on), called twice before the student: the teacher was the model at the run's first
    call, so step 0 counted its two calls' samples as the step's (24 for a batch of 8); every
    later step counted 8. Every step counts the student's batch."""
    stepwatch, mem, start = sw
    start()
    torch.manual_seed(0)
    teacher = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).eval()
    teacher.requires_grad_(False)
    student = nn.Linear(16, 4)
    opt = torch.optim.SGD(student.parameters(), lr=0.1)
    for x in torch.randn(40, 16).split(8):
        t = (teacher(x).softmax(-1) + teacher(x + 0.1).softmax(-1)) / 2
        nn.functional.cross_entropy(student(x), t).backward()
        opt.step()
        opt.zero_grad()
    stepwatch.shutdown()
    recs = [r for r in mem.records if not r.tail]
    assert [r.samples for r in recs] == [8] * 5
    assert recs[0].flops == recs[1].flops  # the teacher's FLOPs stay the step's


def test_an_evaluation_loop_of_many_no_grad_calls_stays_evaluation(sw):
    """nanoGPT's ``estimate_loss``: a loop of grad-disabled forwards on batches it slices itself
    (no DataLoader), between two training steps. More calls than a step's frozen models make:
    evaluation, outside ``step_s``, as before."""
    stepwatch, mem, start = sw
    start()
    torch.manual_seed(0)
    model = _Slow(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    xs = torch.randn(8, 16)
    for i in range(4):
        model(xs).sum().backward()
        opt.step()
        opt.zero_grad()
        if i == 1:
            with torch.no_grad():
                for _ in range(30):
                    model(xs)
    stepwatch.shutdown()
    recs = [r for r in mem.records if not r.tail]
    _all_identity(recs)
    # The evaluation's 30 calls sleep 30 ms: all in step 2's eval_s, none in its forward_s (one
    # call, 1 ms of sleep; a loaded machine's sleep overshoots by ~10 ms, never by 20).
    assert [r.eval_s > 0.030 for r in recs] == [False, False, True, False], [r.eval_s for r in recs]
    assert recs[2].forward_s < 0.020, [r.forward_s for r in recs]


class _Jitter(nn.Module):
    """A per-image augmentation (kornia's, torchvision v2's: an nn.Module without parameters),
    1 ms a call."""

    def forward(self, img):
        time.sleep(0.001)
        return img + 0.01 * torch.randn_like(img)


def test_a_per_sample_augmentation_without_grad_is_the_steps_work_not_evaluation(sw):
    """A loop that augments each image of the fetched batch under ``torch.no_grad()`` (a module
    without parameters, called once per sample) before the model's forward. Eight grad-disabled
    root calls after a fetch opened an evaluation span: the fetch's wait and the augmentation
    went to ``eval_s``, ``data_wait_s`` read 0 and ``step_s`` the model's 1 ms of a 30 ms
    iteration. A parameterless module is a transform, never an evaluation of its own."""
    stepwatch, mem, start = sw
    start()
    torch.manual_seed(0)
    aug = _Jitter()
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TransformData(40), batch_size=8)  # eight 2 ms samples a fetch
    for x, y in loader:
        with torch.no_grad():
            x = torch.stack([aug(xi) for xi in x])
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    stepwatch.shutdown()
    recs = [r for r in mem.records if not r.tail]
    assert len(recs) == 5
    _all_identity(recs)
    for r in recs:
        assert r.eval_s == 0, r
        assert r.data_wait_s >= 8 * 0.002, r  # the fetch's eight transforms
        assert r.step_s >= 8 * 0.002 + 8 * 0.001, r  # and the eight augmentations
    assert not [r for r in mem.records if r.tail]


def test_a_parameterless_module_inside_an_evaluation_stays_evaluation(sw):
    """The other side: an evaluation loop (grad-disabled forwards of the model on a grad-disabled
    fetch) that also augments its batch. The augmentation is the evaluation's: in ``eval_s``."""
    stepwatch, mem, start = sw
    start()
    torch.manual_seed(0)
    aug = _Jitter()
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train = DataLoader(TransformData(16), batch_size=8)
    val = DataLoader(TransformData(16), batch_size=8)
    for _ in range(2):
        for x, y in train:
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        with torch.no_grad():
            for x, y in val:
                model(torch.stack([aug(xi) for xi in x]))
    stepwatch.shutdown()
    recs = [r for r in mem.records if not r.tail]
    _all_identity(recs)
    tail = [r for r in mem.records if r.tail]
    evals = [r.eval_s for r in recs if r.eval_s > 0] + [r.eval_s for r in tail]
    assert len(evals) == 2, (recs, tail)
    assert all(e >= 2 * (8 * 0.002 + 8 * 0.001) for e in evals), evals  # two fetches, 16 augmentations


def test_the_no_grad_call_limit_is_the_same_in_both_cores():
    from stepwatch.hooks import _ctracker, phases

    assert _ctracker.IN_STEP_NO_GRAD_CALLS == phases.IN_STEP_NO_GRAD_CALLS
    from stepwatch.hooks import install

    assert _ctracker.CHECKPOINT_CALLER_DEPTH == install.CHECKPOINT_CALLER_DEPTH


class _SlowSamples(Dataset):
    """``n`` samples of ``ms`` each (a validation set whose loading takes known time)."""

    def __init__(self, n, ms):
        self.n, self.ms = n, ms

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        time.sleep(self.ms / 1e3)
        return torch.randn(16), torch.randn(4)


class _Ema(nn.Module):
    """timm's ModelEmaV2 in small: the averaged copy is its child ``.module``."""

    def __init__(self, model):
        super().__init__()
        import copy

        self.module = copy.deepcopy(model).eval()


def _train_with_validation(m, opt, val, validate, every=4, steps=8, loss=nn.functional.mse_loss):
    """A training loop that validates after every ``every``-th step; the validations' wall
    times, each on the loop's own clock from before ``iter(val)`` to after its last batch."""
    walls = []
    train = DataLoader(torch.utils.data.TensorDataset(torch.randn(8 * steps, 16), torch.randn(8 * steps, 4)),
                       batch_size=8)
    for i, (x, y) in enumerate(train):
        loss(m(x), y).backward()
        opt.step()
        opt.zero_grad()
        if i % every == every - 1:
            t0 = time.perf_counter()
            validate(val)
            walls.append(time.perf_counter() - t0)
    return walls


def _after_each_validation(mem, walls):
    """``(record, wall)`` for each of ``_train_with_validation``'s two validations (8 steps, one
    every 4): the record of the step after it (the tail's after the last step). The phase
    identity holds on every record."""
    recs = [r for r in mem.records if not r.tail]
    assert len(recs) == 8 and len(walls) == 2
    _all_identity(recs)
    tail = [r for r in mem.records if r.tail]
    return [(recs[k] if k < len(recs) else tail[0], wall) for k, wall in zip((4, 8), walls)]


def test_a_validation_through_a_child_module_is_evaluation_not_data_wait(sw):
    """timm's ``validate(model_ema.module, loader)`` (DDP's ``model.module(x)`` is the same shape):
    the model called is a child, so no root call opens an evaluation span; its DataLoader's
    fetches, made with grad disabled, are evaluation all the same. They used to be the next
    step's ``data_wait_s`` (a false data_loading finding)."""
    stepwatch, mem, start = sw
    start()
    torch.manual_seed(0)
    m = _model()
    ema = _Ema(m)
    opt = torch.optim.SGD(m.parameters(), lr=0.01)

    def validate(val):
        with torch.no_grad():
            for x, y in val:
                nn.functional.mse_loss(ema.module(x), y).item()

    walls = _train_with_validation(m, opt, DataLoader(_SlowSamples(8, 5), batch_size=2), validate)
    stepwatch.shutdown()
    for r, wall in _after_each_validation(mem, walls):
        assert wall * 0.8 <= r.eval_s <= wall + 0.002, (wall, r)
        assert r.data_wait_s < wall * 0.25, (wall, r)  # the training fetch only
        # (step_s is the rest, by the identity above: no bound on it here, where a loaded CI
        # machine's step can take as long as the validation)
    assert not [f for f in mem.findings if f.kind == "data_loading"]


def test_a_validation_without_no_grad_is_evaluation_by_the_models_eval_mode(sw):
    """A first script's validation: ``model.eval()``, then the loop with grad enabled (no
    ``torch.no_grad()``), then ``model.train()``. The root module in eval mode says evaluation;
    its forwards and fetches were the next step's forward, data wait and other time (a step
    many times its neighbours), eval_s 0. The loss module, a root too and never put in eval mode,
    is the evaluation's inside it."""
    stepwatch, mem, start = sw
    start()
    torch.manual_seed(0)
    m = _model()
    crit = nn.MSELoss()
    opt = torch.optim.SGD(m.parameters(), lr=0.01)

    def validate(val):
        m.eval()
        for x, y in val:
            crit(m(x), y).item()
        m.train()

    walls = _train_with_validation(m, opt, DataLoader(_SlowSamples(8, 5), batch_size=2), validate, loss=crit)
    stepwatch.shutdown()
    # The first validation's new input shape is FLOP-counted (forward and backward: grad is on)
    # between its first fetch and its first call: stepwatch's time, in neither eval_s nor step_s
    # (it was taken out of both, and the step's parts came to more than step_s: the identity
    # _after_each_validation checks).
    for r, wall in _after_each_validation(mem, walls):
        # Its 8 samples sleep 5 ms each: at least that much evaluation, and the step's fetch
        # (one training batch, no sleep) far less (the fetches were data_wait_s before).
        assert 0.040 * 0.9 <= r.eval_s <= wall + 0.002, (wall, r)
        assert r.data_wait_s < 0.040 * 0.5, (wall, r)
    assert not [f for f in mem.findings if f.kind == "data_loading"]
    # ... and neither are its samples and FLOPs the step's: the validation's 8 samples were
    # added to the next step's 8, its 4 forwards (grad on: forward and backward) to its FLOPs.
    recs = [r for r in mem.records if not r.tail]
    assert [r.samples for r in recs] == [8] * 8
    assert len({r.flops for r in recs[1:]}) == 1, [r.flops for r in recs]


def test_training_with_the_model_in_eval_mode_keeps_its_forward(sw):
    """Fine-tuning with ``model.eval()`` on (dropout and batch-norm updates off) and grad enabled:
    each step's forward, followed by its backward, is the step's forward, never evaluation."""
    stepwatch, mem, start = sw
    start()
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 256), nn.Dropout(0.1), nn.ReLU(), nn.Linear(256, 4)).eval()
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    loader = DataLoader(torch.utils.data.TensorDataset(torch.randn(48, 16), torch.randn(48, 4)), batch_size=8)
    for _ in range(2):
        for x, y in loader:
            opt.zero_grad()
            nn.functional.mse_loss(m(x), y).backward()
            opt.step()
    stepwatch.shutdown()
    recs = [r for r in mem.records if not r.tail]
    assert len(recs) == 12
    _all_identity(recs)
    assert all(r.eval_s == 0 and r.forward_s > 0 and r.backward_s > 0 for r in recs), recs
    # Its samples and FLOPs too (the model's one call a step, in eval mode, is the step's).
    assert [r.samples for r in recs] == [8] * 12
    assert recs[1].flops and len({r.flops for r in recs[1:]}) == 1, [r.flops for r in recs]


def test_an_adversarial_evaluation_with_input_gradients_is_evaluation(sw):
    """A robust-accuracy validation (FGSM): in eval mode, each batch's input gradient
    (``torch.autograd.grad(loss, x)``), then the perturbed batch's prediction under ``no_grad``.
    Each gradient closed the evaluation span as training work: the autograd.grad calls were
    the next step's ``backward_s`` (16 ms of a 2 ms step), the first batch its samples and
    forward, and ``eval_s`` held a part of the evaluation. A backward inside a span judged
    evaluation (a no-grad, eval-mode call of the model being trained) is the span's now."""
    stepwatch, mem, start = sw
    start()
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    val = DataLoader(_SlowSamples(24, 1), batch_size=4)

    def fgsm(val):
        m.eval()
        for x, y in val:
            x = x.clone().requires_grad_(True)
            (g,) = torch.autograd.grad(nn.functional.mse_loss(m(x), y), x)
            with torch.no_grad():
                m(x + 0.1 * g.sign())
        m.train()

    walls = _train_with_validation(m, opt, val, fgsm)
    stepwatch.shutdown()
    recs = [r for r in mem.records if not r.tail]
    # A step's own backward (the steps before each validation: none has one before it).
    own = statistics.median(r.backward_s for r in recs[1:4] + recs[5:8])
    for r, wall in _after_each_validation(mem, walls):
        # 24 samples of 1 ms each: the evaluation's fetches alone take 24 ms.
        assert 0.024 <= r.eval_s <= wall + 0.002, (wall, r)
        # Its 6 input gradients, each about a step's backward, were this step's.
        assert r.tail or r.backward_s < 3 * own, (own, r)
    assert [r.samples for r in recs] == [8] * 8, [r.samples for r in recs]


def test_a_model_trained_in_eval_mode_keeps_its_backward_after_its_validation(sw):
    """Fine-tuned in eval mode (dropout and batch-norm updates off), validated under
    ``torch.no_grad()``: the validation's calls judge its span evaluation; the next step's fetch
    ends it, and that step's forward, in eval mode with grad, is no part of it. With a backward
    inside an open span being the span's (an FGSM evaluation's input gradients), the judged
    span took the next step's backward too (backward_s 0, eval_s the step): a training fetch
    between makes the span be judged again."""
    stepwatch, mem, start = sw
    start()
    m = _model().eval()
    opt = torch.optim.SGD(m.parameters(), lr=0.01)

    def validate(val):
        with torch.no_grad():
            for x, _ in val:
                m(x)

    _train_with_validation(m, opt, DataLoader(_SlowSamples(8, 1), batch_size=4), validate)
    stepwatch.shutdown()
    recs = [r for r in mem.records if not r.tail]
    assert len(recs) == 8
    _all_identity(recs)
    assert all(r.backward_s > 0 for r in recs), [(r.step, r.backward_s, r.eval_s) for r in recs]
    assert recs[4].eval_s >= 0.008 * 0.9, recs[4]  # the validation's 8 samples of 1 ms


@pytest.mark.parametrize("iterations", [2, 6])
def test_an_adversarial_training_step_in_eval_mode_is_the_steps_work(sw, iterations):
    """TRADES: each step first searches its adversarial batch with the model in eval mode (input
    gradients, ``autograd.grad``, a few iterations on the step's own batch), then trains on the
    clean and the adversarial batch in train mode. The search is the step's work (forward and
    backward), never evaluation; its calls are no samples: the step's samples are its two
    train-mode calls' (the clean and the adversarial batch; each of the search's calls was
    counted too: 64 samples a step with 3 iterations, 176 with 10)."""
    stepwatch, mem, start = sw
    start()
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    train = DataLoader(torch.utils.data.TensorDataset(torch.randn(48, 16), torch.randn(48, 4)), batch_size=8)
    for x, y in train:
        m.eval()
        x_adv = x + 0.001 * torch.randn_like(x)
        for _ in range(iterations):
            x_adv.requires_grad_(True)
            (g,) = torch.autograd.grad(nn.functional.mse_loss(m(x_adv), m(x)), x_adv)
            x_adv = x_adv.detach() + 0.01 * g.sign()
        m.train()
        opt.zero_grad()
        (nn.functional.mse_loss(m(x), y) + nn.functional.mse_loss(m(x_adv), y)).backward()
        opt.step()
    stepwatch.shutdown()
    recs = [r for r in mem.records if not r.tail]
    assert len(recs) == 6
    _all_identity(recs)
    assert all(r.eval_s == 0 and r.forward_s > 0 and r.backward_s > 0 for r in recs), recs
    assert [r.samples for r in recs] == [16] * 6, [r.samples for r in recs]


@pytest.mark.parametrize("grad_off", ["around the loop", "around the call"])
def test_a_validation_with_loader_workers_is_evaluation_from_iter_to_its_end(sw, grad_off):
    """The ImageNet example's ``validate`` (and HF's, whose fetches run with grad enabled): a
    DataLoader with workers, not persistent, so ``iter(val_loader)`` starts them and the fetch
    that ends the loop (StopIteration) joins them. Both are the evaluation's: they used to be the
    next step's ``other_s`` and ``data_wait_s``, a step many times its neighbours."""
    stepwatch, mem, start = sw
    start()
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    val = DataLoader(_SlowSamples(8, 1), batch_size=4, num_workers=2)

    def validate(val):
        if grad_off == "around the loop":
            with torch.no_grad():
                for x, _ in val:
                    m(x)
        else:
            for x, _ in val:
                with torch.no_grad():
                    m(x)

    walls = _train_with_validation(m, opt, val, validate, every=3, steps=7)
    stepwatch.shutdown()
    recs = [r for r in mem.records if not r.tail]
    assert len(recs) == 7 and len(walls) == 2
    _all_identity(recs)
    for k, wall in zip((3, 6), walls):
        r = recs[k]
        assert wall * 0.9 - 0.002 <= r.eval_s <= wall + 0.002, (wall, r)
        # Neither in the step: its data wait and other time are small. (Its forward and backward
        # may be slow: right after a fork the parent's first writes copy pages.)
        assert r.data_wait_s + r.other_s < wall * 0.1, (wall, r)


class _SlowFile(io.RawIOBase):
    """A file object whose writes are slow (a network filesystem)."""

    def __init__(self):
        self.n = 0

    def writable(self):
        return True

    def write(self, b):
        time.sleep(0.002)
        self.n += len(b)
        return len(b)


def test_a_save_on_another_thread_is_no_part_of_any_step(sw):
    """Asynchronous checkpointing by hand: ``torch.save`` on a thread while training goes on. The
    training thread never waits for it, so no step loses its time, and it ends no step. It used
    to be subtracted from the step it ended in (``step_s`` 0 with every phase > 0), and its
    ``checkpoint_begin`` finalized the training thread's pending step."""
    import threading

    stepwatch, mem, start = sw
    start()
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 4))
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    clock, saver, f = [], None, _SlowFile()
    for i in range(40):
        opt.zero_grad()
        m(torch.randn(8, 64)).sum().backward()
        opt.step()
        clock.append(time.perf_counter())
        time.sleep(0.003)  # in every step after the first, whatever the saving thread does
        if i == 3:
            state = {k: v.clone() for k, v in m.state_dict().items()}
            saver = threading.Thread(target=torch.save, args=(state, f))
            saver.start()
    saver.join()
    stepwatch.shutdown()
    assert f.n > 100  # the save ran, and took
    recs = mem.records
    assert [r.step for r in recs] == list(range(40))  # no tail, no step more or less
    _all_identity(recs)
    assert all(r.checkpoint_s == 0 for r in recs), [r.checkpoint_s for r in recs]
    assert all(r.step_s >= 0.003 * 0.9 for r in recs[1:]), [r.step_s for r in recs]
    assert abs(sum(r.step_s for r in recs[1:]) / (clock[-1] - clock[0]) - 1) < 0.05


class _Flaky(torch.optim.SGD):
    """An optimizer whose third step raises (an OOM on Adam's first state allocation, a check in
    a custom optimizer), as a loop that catches and skips the batch sees it."""

    def __init__(self, params, fail_at=3, **kw):
        super().__init__(params, **kw)
        self.calls, self.fail_at = 0, fail_at

    def step(self, closure=None):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("out of memory (simulated)")
        return super().step(closure)


class _Outer(torch.optim.Optimizer):
    """An optimizer that steps another inside its own step (Lookahead's shape)."""

    def __init__(self, inner):
        self.inner = inner
        super().__init__([p for g in inner.param_groups for p in g["params"]], {})

    def step(self, closure=None):
        return self.inner.step(closure)


@pytest.mark.parametrize("how", ["step", "closure", "nested"])
def test_an_optimizer_step_that_raises_and_is_skipped_keeps_every_later_step(sw, how):
    """torch runs no step post-hook when ``step()`` raises: the optimizer phase stayed open for
    good, each later step extended it, and no later step ever ended (9 steps, 2 records). Now a
    step that begins while a stale one is open drops it; an optimizer stepping another inside its
    own step (nested: two of torch's step wrappers on the stack) is still one step. The failed
    iteration is a record of its own, ``skipped``, with no optimizer time (it merged into the
    next one's, until ``_opt_raised``); in ``step(closure)`` the step raised before its closure
    ran: that iteration did nothing else."""
    stepwatch, mem, start = sw
    start()
    model = _model()
    if how == "nested":
        opt = _Outer(torch.optim.SGD(model.parameters(), lr=0.01))
    else:
        opt = _Flaky(model.parameters(), lr=0.01)
    done = 0
    for _ in range(10):
        x, y = torch.randn(8, 16), torch.randn(8, 4)
        done += step_or_fail(model, opt, x, y, closure=how == "closure")
    stepwatch.shutdown()
    recs = [r for r in mem.records if not r.tail]
    assert done == (10 if how == "nested" else 9)
    assert len(recs) == 10, [r.step for r in recs]
    _all_identity(recs)
    failed = [] if how == "nested" else [2]
    assert [i for i, r in enumerate(recs) if r.skipped] == failed, recs
    assert all(r.optimizer_s == 0 for i, r in enumerate(recs) if i in failed), recs
    assert all(r.forward_s > 0 for i, r in enumerate(recs) if i not in failed or how == "step"), recs
    # every forward's batch counted once (the one that found the stale phase was observed before
    # it did: its batch is in the failed step's samples, and the next step has none)
    assert sum(r.samples or 0 for r in recs) == 8 * (9 if how == "closure" else 10), [r.samples for r in recs]


def test_flops_follow_the_layers_that_train_after_unfreezing(sw):
    """Progressive unfreezing: the backbone frozen for the first steps, then ``requires_grad_``.
    The backward's FLOPs depend on which parameters train, which no input signature shows: the
    count stayed the frozen model's for good. The roots' trainable parameters are checked every
    ``RECHECK_EVERY`` steps; from the check after the unfreeze on, the count is the new one."""
    from torch.utils.flop_counter import FlopCounterMode

    from stepwatch.metrics.tokens import ThroughputCollector

    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))

    def truth(frozen):
        m = make()
        m[:3].requires_grad_(not frozen)
        with FlopCounterMode(display=False) as fc:
            nn.functional.cross_entropy(m(torch.randn(16, 8)), torch.randint(0, 4, (16,))).backward()
        return fc.get_total_flops()

    frozen, whole = truth(True), truth(False)
    assert frozen < whole
    every = ThroughputCollector.RECHECK_EVERY
    stepwatch, mem, start = sw
    start()
    m = make()
    m[:3].requires_grad_(False)
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    for i in range(every + 4):
        if i == 3:
            m[:3].requires_grad_(True)
        opt.zero_grad()
        nn.functional.cross_entropy(m(torch.randn(16, 8)), torch.randint(0, 4, (16,))).backward()
        opt.step()
    stepwatch.shutdown()
    flops = [r.flops for r in mem.records if not r.tail]
    assert flops[:3] == [frozen] * 3
    assert flops[every + 1:] == [whole] * 3, flops


def test_an_lbfgs_step_counts_its_batch_once_and_the_flops_of_every_evaluation(sw):
    """LBFGS calls the closure (forward and backward of the same batch) up to ``max_iter`` times in
    one ``step``: ``samples`` and ``tokens`` summed every evaluation, 5 x the batch here. The
    batch is the step's; the FLOPs are those of every evaluation (the device ran them all)."""
    stepwatch, mem, start = sw
    start()
    m = _model()
    opt = torch.optim.LBFGS(m.parameters(), lr=0.1, max_iter=5, tolerance_grad=0, tolerance_change=0)
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    calls = []

    def closure():
        calls.append(1)
        opt.zero_grad()
        loss = nn.functional.mse_loss(m(x), y)
        loss.backward()
        return loss

    steps = 4
    for _ in range(steps):
        opt.step(closure)
    stepwatch.shutdown()
    recs = mem.records
    assert len(recs) == steps and len(calls) > steps, (len(recs), len(calls))
    assert [r.samples for r in recs] == [8] * steps
    # One evaluation, 2 FLOPs a multiply-add: the forward's two matmuls; the backward's gradients
    # of both weights and of the second layer's input (the batch itself needs none).
    one = 2 * 8 * (16 * 32 + 32 * 4) + 2 * 8 * (16 * 32 + 2 * 32 * 4)
    assert sum(r.flops for r in recs) == pytest.approx(one * len(calls), rel=0.05), [r.flops for r in recs]


def test_a_batch_first_model_whose_first_batch_is_square_still_counts_its_batch(sw):
    """Dynamic padding: the first batch is 4 x 4, so its layout says nothing, and the layout was
    never looked at again: every later step counted its sequence length (10, 7) as samples."""
    stepwatch, mem, start = sw
    start()
    torch.manual_seed(0)
    m = BatchFirstEncoder()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for seq in (4, 10, 7):
        m(torch.randint(0, 50, (4, seq))).sum().backward()
        opt.step()
        opt.zero_grad()
    stepwatch.shutdown()
    assert [r.samples for r in mem.records] == [4] * 3
    assert [r.tokens for r in mem.records] == [16, 40, 28]


class PackedLM(nn.Module):
    """An RNN language model called with a ``PackedSequence`` of token ids (variable lengths)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 8)
        self.rnn = nn.GRU(8, 8)
        self.out = nn.Linear(8, 50)

    def forward(self, packed):
        emb = nn.utils.rnn.PackedSequence(self.emb(packed.data), packed.batch_sizes, packed.sorted_indices,
                                          packed.unsorted_indices)
        out, _ = self.rnn(emb)
        return self.out(out.data)


def test_a_packed_sequence_batch_counts_its_sequences_and_their_tokens(sw):
    """``model(pack_sequence(seqs))``: a PackedSequence is a tuple, so the rule "the first element
    of a tuple passed first" took its flat ``data`` ([all tokens]) and counted every token as a
    sample, with tokens unknown. Its sequences are the samples, its data's rows the tokens (no
    padding in a packed batch)."""
    stepwatch, mem, start = sw
    start()
    torch.manual_seed(0)
    m = PackedLM()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    lengths = [(5, 3, 7), (2, 9, 4), (6, 6, 1)]
    for ls in lengths:
        seqs = [torch.randint(0, 50, (n,)) for n in ls]
        packed = nn.utils.rnn.pack_sequence(seqs, enforce_sorted=False)
        nn.functional.cross_entropy(m(packed), packed.data).backward()
        opt.step()
        opt.zero_grad()
    stepwatch.shutdown()
    assert [r.samples for r in mem.records] == [3] * 3
    assert [r.tokens for r in mem.records] == [sum(ls) for ls in lengths]


def test_a_save_before_the_first_step_is_not_taken_out_of_it(sw, tmp_path):
    """Saving the initial weights before the loop: step 0's window opened at its first training
    work, after the save, yet the save's time was taken out of it (step_s 0 for a large save, and
    the phases came to more than step_s). The save now opens step 0, as an evaluation does."""
    stepwatch, mem, start = sw
    start()
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256))
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    torch.save(m.state_dict(), tmp_path / "init.pt")
    x = torch.randn(64, 256)
    for _ in range(3):
        (m(x) - x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    stepwatch.shutdown()
    recs = mem.records
    assert len(recs) == 3
    _all_identity(recs)
    r = recs[0]
    assert r.checkpoint_s > 0 and r.checkpoint_bytes and r.step_s >= r.forward_s + r.backward_s + r.optimizer_s > 0, r


class _SleepInEval(nn.Module):
    """2 ms of work per call in eval mode (an evaluation's forward), none in training."""

    def forward(self, x):
        if not self.training:
            time.sleep(0.002)
        return x


def test_a_model_copied_after_training_began_is_found_and_its_evaluation_is_eval_s(sw):
    """timm's ModelEmaV2 made after the first steps: ``copy.deepcopy(model)`` at step 5, with no
    optimizer of its own, so no scan found it; its evaluation (``no_grad``, 8 calls) was the next
    step's ``other_s``, a step many times its neighbours. Copying a hooked model now looks for new
    roots at the step's end."""
    import copy

    stepwatch, mem, start = sw
    start()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), _SleepInEval(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ema = None
    for step in range(20):
        nn.functional.mse_loss(model(torch.randn(8, 16)), torch.randn(8, 4)).backward()
        opt.step()
        opt.zero_grad()
        if step == 5:
            ema = copy.deepcopy(model).eval()
        if step in (9, 14):
            with torch.no_grad():
                for _ in range(8):
                    ema(torch.randn(8, 16))
    stepwatch.shutdown()
    recs = [r for r in mem.records if not r.tail]
    assert len(recs) == 20
    _all_identity(recs)
    for r in (recs[10], recs[15]):  # the step after each evaluation
        assert r.eval_s >= 0.016 * 0.9 and r.other_s < 0.008, r
    assert not [f for f in mem.findings if f.kind == "step_time_spike"]


def test_a_scan_at_a_steps_end_is_no_phase_of_the_next_step(sw, monkeypatch):
    """The scan a model copy schedules for the step's end (an EMA made after training began) runs
    inside the next hook that finalizes the step: a fetch, a forward or a backward. It took 0.24 s
    on a heap of 2M objects; that time is kept out of ``step_s``, but it was the fetch's
    ``data_wait_s`` (the phase's start was read before the step's end ran), so the step's parts
    came to 50 times ``step_s``. The scan is slowed here by 0.2 s (``gc.get_objects``)."""
    import copy
    import gc

    stepwatch, mem, start = sw
    start()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(torch.utils.data.TensorDataset(torch.randn(48, 10), torch.randint(0, 2, (48,))), batch_size=8)
    real_get_objects = gc.get_objects

    def slow_get_objects(*a):
        time.sleep(0.2)
        return real_get_objects(*a)

    ema = None
    for step, (x, y) in enumerate(loader):
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        if step == 1:
            monkeypatch.setattr(gc, "get_objects", slow_get_objects)
            ema = copy.deepcopy(model)
    monkeypatch.setattr(gc, "get_objects", real_get_objects)
    stepwatch.shutdown()
    assert ema is not None
    recs = [r for r in mem.records if not r.tail]
    assert len(recs) == 6
    for r in recs:
        parts = r.data_wait_s + r.forward_s + r.backward_s + r.optimizer_s
        assert parts <= r.step_s + 1e-6, r
        assert r.step_s < 0.15 and r.data_wait_s < 0.15, r
    _all_identity(recs)


class _Detector(nn.Module):
    """A stand-in for torchvision's detection models (Faster R-CNN, RetinaNet, Mask R-CNN): called
    as ``model(images, targets)``, images a list of per-sample ``[C, H, W]`` tensors of varying
    size, targets a list of one dict per image; returns a dict of losses."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.head = nn.Linear(8, 4)

    def forward(self, images, targets=None):
        feats = torch.cat([self.conv(im.unsqueeze(0)).mean((2, 3)) for im in images])
        boxes = self.head(feats)
        return {"loss_box": nn.functional.smooth_l1_loss(boxes, torch.stack([t["boxes"] for t in targets]))}


@pytest.mark.parametrize("targets_as", ["positional", "keyword"])
def test_a_detection_models_list_of_images_counts_one_sample_per_image(sw, targets_as):
    """``model(images, targets)`` with a list of ``[3, H, W]`` images: the rule for a list passed
    first read dim 0 of its first element, so every step counted 3 samples (the channels)
    whatever the batch. A list of tensors passed with a list of one target dict per element is
    one sample per element."""
    stepwatch, mem, start = sw
    start()
    torch.manual_seed(0)
    model = _Detector()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sizes = [2, 3, 4, 5, 1, 2]
    for bs in sizes:
        images = [torch.randn(3, 32 + 8 * j, 32) for j in range(bs)]
        targets = [{"boxes": torch.rand(4), "labels": torch.tensor(1)} for _ in range(bs)]
        losses = model(images, targets) if targets_as == "positional" else model(images, targets=targets)
        sum(losses.values()).backward()
        opt.step()
        opt.zero_grad()
    stepwatch.shutdown()
    recs = [r for r in mem.records if not r.tail]
    assert [r.samples for r in recs] == sizes
    assert all(r.tokens is None for r in recs)
    _all_identity(recs)


def test_a_collated_list_passed_first_still_counts_its_batch(sw):
    """The rule for a list or tuple passed first is unchanged where it is not per-sample: a
    collated ``[inputs, lengths]`` batch handed to the model whole counts the batch (dim 0 of its
    first element)."""
    stepwatch, mem, start = sw
    start()
    torch.manual_seed(0)

    class Unpacks(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(6, 2)

        def forward(self, batch):
            x, lengths = batch
            return self.lin(x).sum(1) / lengths.unsqueeze(1)

    model = Unpacks()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for bs in (4, 7, 3):
        out = model([torch.randn(bs, 5, 6), torch.full((bs,), 5.0)])
        out.sum().backward()
        opt.step()
        opt.zero_grad()
    stepwatch.shutdown()
    assert [r.samples for r in mem.records if not r.tail] == [4, 7, 3]


@pytest.mark.parametrize("optimizers", ["one", "two"])
def test_two_models_trained_in_turn_each_count_their_batch(sw, optimizers):
    """An actor and a critic (or any two models) trained in turn, each step after its own forward:
    the model of a step is the first root it calls. The first model called became the model for
    good, and the other's steps recorded ``samples`` null (every second step of an actor-critic
    loop); the FLOPs were right. When both are called in one step, only the first counts."""
    stepwatch, mem, start = sw
    start()
    torch.manual_seed(0)
    actor = nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 3))
    critic = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
    if optimizers == "two":
        oa, oc = torch.optim.Adam(actor.parameters(), 1e-3), torch.optim.Adam(critic.parameters(), 1e-3)
    else:
        oa = oc = torch.optim.SGD(list(actor.parameters()) + list(critic.parameters()), lr=1e-3)
    want = []
    for i in range(6):
        obs = torch.randn(16, 6)
        v = critic(obs)
        (v - torch.randn(16, 1)).pow(2).mean().backward()
        oc.step()
        oc.zero_grad()
        want.append(16)
        obs = torch.randn(8, 6)
        logits = actor(obs)
        aloss = -(torch.log_softmax(logits, -1)[:, 0]).mean()
        if i >= 3:  # the critic in the actor's step too (its value in the actor's loss): not counted again
            aloss = aloss + critic(obs).mean()
        aloss.backward()
        oa.step()
        oa.zero_grad()
        want.append(8)
    stepwatch.shutdown()
    recs = [r for r in mem.records if not r.tail]
    assert [r.samples for r in recs] == want
    assert all(r.flops is not None and r.flops > 0 for r in recs)
    _all_identity(recs)


@pytest.mark.parametrize("boundary", ["auto", "explicit"])
def test_a_fused_optimizer_that_the_scaler_skips_is_marked_skipped(sw, boundary):
    """``Adam(fused=True)`` under GradScaler: the scaler hands the optimizer ``found_inf`` and
    calls its step, which skips the update itself. An optimizer step ran, so the step was
    recorded ``skipped: false`` where the same loop with a plain Adam says true (the usual fp16
    setup on GPUs with a fused optimizer). The scaler's ``found_inf`` says, read here at once
    (CPU) or through a device copy the pipeline reads (CUDA)."""
    stepwatch, mem, start = sw
    start(step_boundary=boundary)
    torch.manual_seed(0)
    m = nn.Linear(8, 1)
    opt = torch.optim.Adam(m.parameters(), lr=0.01, fused=True)
    scaler = torch.amp.GradScaler("cpu")
    weights = []
    for i in range(5):
        x = torch.randn(4, 8)
        if i == 2:
            x[0, 0] = float("inf")
        scaler.scale(m(x).pow(2).mean()).backward()
        before = m.weight.detach().clone()
        scaler.step(opt)
        scaler.update()
        weights.append(torch.equal(before, m.weight.detach()))
        opt.zero_grad()
        if boundary == "explicit":
            stepwatch.step()
    stepwatch.shutdown()
    assert weights == [False, False, True, False, False]  # the optimizer did skip step 2 itself
    assert [(r.step, r.skipped) for r in mem.records if not r.tail] == [
        (0, False), (1, False), (2, True), (3, False), (4, False)]
    _all_identity([r for r in mem.records if not r.tail])


def test_an_optimizer_step_that_raises_inside_the_backward_counts_no_time_twice(sw):
    """An optimizer step in backward that raises (a guard refusing a non-finite update): torch
    runs no post-hook, the backward raises out, the loop skips the iteration. No time of that
    backward is counted twice: the phases still add up to step_s in every record."""
    stepwatch, mem, start = sw
    start()
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    refuse = [False]

    class Guarded(torch.optim.SGD):
        def step(self, closure=None):  # torch's wrapper ran the pre-hooks already
            if refuse[0]:
                time.sleep(0.01)
                raise FloatingPointError("non-finite update refused")
            return super().step(closure)

    opts = {p: Guarded([p], lr=1e-3) for p in m.parameters()}

    def hook(p):
        opts[p].step()
        opts[p].zero_grad()

    for p in m.parameters():
        p.register_post_accumulate_grad_hook(hook)
    for i in range(5):
        refuse[0] = i == 2
        try:
            m(torch.randn(8, 16)).pow(2).mean().backward()
        except FloatingPointError:
            for p in m.parameters():
                p.grad = None
    stepwatch.shutdown()
    recs = [r for r in mem.records if not r.tail]
    assert len(recs) == 4
    _all_identity(recs)


def test_a_user_phase_around_the_forward_leaves_out_stepwatchs_flop_count(sw):
    """``with stepwatch.phase("fwd"): model(x)``: the FLOP count at a new input signature runs in
    the root call, before the forward, and is kept out of step_s and forward_s; the user's phase
    around the call took it in (a spike in that phase at every new shape)."""
    stepwatch, mem, start = sw
    start()
    torch.manual_seed(0)
    m = nn.Sequential(*[nn.Linear(64, 64) for _ in range(40)])  # a count takes ~100 ms
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    for i in range(6):
        x = torch.randn(4 + i % 3, 64)  # three signatures: three counts
        with stepwatch.phase("fwd"):
            loss = m(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    stepwatch.shutdown()
    recs = [r for r in mem.records if not r.tail]
    assert len(recs) == 6 and all(r.flops for r in recs)
    # 30 ms of slack: a loaded machine's pauses land in the phase (it holds the loss's ops too),
    # and are well under the count they would hide.
    assert all(r.phases["fwd"] <= r.forward_s + 0.03 for r in recs), [(r.phases["fwd"], r.forward_s) for r in recs]


class _SlowStartLoader(DataLoader):
    """A loader whose iterator takes 50 ms to make, as starting non-persistent workers does at
    every epoch (``DataLoader.__iter__`` calls ``_get_iterator`` each time)."""

    def _get_iterator(self):
        time.sleep(0.05)
        return super()._get_iterator()


def test_an_epochs_iterator_start_is_data_wait(sw):
    """``for x, y in loader:`` each epoch: the iterator's start (non-persistent workers start
    there) is the loop waiting for data, as the first fetch is. It was other_s, so an epoch
    start with slow workers did not read as data loading."""
    stepwatch, mem, start = sw
    start()
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    loader = _SlowStartLoader(TransformData(8), batch_size=4)
    loader.dataset.transform = nn.Identity()  # no 2 ms transforms here
    for _ in range(3):
        for x, y in loader:
            nn.functional.mse_loss(m(x), y).backward()
            opt.step()
            opt.zero_grad()
    stepwatch.shutdown()
    recs = [r for r in mem.records if not r.tail]
    assert len(recs) == 6
    _all_identity(recs)
    firsts = [recs[2], recs[4]]  # the first steps of epochs 2 and 3
    assert all(r.data_wait_s >= 0.05 and r.other_s < 0.02 for r in firsts), [(r.data_wait_s, r.other_s) for r in firsts]


class _SlowEndDataset(Dataset):
    """12 samples; asking for the 13th index (the end) takes 40 ms, as a non-persistent
    loader's workers shutting down at StopIteration does."""

    def __len__(self):
        return 12

    def __getitem__(self, i):
        return torch.randn(16), torch.randn(4)


class _SlowEndSampler(torch.utils.data.Sampler):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __iter__(self):
        yield from range(self.n)
        time.sleep(0.04)  # the iterator's end: after the last batch, before StopIteration


def test_the_training_loaders_end_is_not_the_next_evaluations(sw):
    """timm's and torchvision's epoch: train over the loader, then validate under no_grad. The
    training loader's last fetch (StopIteration, grad enabled) came before the evaluation; it
    was taken into eval_s as 'the fetch right before' the span."""
    stepwatch, mem, start = sw
    start()
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    train = DataLoader(_SlowEndDataset(), batch_size=4, sampler=_SlowEndSampler(12))
    val = DataLoader(_SlowEndDataset(), batch_size=4)
    evals = []
    for _ in range(2):
        for x, y in train:
            nn.functional.mse_loss(m(x), y).backward()
            opt.step()
            opt.zero_grad()
        t = time.perf_counter()
        with torch.no_grad():
            for x, _ in val:
                m(x)
        evals.append(time.perf_counter() - t)
    stepwatch.shutdown()
    got = [r.eval_s for r in mem.records if r.eval_s > 0]
    assert len(got) == 2
    assert all(g < e + 0.02 for g, e in zip(got, evals)), (got, evals)
    _all_identity([r for r in mem.records if not r.tail])


class _Wrapper(nn.Module):
    """Stand-in for DDP (or any wrapper module) made after the optimizer, as nanoGPT does:
    model -> configure_optimizers -> DDP(model). Its forward calls the model's."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, *a, **k):
        return self.module(*a, **k)


@pytest.mark.parametrize("when", ["before init", "after init"])
def test_a_wrapper_made_after_the_optimizer_counts_every_micro_batch_of_step_0(sw, when):
    """The inner model is a root from the optimizer's scan and opens step 0; the wrapper is
    found at the first backward. Its calls opened no step, so they did not take over, and step 0
    counted the first micro-batch's samples only (8 of 32); later steps were right."""
    _accumulate_from_step_0(sw, when, _Wrapper)


class _Policy(nn.Module):
    """pytorch/examples' actor_critic: called with one unbatched state, ``model(state)``, with
    ``state`` of shape ``[4]``, once per environment step."""

    def __init__(self):
        super().__init__()
        self.affine1 = nn.Linear(4, 32)
        self.action_head = nn.Linear(32, 2)

    def forward(self, x):
        return torch.softmax(self.action_head(torch.relu(self.affine1(x))), dim=-1)


class _ScalarRegressor(nn.Module):
    """A batch of scalars ``[N]`` that the model turns into ``[N, 1]`` itself."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(1, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, x):
        return self.net(x.unsqueeze(1)).squeeze(1)


@pytest.mark.parametrize("make, shape, per_call", [(_Policy, (4,), 1), (_ScalarRegressor, (4,), 4),
                                                   (_ScalarRegressor, (7,), 7)],
                         ids=["unbatched state", "batch of 4 scalars", "batch of 7 scalars"])
def test_a_1d_input_is_one_sample_when_the_model_takes_it_unbatched(sw, make, shape, per_call):
    """A 1-D float input was read as a batch along its only dim: an RL policy called with one
    state of 4 features counted 4 samples a call. The model's first ``nn.Linear`` says which it
    is: given the whole vector as its features, one sample; a batch of scalars the model reshapes
    itself stays a batch."""
    stepwatch, mem, start = sw
    start()
    torch.manual_seed(0)
    m = make()
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    calls = [3, 5, 2, 4]
    for n in calls:  # one episode a step: n environment steps, one call each
        out = [m(torch.randn(*shape)).sum() for _ in range(n)]
        torch.stack(out).sum().backward()
        opt.step()
        opt.zero_grad()
    stepwatch.shutdown()
    recs = [r for r in mem.records if not r.tail]
    assert [r.samples for r in recs] == [n * per_call for n in calls]
    assert all(r.flops is not None and r.flops > 0 for r in recs)


class _NoisyOwnGenerator(nn.Module):
    """Noise and a dropout mask drawn from a generator the module owns; the ``.item()`` makes the
    FLOP count run on real tensors (fake ones have no values)."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(16, 32), nn.Linear(32, 4)
        self.gen = torch.Generator().manual_seed(1234)

    def forward(self, x):
        h = torch.relu(self.l1(x))
        if h.mean().item() > -1e9:
            h = h + 0.1 * torch.randn(h.shape, generator=self.gen)
            h = h * (torch.rand(h.shape, generator=self.gen) > 0.1) / 0.9
        return self.l2(h)


class _LayerDropOwnRandom(nn.Module):
    """LayerDrop with a seeded ``random.Random`` of its own (reproducible per model)."""

    def __init__(self):
        import random

        super().__init__()
        self.inp, self.out = nn.Linear(16, 32), nn.Linear(32, 4)
        self.layers = nn.ModuleList(nn.Linear(32, 32) for _ in range(6))
        self.rng = random.Random(42)

    def forward(self, x):
        x = torch.relu(self.inp(x))
        for layer in self.layers:
            if self.rng.random() < 0.3:
                continue
            x = x + torch.relu(layer(x))
        return self.out(x)


@pytest.mark.parametrize("make", [_NoisyOwnGenerator, _LayerDropOwnRandom],
                         ids=["torch.Generator, real count", "random.Random, fake count"])
def test_a_model_drawing_from_its_own_generator_trains_the_same_with_stepwatch(sw, make):
    """The FLOP count's replay runs the forward once more, and it drew from the generator the
    model owns (the count restored only torch's, Python's and numpy's default ones): from step
    0 on, the noise, the masks and the dropped layers were not those of the same run without
    stepwatch, and the weights diverged. The weights are bit-identical now."""
    stepwatch, mem, start = sw

    def train():
        torch.manual_seed(0)
        m = make()
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(1)
        for _ in range(4):
            x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
            nn.functional.mse_loss(m(x), y).backward()
            opt.step()
            opt.zero_grad()
        return m.state_dict()

    plain = train()
    start()
    watched = train()
    stepwatch.shutdown()
    recs = [r for r in mem.records if not r.tail]
    assert len(recs) == 4 and all(r.flops and r.flops > 0 for r in recs), [r.flops for r in recs]
    assert all(torch.equal(plain[k], watched[k]) for k in plain)


class _ListOfImages(nn.Module):
    """Takes a list of per-sample ``[3, H, W]`` images of different sizes and pools each."""

    def __init__(self):
        super().__init__()
        self.conv, self.out = nn.Conv2d(3, 8, 3, padding=1), nn.Linear(8, 5)

    def forward(self, images):
        return self.out(torch.cat([self.conv(im[None]).relu().mean((2, 3)) for im in images]))


class _ListOfSequences(nn.Module):
    """Takes a list of variable-length 1-D token id sequences and pads them itself."""

    def __init__(self):
        super().__init__()
        self.emb, self.out = nn.Embedding(50, 8, padding_idx=0), nn.Linear(8, 5)

    def forward(self, seqs):
        x = nn.utils.rnn.pad_sequence(seqs, batch_first=True)
        keep = (x != 0).unsqueeze(-1).float()
        return self.out((self.emb(x) * keep).sum(1) / keep.sum(1))


@pytest.mark.parametrize("kind", ["images", "sequences"])
def test_a_list_of_per_sample_tensors_counts_one_sample_per_tensor(sw, kind):
    """``model([img_0, img_1, ...])`` with per-sample ``[3, H_i, W_i]`` images counted 3 samples a
    step (the first image's channels); ``model([ids_0, ids_1, ...])`` with variable-length id
    sequences counted the first one's length as samples and no tokens. Each tensor is a sample,
    and the ids are the tokens."""
    stepwatch, mem, start = sw
    start()
    torch.manual_seed(0)
    m = _ListOfImages() if kind == "images" else _ListOfSequences()
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    sizes = [6, 7, 8, 6]
    lengths = []
    for step, n in enumerate(sizes):
        if kind == "images":
            batch = [torch.randn(3, 20 + 4 * ((i + step) % 3), 24) for i in range(n)]
        else:
            batch = [torch.randint(1, 50, (5 + (3 * i + step) % 11,)) for i in range(n)]
        lengths.append(sum(len(b) for b in batch))
        nn.functional.cross_entropy(m(batch), torch.randint(0, 5, (n,))).backward()
        opt.step()
        opt.zero_grad()
    stepwatch.shutdown()
    recs = [r for r in mem.records if not r.tail]
    assert [r.samples for r in recs] == sizes
    assert [r.tokens for r in recs] == ([None] * 4 if kind == "images" else lengths)


@pytest.mark.parametrize("slow, found", [(True, True), (False, False)], ids=["slow loader", "fast loader"])
def test_a_run_shorter_than_one_window_is_judged_for_data_loading_at_its_end(sw, slow, found):
    """A first try: 30 steps, each waiting 20 ms for its batch (the default window is 50 steps).
    The run ended before a window filled, and no data_loading finding was ever raised. A run that
    never filled a window is judged at its end on its steps after the first (step 0 waits for the
    workers to start, in any run); the same run with a fast loader has none."""
    stepwatch, mem, start = sw
    start()
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    loader = DataLoader(_SlowSamples(60, 10 if slow else 0), batch_size=2)
    for x, y in loader:
        nn.functional.mse_loss(m(x), y).backward()
        opt.step()
        opt.zero_grad()
    stepwatch.shutdown()
    got = [f for f in mem.findings if f.kind == "data_loading"]
    assert len([r for r in mem.records if not r.tail]) == 30
    if found:
        assert len(got) == 1 and got[0].data["first_step"] == 1 and got[0].data["last_step"] == 29, got
        assert got[0].data["mean_wait_ms"] >= 20, got
    else:
        assert got == [], got


class _LazyTarget(nn.Module):
    """lucidrains/byol-pytorch's target encoder: made with ``copy.deepcopy`` at the first forward."""

    def __init__(self):
        super().__init__()
        self.online = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
        self.target = None

    def forward(self, x):
        import copy

        if self.target is None:
            self.target = copy.deepcopy(self.online)
            for p in self.target.parameters():
                p.requires_grad = False
        with torch.no_grad():
            t = self.target(x)
        return ((self.online(x) - t) ** 2).mean()


def test_a_forward_that_deepcopies_a_module_gets_no_warning_from_the_flop_count(sw):
    """The FLOP count replays the forward on fake tensors, where ``copy.deepcopy`` of a module reads
    each tensor's data pointer: torch warned "Accessing the data pointer of FakeTensor is
    deprecated ... almost definitely a bug in your code", a line the script without stepwatch
    never prints. Under warnings-as-errors the deepcopy failed half way, and the half-built module
    it left on the heap crashed the module scan (``'Sequential' object has no attribute
    '_modules'``: discovery off for the rest of the run)."""
    import warnings

    stepwatch, mem, start = sw
    start()
    torch.manual_seed(0)
    m = _LazyTarget()
    opt = torch.optim.SGD(m.online.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(3):
            loss = m(torch.randn(4, 8))
            opt.zero_grad()
            loss.backward()
            opt.step()
    stepwatch.shutdown()
    assert not [w for w in seen if "FakeTensor" in str(w.message)], [str(w.message)[:80] for w in seen]
    assert len([r for r in mem.records if not r.tail]) == 3 and all(r.flops for r in mem.records if not r.tail)
    assert not [f for f in mem.findings if f.kind == "internal_error"], mem.findings


def test_a_half_built_module_on_the_heap_does_not_stop_the_scan(sw):
    """A module whose ``__init__`` never ran (a deepcopy or an unpickling that failed half way) is
    on the heap without ``_modules``: the scan crashed on it and stayed off for the rest of the run,
    so a model made later was never found. It is passed over."""
    stepwatch, mem, start = sw
    half = nn.Sequential.__new__(nn.Sequential)  # noqa: F841 - alive through the run
    start()
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for _ in range(3):
        nn.functional.mse_loss(m(torch.randn(4, 16)), torch.randn(4, 4)).backward()
        opt.step()
        opt.zero_grad()
    stepwatch.shutdown()
    assert not [f for f in mem.findings if f.kind == "internal_error"], mem.findings
    assert all(r.samples == 4 for r in mem.records if not r.tail), mem.records

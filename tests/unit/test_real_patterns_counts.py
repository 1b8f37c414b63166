"""Samples and tokens on call patterns real scripts use, each written as the script would be:
a Hugging Face model called with its ids positional and its mask as a keyword, a sweep (and a
resume) whose accumulation leaves an unstepped micro-batch behind, a parameter-free tokenizer
module called before the model. Each used to count something else than the model's batch."""

import gc
import io

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

pytestmark = pytest.mark.usefixtures("both_tracker_cores")  # tests/conftest.py


def _steps(mem):
    return [r for r in mem.records if not r.tail]


class TinyLM(nn.Module):
    """A causal LM with Hugging Face's call: ``forward(input_ids, attention_mask=None, labels=None)``."""

    def __init__(self, vocab=100, d=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.head = nn.Linear(d, vocab)

    def forward(self, input_ids, attention_mask=None, labels=None):
        h = self.emb(input_ids)
        if attention_mask is not None:
            h = h * attention_mask[..., None]
        logits = self.head(h)
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)


def test_ids_passed_positionally_with_a_mask_keyword_count_the_masks_ones(sw):
    """``model(ids, attention_mask=mask, labels=labels)``, the common way to call an HF model,
    counted the padding (48 tokens): the same batch as ``input_ids=`` counted the mask's 39."""
    stepwatch, mem, start = sw
    start()
    torch.manual_seed(0)
    m = TinyLM()
    opt = torch.optim.AdamW(m.parameters(), 1e-3)
    ids = torch.randint(3, 100, (4, 12))
    mask = torch.ones_like(ids)
    mask[0, 6:] = 0
    ids[0, 6:] = 0
    mask[1, 9:] = 0
    ids[1, 9:] = 0  # right padding
    labels = ids.masked_fill(mask == 0, -100)
    for keyword in (False, True, False):
        if keyword:
            loss = m(input_ids=ids, attention_mask=mask, labels=labels)
        else:
            loss = m(ids, attention_mask=mask, labels=labels)
        loss.backward()
        opt.step()
        opt.zero_grad()
    stepwatch.shutdown()
    recs = _steps(mem)
    assert [r.tokens for r in recs] == [39, 39, 39]
    assert [r.samples for r in recs] == [4, 4, 4]


def _mlp():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))


def _accumulate(model, opt, loader, k, stepped):
    """One epoch accumulating ``k`` micro-batches a step; a last group of fewer than ``k`` is
    forwarded and backwarded but never stepped (drop_last=False). The stepped steps' samples are
    appended to ``stepped``; returns the unstepped micro-batches' samples."""
    cur = 0
    for i, (x, y) in enumerate(loader):
        (F.cross_entropy(model(x), y) / k).backward()
        cur += len(x)
        if (i + 1) % k == 0:
            opt.step()
            opt.zero_grad()
            stepped.append(cur)
            cur = 0
    return cur


@pytest.mark.parametrize("collected", [False, True], ids=["old_model_alive", "old_model_collected"])
def test_a_sweeps_leftover_micro_batch_is_not_the_next_trials_first_step(sw, collected):
    """A sweep (a fresh model per trial) accumulating 3 micro-batches with drop_last=False: each
    trial ends with a micro-batch of 2 that was never stepped. The next trial's first step
    recorded that one's samples (2, the new model's calls not counted) and FLOPs of 14 samples."""
    stepwatch, mem, start = sw
    start()
    torch.manual_seed(0)
    ds = TensorDataset(torch.randn(26, 8), torch.randint(0, 2, (26,)))
    loader = DataLoader(ds, batch_size=4, drop_last=False)  # 7 batches: 4, 4, 4, 4, 4, 4, 2
    stepped = []
    for lr in (1e-2, 1e-3, 1e-4):
        model = _mlp()
        opt = torch.optim.Adam(model.parameters(), lr)
        assert _accumulate(model, opt, loader, 3, stepped) == 2
        if collected:
            del model, opt
            gc.collect()  # the trial's model is freed before the next one is called
    stepwatch.shutdown()
    recs = _steps(mem)
    assert stepped == [12] * 6
    assert [r.samples for r in recs] == stepped
    assert len({r.flops for r in recs}) == 1 and recs[0].flops > 0  # 12 samples' worth, every step


def test_a_resume_into_a_fresh_model_after_an_unstepped_micro_batch_counts_the_new_models_batch(sw):
    """Train, zero the leftover micro-batch's grads, checkpoint, and resume into a fresh model and
    optimizer (the old one still in scope): the resumed run's first step is the new model's."""
    stepwatch, mem, start = sw
    start()
    torch.manual_seed(0)
    ds = TensorDataset(torch.randn(50, 8), torch.randint(0, 2, (50,)))
    loader = DataLoader(ds, batch_size=4, drop_last=False)  # 13 batches, the last of 2
    model = _mlp()
    opt = torch.optim.Adam(model.parameters(), 1e-2)
    stepped = []
    assert _accumulate(model, opt, loader, 3, stepped) == 2  # 13 % 3: one unstepped micro-batch
    opt.zero_grad()
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    state = torch.load(buf)
    model2 = _mlp()
    opt2 = torch.optim.Adam(model2.parameters(), 1e-2)
    model2.load_state_dict(state["model"])
    opt2.load_state_dict(state["opt"])
    _accumulate(model2, opt2, loader, 3, stepped)
    stepwatch.shutdown()
    recs = _steps(mem)
    assert stepped == [12] * 8
    assert [r.samples for r in recs] == stepped
    assert len({r.flops for r in recs}) == 1


def test_a_head_switched_on_mid_run_adds_its_flops_to_the_models(sw):
    """An auxiliary head first used at step 6, fed the model's output, its parameters added to
    the optimizer: step 6 recorded the head's FLOPs alone (768 of 23296), the model's dropped as
    an unstepped micro-batch of a model before it. The head's input was computed in this step:
    it continues the model's micro-batch."""
    stepwatch, mem, start = sw
    start()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    head = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i in range(10):
        out = model(torch.randn(8, 16))
        if i >= 6:
            out = head(out)
        loss = out.pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if i == 5:
            opt.add_param_group({"params": head.parameters()})
    stepwatch.shutdown()
    recs = _steps(mem)
    fwd = 2 * 8 * (16 * 32 + 32 * 4)  # batch of 8
    body = 2 * fwd + 2 * 8 * 32 * 4  # backward: both weights' grads, the input grad of the second layer only
    head = 3 * 2 * 8 * 4 * 4  # its input (the model's output) needs a grad too
    assert (body, head) == (22528, 768)
    assert [r.flops for r in recs] == [body] * 6 + [body + head] * 4, [r.flops for r in recs]
    assert [r.samples for r in recs] == [8] * 10


class Tokenize(nn.Module):
    """A text transform as an nn.Module (torchtext's are): strings in, padded ids out; no parameters."""

    def forward(self, texts):
        n = max(map(len, texts))
        out = torch.zeros(len(texts), n, dtype=torch.long)
        for i, t in enumerate(texts):
            out[i, :len(t)] = torch.tensor([ord(c) % 50 + 1 for c in t])
        return out


TEXTS = ["abcdefghij", "klmnopqrst", "uvwxyzabcd", "hello worl", "0123456789"]


def test_a_parameter_free_tokenizer_module_called_first_does_not_take_the_models_role(sw):
    """The tokenizer, the first root called, was the model: samples and tokens null every step."""
    stepwatch, mem, start = sw
    start()
    torch.manual_seed(0)
    tok = Tokenize()
    model = nn.Sequential(nn.Embedding(51, 16), nn.Flatten(1), nn.Linear(160, 3))
    opt = torch.optim.Adam(model.parameters(), 1e-2)
    for _ in range(4):
        ids = tok(TEXTS)
        loss = F.cross_entropy(model(ids), torch.zeros(5, dtype=torch.long))
        loss.backward()
        opt.step()
        opt.zero_grad()
    stepwatch.shutdown()
    recs = _steps(mem)
    assert [(r.samples, r.tokens) for r in recs] == [(5, 50)] * 4


class Scale(nn.Module):
    """No parameters: a normalizing transform, or a model with nothing to train (its input does)."""

    def forward(self, x):
        return x * 2.0


def test_a_model_without_parameters_is_still_the_model_when_it_is_the_only_root(sw):
    stepwatch, mem, start = sw
    start()
    torch.manual_seed(0)
    model = Scale()
    x = torch.randn(6, 3, requires_grad=True)  # what trains is the input (an adversarial example)
    opt = torch.optim.SGD([x], lr=0.1)
    for _ in range(3):
        model(x).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    stepwatch.shutdown()
    assert [r.samples for r in _steps(mem)] == [6, 6, 6]


def test_a_parameter_free_transform_on_the_batch_before_the_model_gives_the_models_counts(sw):
    """A parameter-free module called on the ids before the model (an MLM masker): the model's
    call, with its mask, gives the step's counts (the mask's ones, not the masker's numel)."""

    class Masker(nn.Module):
        def forward(self, ids):
            return ids.masked_fill(ids % 7 == 0, 1)

    stepwatch, mem, start = sw
    start()
    torch.manual_seed(0)
    masker, m = Masker(), TinyLM()
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    ids = torch.randint(3, 100, (2, 10))
    mask = torch.ones_like(ids)
    mask[1, 4:] = 0
    for _ in range(3):
        loss = m(input_ids=masker(ids), attention_mask=mask, labels=ids)
        loss.backward()
        opt.step()
        opt.zero_grad()
    stepwatch.shutdown()
    assert [(r.samples, r.tokens) for r in _steps(mem)] == [(2, 14)] * 3


def test_a_frozen_encoder_between_the_tokenizer_and_a_trained_head_is_the_model(sw):
    """Tokenizer module, frozen encoder (grad enabled), trained head, each a root: the encoder,
    which has parameters, takes the role from the tokenizer; the head, first called within the
    step the encoder opened, leaves it there: the ids' tokens are the step's."""
    stepwatch, mem, start = sw
    start()
    torch.manual_seed(0)
    tok = Tokenize()
    encoder = nn.Sequential(nn.Embedding(51, 16), nn.Flatten(1), nn.Linear(160, 32)).requires_grad_(False)
    head = nn.Sequential(nn.ReLU(), nn.Linear(32, 3))
    opt = torch.optim.Adam(head.parameters(), 1e-2)
    for _ in range(4):
        loss = F.cross_entropy(head(encoder(tok(TEXTS))), torch.zeros(5, dtype=torch.long))
        loss.backward()
        opt.step()
        opt.zero_grad()
    stepwatch.shutdown()
    assert [(r.samples, r.tokens) for r in _steps(mem)] == [(5, 50)] * 4

"""Shared by the framework tests: a tiny causal LM built locally (no hub), its data, runners.

The same model and batches are trained by each framework and by a plain loop; the plain loop's
numbers (FLOPs per step) are the reference the framework runs are checked against.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SRC = os.path.join(ROOT, "src")
VOCAB, SEQ, D = 64, 16, 32


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, h):
        return h + self.down(F.gelu(self.up(self.norm(h))))


class Sleep(nn.Module):
    """Makes forward measurably long (ms), so a phase that wrongly contains it shows."""

    def __init__(self, seconds):
        super().__init__()
        self.seconds = seconds

    def forward(self, h):
        if self.seconds and not isinstance(h, torch._subclasses.FakeTensor):
            time.sleep(self.seconds)
        return h


class TinyLM(nn.Module):
    """Embedding, ``layers`` MLP blocks, LM head. Called like an HF model:
    ``model(input_ids=, attention_mask=, labels=)`` -> ``{"loss", "logits"}``."""

    def __init__(self, layers=2, d=D, sleep_s=0.0, dropout=0.0):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.sleep = Sleep(sleep_s)
        self.head = nn.Linear(d, VOCAB)

    def forward(self, input_ids, attention_mask=None, labels=None):
        h = self.drop(self.embed(input_ids))
        for b in self.blocks:
            h = b(h)
        logits = self.head(self.sleep(h))
        if labels is None:
            return logits
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        return {"loss": loss, "logits": logits}


def make_model(seed=0, **kw):
    torch.manual_seed(seed)
    return TinyLM(**kw)


class TokenData(torch.utils.data.Dataset):
    """Sample i: SEQ token ids, of which the first 8 + i % 8 are real (attention mask 1), the rest
    padding (mask 0, label -100). Deterministic in i."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(1000 + i)
        ids = torch.randint(0, VOCAB, (SEQ,), generator=g)
        mask = torch.zeros(SEQ, dtype=torch.long)
        mask[: 8 + i % 8] = 1
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def batch_of(indices):
    ds = TokenData(max(indices) + 1)
    items = [ds[i] for i in indices]
    return {k: torch.stack([it[k] for it in items]) for k in items[0]}


def tokens_of(indices):
    """Non-padding tokens of these samples (what the records' ``tokens`` must say)."""
    return sum(8 + i % 8 for i in indices)


def start(tmp_path, name, **cfg):
    """A stepwatch session for one run, with its own in-memory exporter."""
    import stepwatch

    mem = stepwatch.InMemoryExporter()
    cfg.setdefault("dir", str(tmp_path / name))
    cfg.setdefault("console", "off")
    cfg.setdefault("flush_interval_s", 0.05)
    cfg.setdefault("watchdog", "off")
    cfg.setdefault("capture", "off")
    stepwatch.init(exporters=[mem], **cfg)
    return mem


def plain_loop_flops(tmp_path, model, batch):
    """FLOPs of one optimizer step on ``batch`` in a plain loop under stepwatch (the reference)."""
    import stepwatch

    mem = start(tmp_path, "plain")
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    for _ in range(3):
        out = model(**batch)
        out["loss"].backward()
        opt.step()
        opt.zero_grad()
    stepwatch.shutdown()
    # Step 0's forward ran before the first backward found the root module (README): not counted.
    flops = [r.flops for r in mem.records][1:]
    assert len(flops) == 2 and flops[0] is not None and flops[0] == flops[1], flops
    return flops[0]


def no_internal_errors(mem):
    bad = [f for f in mem.findings if f.kind == "internal_error"]
    assert not bad, [f.summary for f in bad]


def identity_holds(r, tol=1e-6):
    parts = r.data_wait_s + r.forward_s + r.backward_s + r.optimizer_s + r.other_s
    return abs(parts - r.step_s) <= tol


def torchrun(script, args, env_extra, cwd, nproc=2, timeout=240):
    """Run ``script`` on ``nproc`` gloo ranks with torchrun, as a user would."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEPWATCH_")}
    env.update({"PYTHONPATH": SRC + os.pathsep + os.path.dirname(os.path.abspath(__file__)), "OMP_NUM_THREADS": "1"})
    env.update(env_extra)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), script, *args]
    r = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-6000:]
    return r


def read_jsonl(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]

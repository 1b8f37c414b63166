"""A small GPT-style model on synthetic tokens, trained with DDP, instrumented by one line.

    torchrun --nproc-per-node 2 examples/ddp_train.py --steps 60
    torchrun --nproc-per-node 2 examples/ddp_train.py --slow-data-ms 30      # a slow DataLoader
    torchrun --nproc-per-node 2 examples/ddp_train.py --slow-rank 1 --slow-rank-ms 20

gloo on CPU, NCCL on GPU. ``--no-stepwatch`` runs the same job without the import (used to check
that stepwatch does not change the training result).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

if "--no-stepwatch" not in sys.argv:
    import stepwatch.auto  # noqa: F401  -- the one line

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class Block(nn.Module):
    def __init__(self, d: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.drop(self.proj(a.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, seq: int, dropout: float) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        self.blocks = nn.Sequential(*[Block(d, heads, dropout) for _ in range(layers)])
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.head(self.ln(self.blocks(self.tok(idx) + self.pos(pos))))


class Tokens(Dataset):
    """Synthetic next-token data: deterministic per index, optionally slow."""

    def __init__(self, n: int, seq: int, vocab: int, slow_ms: float) -> None:
        self.n, self.seq, self.vocab, self.slow_s = n, seq, vocab, slow_ms / 1000.0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.slow_s:
            time.sleep(self.slow_s)
        g = torch.Generator().manual_seed(i)
        x = torch.randint(0, self.vocab, (self.seq + 1,), generator=g)
        return x[:-1], x[1:]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slow-data-ms", type=float, default=0.0, help="sleep per sample in the dataset")
    p.add_argument("--slow-rank", type=int, default=-1, help="this rank sleeps before every forward")
    p.add_argument("--slow-rank-ms", type=float, default=20.0)
    p.add_argument("--eval-every", type=int, default=0)
    p.add_argument("--ckpt-every", type=int, default=0)
    p.add_argument("--ckpt-dir", default=None)
    p.add_argument("--losses-out", default=None, help="write this rank's losses here (one per line)")
    p.add_argument("--no-stepwatch", action="store_true")
    args = p.parse_args()

    distributed = "RANK" in os.environ
    if distributed:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend)
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)

    torch.manual_seed(args.seed)
    model = GPT(args.vocab, args.d_model, args.layers, args.heads, args.seq, args.dropout).to(device)
    ddp = DDP(model) if distributed else model
    opt = torch.optim.AdamW(ddp.parameters(), lr=args.lr)
    ds = Tokens(args.steps * args.batch_size * args.grad_accum * world, args.seq, args.vocab, args.slow_data_ms)
    sampler = DistributedSampler(ds, seed=args.seed) if distributed else None
    g = torch.Generator().manual_seed(args.seed)
    dl = DataLoader(
        ds,
        batch_size=args.batch_size,
        sampler=sampler,
        shuffle=sampler is None,
        generator=g,
        num_workers=args.workers,
        drop_last=True,
    )
    losses: list[float] = []
    step = 0
    it = iter(dl)
    while step < args.steps:
        for micro in range(args.grad_accum):
            try:
                x, y = next(it)
            except StopIteration:
                it = iter(dl)
                x, y = next(it)
            x, y = x.to(device), y.to(device)
            if rank == args.slow_rank:
                time.sleep(args.slow_rank_ms / 1000.0)
            logits = ddp(x)
            loss = F.cross_entropy(logits.view(-1, args.vocab), y.view(-1)) / args.grad_accum
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        if not args.no_stepwatch:
            stepwatch.log(loss=loss.detach() * args.grad_accum)
        step += 1
        if args.eval_every and step % args.eval_every == 0:
            model.eval()
            with torch.no_grad():
                ddp(x)
            model.train()
        if args.ckpt_every and step % args.ckpt_every == 0 and rank == 0:
            torch.save(model.state_dict(), os.path.join(args.ckpt_dir or ".", "ckpt.pt"))

    if args.losses_out:
        with open(f"{args.losses_out}.rank{rank}", "w") as f:
            f.write("\n".join(repr(float(v)) for v in losses) + "\n")
    if rank == 0:
        print(f"done: {step} steps, last loss {float(losses[-1]) * args.grad_accum:.4f}")
    if distributed:
        # Every rank past its last collective, then everything holding the process group (DDP's
        # reducer, gloo's work and their tensors; DDP is in reference cycles, freed only by the
        # garbage collector) freed here on the main thread. Left to the interpreter's exit, the
        # final collection frees them during finalization, where a gloo thread that takes the GIL
        # is ended by pthread_exit: "terminate called without an active exception", SIGABRT.
        dist.barrier()
        ddp = model = opt = dl = it = logits = loss = x = y = None
        gc.collect()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

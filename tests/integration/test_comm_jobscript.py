"""The small DDP / FSDP2 job that the comm and straggler tests run under torchrun (no tests here).

    torchrun --nproc-per-node 2 tests/integration/test_comm_jobscript.py --steps 12 --slow-rank 1

An MLP of ``--layers`` Linear layers; ``--slow-rank R --slow-matmuls K`` makes rank R do K extra
matmuls inside the model's forward (extra compute, not a sleep). ``--hook a,b,...`` trains one
fresh model per variant, one after the other (a user comm hook registered after wrapping in DDP,
or FSDP2); ``--out`` writes each variant's final parameters and grads for this rank.
"""

from __future__ import annotations

import argparse
import gc
import sys

if __name__ == "__main__" and "--no-stepwatch" not in sys.argv:
    import stepwatch.auto  # noqa: F401

import torch
import torch.distributed as dist
import torch.nn as nn


class Net(nn.Module):
    def __init__(self, width: int, layers: int, slow: bool, slow_matmuls: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))
        self.slow = slow
        self.slow_matmuls = slow_matmuls

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.slow:
            w = self.layers[0].weight.detach()
            y = x.detach()
            for _ in range(self.slow_matmuls):
                y = torch.tanh(y @ w)  # extra compute on this rank only, result unused
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--bucket-cap-mb", type=float, default=25.0)
    p.add_argument("--bucket-view", action="store_true")
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--slow-matmuls", type=int, default=0)
    p.add_argument("--hook", default="none",
                   help="comma-separated variants trained one after the other: none, fp16, powersgd, "
                        "allreduce, builtin (DDP comm hooks registered after wrapping) or fsdp (FSDP2)")
    p.add_argument("--profile", default=None, help="first:last steps under torch.profiler (rank trace files)")
    p.add_argument("--trace-out", default=None)
    p.add_argument("--out", default=None)
    p.add_argument("--no-stepwatch", action="store_true")
    args = p.parse_args()

    dist.init_process_group("gloo")
    for variant in args.hook.split(","):
        train(args, variant)
    # the example's teardown (examples/ddp_train.py): DDP lives in reference cycles; freed here
    dist.barrier()
    gc.collect()
    dist.destroy_process_group()


def train(args: argparse.Namespace, variant: str) -> None:
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = Net(args.width, args.layers, rank == args.slow_rank, args.slow_matmuls)
    calls = {"n": 0}
    if variant == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in net.layers:
            fully_shard(layer)
        model = fully_shard(net)
    else:
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(net, bucket_cap_mb=args.bucket_cap_mb, gradient_as_bucket_view=args.bucket_view)
        if variant == "fp16":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            def counting_fp16(state, bucket):
                calls["n"] += 1
                return default_hooks.fp16_compress_hook(state, bucket)

            model.register_comm_hook(None, counting_fp16)
        elif variant == "powersgd":
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

            state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2)
            model.register_comm_hook(state, psgd.powerSGD_hook)
        elif variant == "allreduce":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            model.register_comm_hook(None, default_hooks.allreduce_hook)
        elif variant == "builtin":
            model._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
        elif variant != "none":
            raise SystemExit(f"--hook: unknown variant {variant!r}")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(1 + rank)
    batches = [torch.randn(args.batch, args.width, generator=g) for _ in range(4)]

    prof = None
    first = last = -1
    if args.profile:
        first, last = (int(v) for v in args.profile.split(":"))
    for step in range(args.steps):
        if step == first:
            from torch.profiler import ProfilerActivity, profile

            prof = profile(activities=[ProfilerActivity.CPU])
            prof.__enter__()
        if prof is not None:
            rf = torch.profiler.record_function(f"ProfilerStep#{step}")
            rf.__enter__()
        x = batches[step % len(batches)]
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        if prof is not None:
            rf.__exit__(None, None, None)
        if step == last and prof is not None:
            prof.__exit__(None, None, None)
            prof.export_chrome_trace(f"{args.trace_out}.rank{rank}.json")
            prof = None
    if args.out:
        # One more backward so the grads of the last step are what gets compared.
        model(batches[0]).pow(2).mean().backward()
        state = {n: p.detach().clone() for n, p in net.named_parameters()}
        grads = {n: p.grad.detach().clone() for n, p in net.named_parameters() if p.grad is not None}
        if variant == "fsdp":
            state = {n: t.full_tensor() if hasattr(t, "full_tensor") else t for n, t in state.items()}
            grads = {n: t.full_tensor() if hasattr(t, "full_tensor") else t for n, t in grads.items()}
        torch.save({"params": state, "grads": grads, "hook_calls": calls["n"]}, f"{args.out}.{variant}.rank{rank}.pt")


if __name__ == "__main__":
    main()

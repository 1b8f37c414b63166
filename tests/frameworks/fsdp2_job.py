"""2-rank FSDP2 (``fully_shard``) plain loop on gloo (CPU), run by test_fsdp2.py under torchrun.

    torchrun --nproc-per-node 2 fsdp2_job.py OUT [kept]

Trains twice in one launch (one launch costs more than the training): first without stepwatch,
then with it (``stepwatch.init()``, what ``import stepwatch.auto`` runs), from the same seed.
Gradient accumulation the FSDP2 way (``set_requires_gradient_sync(False)`` on micro-steps), clip
with ``clip_grad_norm_`` (DTensor grads). Each rank writes its losses, tokens and clip norms of
both runs to OUT.rank<R>.json. ``kept``: the blocks keep their parameters unsharded from forward
to backward (``reshard_after_forward=False``): between the two, the blocks hold other tensors than
the sharded parameters the optimizer holds.
"""

import gc
import json
import sys

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

from fw_common import TokenData, make_model

STEPS, ACCUM, BS = 4, 2, 4


def train(rank, world):
    from torch.distributed.fsdp import fully_shard

    model = make_model()
    kept = len(sys.argv) > 2 and sys.argv[2] == "kept"
    for block in model.blocks:
        fully_shard(block, reshard_after_forward=not kept)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = TokenData(STEPS * ACCUM * BS * world)
    loader = DataLoader(data, batch_size=BS, sampler=DistributedSampler(data, world, rank, shuffle=False))
    losses, tokens, norms = [], [], []
    for i, batch in enumerate(loader):
        last = (i + 1) % ACCUM == 0
        model.set_requires_gradient_sync(last)
        loss = model(**batch)["loss"] / ACCUM
        loss.backward()
        losses.append(loss.item())
        tokens.append(int(batch["attention_mask"].sum()))
        if last:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
            opt.step()
            opt.zero_grad()
    return {"losses": losses, "tokens": tokens, "norms": norms}


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    off = train(rank, world)
    import stepwatch

    stepwatch.init()
    on = train(rank, world)
    stepwatch.shutdown()
    with open(f"{sys.argv[1]}.rank{rank}.json", "w") as f:
        json.dump({"on": on, "off": off}, f)
    # the example's teardown (examples/ddp_train.py): the models freed on the main thread first
    dist.barrier()
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

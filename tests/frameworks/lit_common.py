"""The LightningModule and Trainer set-up shared by the Lightning tests and the 2-rank DDP job."""

from __future__ import annotations

import importlib

import torch
from torch.utils.data import DataLoader

from fw_common import TokenData, make_model

STEPS, ACCUM, BS, LR, CLIP = 6, 2, 4, 1e-2, 0.5


# The unified package and the standalone one: the same API, distinct classes.
PACKAGES = ("lightning.pytorch", "pytorch_lightning")


def lit_module(sleep_s=0.0, pkg="lightning.pytorch"):
    pl = importlib.import_module(pkg)
    grad_norm = importlib.import_module(f"{pkg}.utilities").grad_norm

    class LitLM(pl.LightningModule):
        """Calls its submodule ``self.model`` from training_step (the common pattern)."""

        def __init__(self):
            super().__init__()
            self.model = make_model(sleep_s=sleep_s)
            self.losses = []  # each micro-batch's loss (float), for the on/off comparison
            self.tokens = []  # each micro-batch's non-padding tokens
            self.norms = []  # Lightning's own grad-norm (utilities.grad_norm), per optimizer step

        def training_step(self, batch, batch_idx):
            loss = self.model(**batch)["loss"]
            self.losses.append(loss.item())
            self.tokens.append(int(batch["attention_mask"].sum()))
            # Lightning's own logging keeps the tensor in the trainer's state: a FLOP-count replay
            # of training_step on fake tensors would leak a fake here (tested without the callback).
            self.log("train_loss", loss)
            return loss

        def on_before_optimizer_step(self, optimizer):
            # Lightning's documented way to log the grad norm; runs before its clipping.
            self.norms.append(float(grad_norm(self, norm_type=2)["grad_2.0_norm_total"]))

        def configure_optimizers(self):
            # SGD: its step costs well under a millisecond, so a forward wrongly inside
            # optimizer_s (which sleeps SLEEP) cannot hide in it.
            return torch.optim.SGD(self.parameters(), lr=LR, momentum=0.9)

    return LitLM()


def fit(callbacks, *, sleep_s=0.0, steps=STEPS, devices=1, strategy="auto", pkg="lightning.pytorch"):
    pl = importlib.import_module(pkg)

    torch.manual_seed(0)
    lit = lit_module(sleep_s, pkg)
    trainer = pl.Trainer(
        max_steps=steps,
        accumulate_grad_batches=ACCUM,
        gradient_clip_val=CLIP,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
    )
    loader = DataLoader(TokenData(steps * ACCUM * BS * devices), batch_size=BS)
    trainer.fit(lit, loader)
    return lit, trainer

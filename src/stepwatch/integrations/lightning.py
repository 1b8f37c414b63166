"""Lightning adapter: ``trainer = Trainer(callbacks=[StepwatchCallback()])``.

What the hooks see in Lightning without help, and what this callback adds (docs/frameworks.md):

- Step boundaries, phases, data wait, grad-norm and comm come from the core hooks as in a plain
  loop. Lightning calls ``optimizer.step(closure)``: forward and backward run *inside* the
  optimizer step; the tracker pauses the optimizer phase around them and the grad-norm probe runs
  after the closure, so neither needs the callback.
- Lightning calls ``training_step`` directly, not through ``module(...)``: the module hooks never
  fire unless ``training_step`` calls ``self(...)``. Under DDP it calls the DDP wrapper, which
  calls the LightningModule with its ``forward`` redirected to ``training_step`` (loss, logging
  and all). The callback declares the LightningModule's direct submodules as the model (and the
  LightningModule itself when it is not wrapped), and the wrappers as not-the-model, so forward
  time, FLOPs and tokens come from the real model calls.
- Step numbers follow ``trainer.global_step`` (a resumed run keeps counting); the step's loss (mean
  of its micro-batches, as ``training_step`` returned it) and learning rate go to the record's
  ``scalars`` as ``loss`` and ``lr``.

With ``import stepwatch.auto`` nobody needs to add the callback: Lightning asks the
``lightning.pytorch.callbacks_factory`` entry points for callbacks when it builds a ``Trainer``,
and ``callbacks_factory`` returns one while a session runs (``STEPWATCH_LIGHTNING_CALLBACK=0``
turns that off). A callback passed by hand wins: the automatic one then does nothing.
"""

from __future__ import annotations

import sys
from typing import Any

try:
    from lightning.pytorch.callbacks import Callback
except ImportError:  # the standalone ``pytorch_lightning`` package
    try:
        from pytorch_lightning.callbacks import Callback  # type: ignore[no-redef]
    except ImportError as e:
        raise ImportError(
            "stepwatch.integrations.lightning needs Lightning: pip install 'stepwatch[frameworks]' "
            "(or pip install lightning)"
        ) from e

import stepwatch

from ._common import ensure_session, internal_error


def _is_metric(m: Any) -> bool:
    # torchmetrics' Metric is an nn.Module but computes no model output.
    tm = sys.modules.get("torchmetrics")
    return tm is not None and isinstance(m, tm.Metric)


def _wrappers(outer: Any, inner: Any) -> list[Any]:
    """Modules between the strategy's model (DDP, ...) and the LightningModule, outer first."""
    out = []
    m = outer
    for _ in range(8):  # DDP -> _LightningModuleWrapperBase -> LightningModule
        if m is None or m is inner:
            break
        out.append(m)
        inner_m = getattr(m, "module", None)  # not `or`: an empty container module is falsy
        m = inner_m if inner_m is not None else getattr(m, "_forward_module", None)
    return out


class StepwatchCallback(Callback):
    """Wires Lightning's facts into the running stepwatch session.

    ``init``: start stepwatch with ``config`` (``stepwatch.init`` keyword arguments) when no session
    runs in this process (``ddp_spawn`` workers, which never ran the script's import). Set it to
    False to leave stepwatch off unless the script started it.
    """

    def __init__(self, *, init: bool = True, **config: Any) -> None:
        super().__init__()
        self._config = config if init else None
        self._loss_sum: Any = None
        self._loss_n = 0
        self._logged_step = -1
        # Set on the callback the entry point adds; it stands down for one passed by hand.
        self.automatic = False
        self.active = True

    def __getstate__(self) -> dict[str, Any]:
        # Pickled into spawned workers: no tensors.
        d = self.__dict__.copy()
        d["_loss_sum"], d["_loss_n"] = None, 0
        return d

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        if self.automatic:
            self.active = not any(
                isinstance(c, StepwatchCallback) and not c.automatic for c in trainer.callbacks
            )
        if not self.active:
            return
        s = ensure_session(self._config)
        if s is None or s.instrumentation is None:
            return
        try:
            children = [c for c in pl_module.children() if not _is_metric(c)]
            wrappers = _wrappers(trainer.strategy.model, pl_module)
            if wrappers:
                # Under a wrapper (DDP...) Lightning redirects the LightningModule's own call to
                # training_step: its submodules are the model calls.
                s.instrumentation.declare_roots(children, [*wrappers, pl_module])
            else:
                # Alone, its call is a real forward (``self(x)`` in training_step).
                s.instrumentation.declare_roots([pl_module, *children])
        except Exception as e:
            internal_error(s, "lightning.on_fit_start", e)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if not self.active:
            return
        self._logged_step = trainer.global_step
        if stepwatch.get_session() is not None:
            stepwatch.set_step(int(trainer.global_step))

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if not self.active:
            return
        try:
            lr = optimizer.param_groups[0]["lr"]
            stepwatch.log(lr=lr)
        except Exception as e:
            internal_error(stepwatch.get_session(), "lightning.lr", e)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not self.active:
            return
        try:
            loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
            if hasattr(loss, "detach"):
                # Lightning hands back the loss divided by accumulate_grad_batches (what it
                # backpropagated); the step's loss is the mean of the undivided ones.
                loss = loss.detach() * trainer.accumulate_grad_batches
                self._loss_sum = loss if self._loss_sum is None else self._loss_sum + loss
                self._loss_n += 1
            if trainer.global_step != self._logged_step:
                # This batch ended an optimizer step: the record still open for scalars is that step's.
                self._logged_step = trainer.global_step
                if self._loss_n:
                    stepwatch.log(loss=self._loss_sum / self._loss_n)
                self._loss_sum, self._loss_n = None, 0
        except Exception as e:
            internal_error(stepwatch.get_session(), "lightning.loss", e)


def callbacks_factory() -> list[Any]:
    """Lightning's ``lightning.pytorch.callbacks_factory`` entry point (pyproject.toml): called for
    every ``Trainer`` built in any process where stepwatch is installed, so it must be cheap and
    must never raise. One callback while a session runs and the config allows it, else none."""
    try:
        s = stepwatch.get_session()
        if s is None or not s.config.lightning_callback:
            return []
        cb = StepwatchCallback(init=False)
        cb.automatic = True
        return [cb]
    except Exception as e:  # never break the user's Trainer
        internal_error(stepwatch.get_session(), "lightning.callbacks_factory", e)
        return []

"""What the Lightning adapters share, free of any Lightning import: the callback's body and the
entry point. ``lightning.py`` (``lightning.pytorch``) and ``pytorch_lightning.py`` (the standalone
package) put it on their package's ``Callback``; see ``lightning.py`` for what it does."""

from __future__ import annotations

import sys
from typing import Any, Callable

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


class CallbackMixin:
    """Wires Lightning's facts into the running stepwatch session (the body of both packages'
    ``StepwatchCallback``: ``lightning.pytorch`` and the standalone ``pytorch_lightning``).

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
                isinstance(c, CallbackMixin) and not c.automatic for c in trainer.callbacks
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



def make_callbacks_factory(cls: type) -> Callable[[], list[Any]]:
    """A Lightning ``callbacks_factory`` entry point for ``cls``: called for every ``Trainer``
    built in any process where stepwatch is installed, so it must be cheap and must never raise.
    One callback while a session runs and the config allows it, else none."""

    def callbacks_factory() -> list[Any]:
        try:
            s = stepwatch.get_session()
            if s is None or not s.config.lightning_callback:
                return []
            cb = cls(init=False)
            cb.automatic = True
            return [cb]
        except Exception as e:  # never break the user's Trainer
            internal_error(stepwatch.get_session(), "lightning.callbacks_factory", e)
            return []

    return callbacks_factory

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

from ._lightning_base import CallbackMixin, make_callbacks_factory

try:
    from lightning.pytorch.callbacks import Callback
except ImportError:  # only the standalone package: its adapter is the same callback on its Callback
    try:
        from .pytorch_lightning import StepwatchCallback, callbacks_factory  # noqa: F401
    except ImportError as e:
        raise ImportError(
            "stepwatch.integrations.lightning needs Lightning: pip install 'stepwatch[frameworks]' "
            "(or pip install lightning)"
        ) from e
else:

    class StepwatchCallback(CallbackMixin, Callback):  # type: ignore[no-redef]
        __doc__ = CallbackMixin.__doc__

    # Lightning's ``lightning.pytorch.callbacks_factory`` entry point (pyproject.toml).
    callbacks_factory = make_callbacks_factory(StepwatchCallback)

"""Hugging Face ``transformers`` adapter: ``Trainer(..., callbacks=[StepwatchCallback()])``.

The core hooks already see everything that matters in ``Trainer``: it calls ``model(**inputs)``
(forward, FLOPs, tokens from ``input_ids``/``attention_mask``), ``loss.backward()`` through
accelerate, ``optimizer.step()`` once per update (accumulation micro-steps never call it), and
``clip_grad_norm_`` whose pre-clip norm stepwatch reuses as ``grad_norm``. This callback adds what
only the Trainer knows (docs/frameworks.md):

- step numbers follow ``state.global_step`` (a run resumed from a checkpoint keeps counting);
- what the Trainer logs: ``loss`` (its running mean since the last log) and ``learning_rate`` as
  ``lr`` go to the ``scalars`` of the step that just ended (logging steps only), evaluation
  metrics (``eval_*``) likewise.
"""

from __future__ import annotations

from typing import Any

try:
    from transformers import TrainerCallback
except ImportError as e:
    raise ImportError(
        "stepwatch.integrations.transformers needs transformers: pip install 'stepwatch[frameworks]' "
        "(or pip install transformers)"
    ) from e

import stepwatch

from ._common import ensure_session, internal_error

# Trainer log keys -> record scalar names.
_RENAME = {"loss": "loss", "learning_rate": "lr"}


class StepwatchCallback(TrainerCallback):
    """Wires the Trainer's facts into the running stepwatch session.

    ``init``: start stepwatch with ``config`` (``stepwatch.init`` keyword arguments) when no
    session runs in this process; False leaves stepwatch off unless the script started it.
    """

    def __init__(self, *, init: bool = True, **config: Any) -> None:
        self._config = config if init else None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        s = ensure_session(self._config)
        if s is not None:
            stepwatch.set_step(int(state.global_step))

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if not logs:
            return
        try:
            out = {}
            for k, v in logs.items():
                name = _RENAME.get(k) or (k if k.startswith("eval_") else None)
                if name is not None and isinstance(v, (int, float)) and not isinstance(v, bool):
                    out[name] = v
            if out:
                stepwatch.log(**out)
        except Exception as e:
            internal_error(stepwatch.get_session(), "transformers.on_log", e)

"""The standalone ``pytorch_lightning`` package: ``Trainer(callbacks=[StepwatchCallback()])``.

The same callback as :mod:`stepwatch.integrations.lightning` (what it adds is written there), on
``pytorch_lightning``'s own ``Callback`` class: a ``pytorch_lightning.Trainer`` is a different
class from ``lightning.pytorch.Trainer`` and reads its own entry-point group,
``pytorch_lightning.callbacks_factory``, through which the one-line import adds this callback.
"""

from __future__ import annotations

try:
    from pytorch_lightning.callbacks import Callback
except ImportError as e:
    raise ImportError(
        "stepwatch.integrations.pytorch_lightning needs pytorch_lightning: pip install pytorch-lightning "
        "(for the unified package, lightning.pytorch, use stepwatch.integrations.lightning)"
    ) from e

from ._lightning_base import CallbackMixin, make_callbacks_factory


class StepwatchCallback(CallbackMixin, Callback):
    __doc__ = CallbackMixin.__doc__


# ``pytorch_lightning.callbacks_factory`` entry point (pyproject.toml).
callbacks_factory = make_callbacks_factory(StepwatchCallback)

"""Adapters for training frameworks (docs/frameworks.md): thin callbacks that hand stepwatch what
the framework knows and the hooks cannot see — which modules the step really calls, the step
number on resume, the loss and learning rate it reports. They measure nothing themselves.

- ``stepwatch.integrations.lightning.StepwatchCallback``: a Lightning ``Callback``
  (``stepwatch.integrations.pytorch_lightning``: the same on the standalone package's ``Callback``).
- ``stepwatch.integrations.transformers.StepwatchCallback``: a ``transformers`` ``TrainerCallback``.

Nothing here is imported by ``import stepwatch``; each adapter imports its framework when the
adapter module itself is imported.
"""

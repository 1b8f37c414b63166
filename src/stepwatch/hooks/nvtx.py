"""NVTX ranges through the ``nvtx`` package, one cached domain and cached attributes.

``torch.cuda.nvtx`` raises on CPU builds; the ``nvtx`` package is a cheap no-op (~85 ns a
push/pop pair measured here) unless a tool such as nsys injects itself.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)


class Nvtx:
    """When ``enabled``: ``push_range(attrs)`` and ``pop_range()`` are the domain's own methods,
    and ``forward``, ``eval``, ``backward``, ``optimizer`` their ranges' attributes, made once:
    the tracker's phases push and pop with no call of this class between."""

    __slots__ = ("_domain", "_attrs", "enabled", "push_range", "pop_range", "forward", "eval", "backward", "optimizer")

    def __init__(self, enabled: bool) -> None:
        self.enabled = False
        self._domain: Any = None
        self._attrs: dict[str, Any] = {}
        if not enabled:
            return
        try:
            import nvtx
        except Exception as e:  # the nvtx package is optional at run time
            log.warning("stepwatch: NVTX ranges off: the nvtx package cannot be imported (%s)", e)
            return
        self._domain = nvtx.get_domain("stepwatch")
        self.push_range = self._domain.push_range
        self.pop_range = self._domain.pop_range
        self.forward, self.eval, self.backward, self.optimizer = (
            self._attr(n) for n in ("forward", "eval", "backward", "optimizer")
        )
        self.enabled = True

    def _attr(self, name: str) -> Any:
        a = self._attrs.get(name)
        if a is None:
            a = self._attrs[name] = self._domain.get_event_attributes(message=name)
        return a

    def push(self, name: str) -> None:
        if self.enabled:
            self._domain.push_range(self._attr(name))

    def push_step(self, step: int) -> None:
        # One attribute object per step: the message changes every step.
        if self.enabled:
            self._domain.push_range(self._domain.get_event_attributes(message=f"step_{step}"))

    def pop(self) -> None:
        if self.enabled:
            self._domain.pop_range()

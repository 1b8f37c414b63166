"""NVTX ranges through the ``nvtx`` package, one cached domain and cached attributes.

``torch.cuda.nvtx`` raises on CPU builds; the ``nvtx`` package is a no-op unless a tool such as
nsys injects itself, but each call still costs (~12k instructions a step for stepwatch's ten,
counted with callgrind). A tool can only join at NVTX's first call in the process, as NVTX
finds it: an injection entry point already loaded into the process's global scope (a preloaded
tool library), else the library ``NVTX_INJECTION64_PATH`` names (what nsys sets in the job it
launches). At init, stepwatch looks the same way; with neither, no range can reach anything, and
stepwatch makes no NVTX call at all.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Mapping

log = logging.getLogger(__name__)

# Where the NVTX loader finds a tool library by name (64- and 32-bit processes).
INJECTION_ENV = ("NVTX_INJECTION64_PATH", "NVTX_INJECTION32_PATH")
# The entry points NVTX looks up in the loaded libraries before it reads those (v2, then v1).
INJECTION_SYMBOLS = ("InitializeInjectionNvtx2", "InitializeInjectionNvtx")


def tool_injected(environ: Mapping[str, str] | None = None) -> bool:
    """Can an NVTX tool be listening in this process (see the module's docstring)?"""
    env = os.environ if environ is None else environ
    return any(env.get(name, "").strip() for name in INJECTION_ENV) or _tool_loaded()


def _tool_loaded() -> bool:
    """An NVTX injection entry point among the libraries in the process's global scope
    (``dlsym(RTLD_DEFAULT, ...)``, NVTX's own first lookup)."""
    try:
        import ctypes

        scope = ctypes.CDLL(None)
    except (OSError, ImportError):  # no dynamic loader to ask: only the variables above say
        return False
    return any(hasattr(scope, name) for name in INJECTION_SYMBOLS)


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
        if not tool_injected():
            log.info("stepwatch: NVTX ranges off: no NVTX tool in this process (%s unset; nsys sets it)", INJECTION_ENV[0])
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

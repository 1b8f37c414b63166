"""What the adapters share: reach the running session (or start one), feed it through the public API."""

from __future__ import annotations

from typing import Any

import stepwatch


def ensure_session(config: dict[str, Any] | None) -> Any:
    """The running session; started with ``config`` when there is none and ``config`` is not None.

    ``ddp_spawn`` and other spawned workers do not run the script's ``import stepwatch.auto``: the
    callback, pickled into each worker, starts the session there.
    """
    s = stepwatch.get_session()
    if s is None and config is not None:
        s = stepwatch.init(**config)
    return s


def internal_error(session: Any, where: str, exc: BaseException) -> None:
    """An adapter never raises into the training loop: count, log once, finding (session's rule)."""
    if session is not None:
        session.report_error(f"integrations.{where}", exc)

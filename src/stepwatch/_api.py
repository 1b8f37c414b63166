"""The module-level API: one active session per process, and the calls that reach it."""

from __future__ import annotations

import dataclasses
import os
import threading
from typing import TYPE_CHECKING, Any

from . import _env
from .config import Config, ConfigError, step_number

if TYPE_CHECKING:
    from ._session import Session

_lock = threading.Lock()
_session: "Session | None" = None
_fork_handler_installed = False


def _after_fork_in_child() -> None:
    s = _session
    if s is not None:
        running = s._started and not s._closed
        s.after_fork_in_child()
        if running and not _in_dataloader_worker():
            # A fork that trains (a Pool's worker under Linux's default 'fork'): a session of its
            # own from its first optimizer, as a spawned one. It was left unmeasured, unsaid. A
            # DataLoader worker (marked while its loader starts it) makes no optimizer.
            # The parent's settings, less its own exporter objects: a copy of one (its socket, its
            # file) writing from the child would interleave with the parent's.
            cfg = s.config
            own = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name != "exporters"}
            _start_at_first_optimizer(own)


def init(**config: Any) -> "Session":
    """Start stepwatch in this process (idempotent).

    Keyword arguments are :class:`~stepwatch.Config` fields; they override ``STEPWATCH_*``
    variables. A second call with the same configuration returns the running session; with a
    different one it raises :class:`ConfigError` (call :func:`shutdown` first).
    """
    global _session, _fork_handler_installed
    cfg = Config.from_env(**config)
    if cfg.dir is not None and not os.path.isabs(cfg.dir):
        # one directory however it is spelled ("runs/x", "./runs/x", the absolute path that
        # `stepwatch run --dir` passes): a second init() naming it is the same configuration
        cfg = dataclasses.replace(cfg, dir=os.path.abspath(cfg.dir))
    if cfg.enabled and _in_dataloader_worker():
        cfg = dataclasses.replace(cfg, enabled=False)  # a worker loads batches: nothing to measure
    elif cfg.enabled and _importing_mp_main():
        # A 'spawn'/'forkserver' child (a multiprocessing Pool's worker, a process of
        # torch.multiprocessing.spawn) imports the script again: start when it trains.
        _start_at_first_optimizer(config)
        cfg = dataclasses.replace(cfg, enabled=False)
        from ._session import Session

        return Session(cfg)  # inert, and not this process's session (get_session() is None)
    with _lock:
        if _session is not None and not _session._closed:
            if _session.config == cfg:
                return _session
            if not _session.by_run:
                raise ConfigError(
                    "stepwatch.init() called again with a different configuration; "
                    "call stepwatch.shutdown() first (running: "
                    f"{_diff(_session.config, cfg)})"
                )
            # `stepwatch run` started the running session before the script's own init(...): the
            # script's settings win where nothing was measured yet; later, the run's stays (a
            # second session would split the run), and the job goes on either way.
            if not _session.trained_nothing():
                from ._log import warn_once

                warn_once("init.under-run", "stepwatch: the script's stepwatch.init(...) came after `stepwatch run` "
                          "started measuring; its settings are not applied (%s). Call it before training, or give "
                          "them as STEPWATCH_* variables.", _diff(_session.config, cfg))
                return _session
            from ._log import logger

            logger.info("stepwatch: the script's stepwatch.init(...) replaces the session `stepwatch run` started "
                        "(%s)", _diff(_session.config, cfg))
            _session.end_without_trace()
        from ._session import Session

        if not _fork_handler_installed:
            # Forked DataLoader workers must start no threads and write no records.
            os.register_at_fork(after_in_child=_after_fork_in_child)
            _fork_handler_installed = True
        _session = Session(cfg)
        # started by `stepwatch run`'s shim (import stepwatch.auto with no argument, in the process
        # it marked): a script's own init(...) with other settings replaces it (above)
        _session.by_run = not config and os.environ.get(_env.RUN_ACTIVE) == str(os.getpid())
        global _step_before_init
        if _step_before_init is not None:
            n, _step_before_init = _step_before_init, None
            _session.set_step(n)
        return _session


def _importing_mp_main() -> bool:
    """This call comes from the script's import as ``__mp_main__``: multiprocessing's 'spawn'
    and 'forkserver' children run the main module again under that name before their target."""
    import sys

    f = sys._getframe(2)
    while f is not None:
        if f.f_code.co_name == "<module>" and f.f_globals.get("__name__") == "__mp_main__":
            return True
        f = f.f_back
    return False


def _start_at_first_optimizer(config: dict[str, Any]) -> None:
    """``init(**config)`` when this process makes its first ``torch.optim.Optimizer`` (a rank of
    ``torch.multiprocessing.spawn`` trains; a Pool's worker that preprocesses never does).
    Nothing of stepwatch runs before."""
    import functools

    from torch.optim import Optimizer

    orig = Optimizer.__init__

    @functools.wraps(orig)
    def __init__(opt: Any, *args: Any, **kwargs: Any) -> None:
        if Optimizer.__init__ is __init__:
            Optimizer.__init__ = orig  # once; the session patches its own in
        orig(opt, *args, **kwargs)
        if get_session() is not None:  # the process started one itself
            return
        try:
            init(**config)
        except Exception as e:  # a bad setting was checked before; anything else: no session
            from ._log import logger

            logger.warning("stepwatch: not started in this process: %s: %s", type(e).__name__, e)

    Optimizer.__init__ = __init__


def _in_dataloader_worker() -> bool:
    """This process is a DataLoader worker started by 'spawn' or 'forkserver' (it imports the
    script's main module, and runs its ``import stepwatch.auto``). A forked worker is handled
    at the fork (``after_fork_in_child``)."""
    from . import _env

    mark = os.environ.get(_env.DATALOADER_WORKER)
    return mark is not None and mark == str(os.getppid())


def _diff(a: Config, b: Config) -> str:
    out = [
        f"{f.name}={getattr(a, f.name)!r} vs {getattr(b, f.name)!r}"
        for f in dataclasses.fields(a)
        if getattr(a, f.name) != getattr(b, f.name)
    ]
    return ", ".join(out)


def get_session() -> "Session | None":
    """The running session, or None."""
    s = _session
    return s if s is not None and not s._closed else None


def shutdown() -> None:
    """Finish the last step, flush every exporter, remove every hook. Also runs at exit."""
    global _session
    with _lock:
        s, _session = _session, None
    if s is not None:
        s.shutdown()


def step() -> None:
    """Explicit step boundary: the step ends here. From the first call on, only this call ends
    steps (optimizer steps and backwards no longer do): for loops without a torch optimizer, or
    whose iteration steps two optimizers in turn (a GAN). ``STEPWATCH_STEP_BOUNDARY=explicit``
    says the same from the start."""
    s = _session
    if s is not None:
        s.step()


def set_step(n: int) -> None:
    """Number the next step ``n`` (e.g. after resuming from a checkpoint): the values
    ``STEPWATCH_STEP_OFFSET`` takes (a numpy integer too; not past 2**53, which a record's float
    consumers could not hold). Called before :func:`init` (or after :func:`shutdown`), the next
    session's first step is ``n``."""
    try:
        n = step_number(n)  # what STEPWATCH_STEP_OFFSET takes
    except ValueError as e:
        raise ConfigError(f"stepwatch.set_step(n={n!r}): n must be {str(e).removeprefix('expected ')}") from None
    s = _session
    if s is not None and not s._closed:
        s.set_step(n)
    else:  # before init (a resume that numbers its steps first): the next init numbers from it
        global _step_before_init
        _step_before_init = n


# set_step(n) called with no session running, for the next init() (it was dropped, silently:
# a resumed job's records numbered from 0).
_step_before_init: int | None = None


def log(**scalars: Any) -> None:
    """Attach scalars (loss, lr, ...) to the current step. Tensors are read later, off the
    training thread; nothing here waits for the device."""
    s = _session
    if s is not None and (tr := s.tracker) is not None:  # one frame: this is every step's call
        try:
            tr.log_values(scalars, s.log_convert)
        except Exception as e:
            s.report_error("log", e)


class phase:
    """``with stepwatch.phase("name"):`` times a block into the record's ``phases`` and opens an
    NVTX range of that name. Reentrant; exceptions from the block pass through untouched."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        if not isinstance(name, str) or not name:
            raise ConfigError(f"stepwatch.phase(name={name!r}): name must be a non-empty string")
        self.name = name

    def __enter__(self) -> "phase":
        s = _session
        if s is not None and s.tracker is not None:
            s.tracker.phase_begin(self.name)
        return self

    def __exit__(self, *exc: Any) -> None:
        s = _session
        if s is not None and s.tracker is not None:
            s.tracker.phase_end(self.name)

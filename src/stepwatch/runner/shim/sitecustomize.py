"""Put on PYTHONPATH by ``stepwatch run``: every Python process of the job imports this at start-up
(the ``site`` module imports ``sitecustomize``), and the job's ranks start stepwatch without a code
change. Which processes: under torchrun, the ranks (``RANK`` is set; not the agent, not helper
processes); otherwise the first Python process of the command that is not a launcher
(``accelerate launch``, ``deepspeed``, ``lightning run``: their ranks are). Then the next
``sitecustomize`` on the path, if the environment has one, runs as it would have."""

import os
import sys

# Programs that start the training processes rather than train: instrumenting one would leave its
# ranks out (they inherit STEPWATCH_RUN_ACTIVE, and are not started by multiprocessing's 'spawn').
# Console scripts by name, modules by prefix.
_LAUNCHER_SCRIPTS = frozenset(("accelerate", "accelerate-launch", "deepspeed", "lightning", "torchrun", "torchx"))
_LAUNCHER_MODULES = ("accelerate.commands", "deepspeed.launcher", "lightning", "torch.distributed.run",
                     "torch.distributed.launch")


def _is_launcher() -> bool:
    argv = list(getattr(sys, "orig_argv", None) or sys.argv)  # sys.orig_argv: the whole command line
    if "-m" in argv[:-1]:
        mod = argv[argv.index("-m") + 1]
        return any(mod == m or mod.startswith(m + ".") for m in _LAUNCHER_MODULES)
    script = next((a for a in argv[1:] if not a.startswith("-")), "")
    return os.path.basename(script) in _LAUNCHER_SCRIPTS


def _spawned_child() -> bool:
    """A process that the one stepwatch runs in started with multiprocessing's 'spawn' (the ranks
    of ``torch.multiprocessing.spawn``, a hogwild ``mp.Process``, a Pool's worker), and not as a
    DataLoader worker (STEPWATCH_DATALOADER_WORKER is the trainer's pid while its workers start)."""
    argv = getattr(sys, "orig_argv", None) or sys.argv
    parent = str(os.getppid())
    return (os.environ.get("STEPWATCH_RUN_ACTIVE") == parent and "--multiprocessing-fork" in argv
            and os.environ.get("STEPWATCH_DATALOADER_WORKER") != parent)


def _enable() -> "bool | str":
    env = os.environ
    if env.get("STEPWATCH_SIDECAR") == "1" or env.get("STEPWATCH_ENABLED", "1").lower() in ("0", "false", "no", "off"):
        return False
    if env.get("STEPWATCH_RUN_ACTIVE"):
        # A process the rank started. A spawned one may train (a rank of mp.spawn): it starts
        # stepwatch when it makes an optimizer, which a Pool's worker never does. Others (the
        # DataLoader's workers, the resource tracker, compile workers) are no rank.
        return "at first optimizer" if _spawned_child() else False
    if env.get("STEPWATCH_RUN_MODE") == "ranks":
        return "RANK" in env and "LOCAL_RANK" in env
    # the first Python process of the command that trains (its children see STEPWATCH_RUN_ACTIVE)
    return not _is_launcher()


def _find_package() -> None:
    """Where the job's Python cannot import stepwatch (another venv's Python), the folder of
    ``stepwatch run``'s own package goes last on ``sys.path``: after the standard library and the
    job's own packages, which it never shadows (STEPWATCH_RUN_PKG_PATH, see _env.py)."""
    import importlib.util

    where = os.environ.get("STEPWATCH_RUN_PKG_PATH")
    if where and importlib.util.find_spec("stepwatch") is None and where not in sys.path:
        sys.path.append(where)


def _chain() -> None:
    """Run the sitecustomize this one shadows (a distribution's, a virtualenv's)."""
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)


_how = _enable()
if _how:
    os.environ["STEPWATCH_RUN_ACTIVE"] = str(os.getpid())
    try:
        _find_package()
        if _how == "at first optimizer":
            # as ``import stepwatch.auto`` does in a spawned child (stepwatch._api): a rank makes
            # its process group (rank, world size) in its target, before its optimizer
            from stepwatch._api import _start_at_first_optimizer

            _start_at_first_optimizer({})
        else:
            import stepwatch.auto  # noqa: F401
    except Exception as _e:  # a bad STEPWATCH_* value: say it, and let the job run uninstrumented
        sys.stderr.write(f"[stepwatch] not started in pid {os.getpid()}: {type(_e).__name__}: {_e}\n")
try:
    _chain()
except Exception as _e:
    sys.stderr.write(f"[stepwatch] the job's own sitecustomize failed: {type(_e).__name__}: {_e}\n")

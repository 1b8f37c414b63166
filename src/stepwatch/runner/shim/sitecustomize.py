"""Put on PYTHONPATH by ``stepwatch run``: every Python process of the job imports this at start-up
(the ``site`` module imports ``sitecustomize``), and the job's ranks start stepwatch without a code
change. Which processes: under torchrun, the ranks (``RANK`` is set; not the agent, not helper
processes); otherwise the first Python process of the command that is not a launcher
(``accelerate launch``, ``deepspeed``, ``lightning run``: their ranks are). Then the next
``sitecustomize`` on the path, if the environment has one, runs as it would have."""

import os
import sys

# Programs that start the training processes rather than train: instrumenting one would leave its
# ranks out (they inherit STEPWATCH_RUN_ACTIVE). Console scripts by name, modules by prefix.
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


def _spawned_rank() -> bool:
    """A process that ``torch.multiprocessing.spawn`` started in the process stepwatch runs in (it
    set STEPWATCH_RUN_RANKS to its pid while they start): a rank, which trains in its target."""
    argv = getattr(sys, "orig_argv", None) or sys.argv
    return os.environ.get("STEPWATCH_RUN_RANKS") == str(os.getppid()) and "--multiprocessing-fork" in argv


def _enable() -> "bool | str":
    env = os.environ
    if env.get("STEPWATCH_SIDECAR") == "1" or env.get("STEPWATCH_ENABLED", "1").lower() in ("0", "false", "no", "off"):
        return False
    if env.get("STEPWATCH_RUN_ACTIVE"):
        # a process the rank started (a spawned DataLoader worker, the resource tracker): not a
        # rank, unless torch.multiprocessing spawned it as one
        return "at first optimizer" if _spawned_rank() else False
    if env.get("STEPWATCH_RUN_MODE") == "ranks":
        return "RANK" in env and "LOCAL_RANK" in env
    # the first Python process of the command that trains (its children see STEPWATCH_RUN_ACTIVE)
    return not _is_launcher()


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
        if _how == "at first optimizer":
            # A spawned rank: its process group (rank, world size) is made in its target, before
            # its optimizer, as in a rank that runs ``import stepwatch.auto`` (stepwatch._api).
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

"""init / train / shutdown, again and again in one process (a notebook): each shutdown leaves the
process as the session found it -- no excepthook of a dead session in the chain, no DataLoader
wrapper piling up, no Session kept alive, no old run dir written into, no ``TORCH_FR_*``
variable left behind for the next session or a child job."""

from __future__ import annotations

import gc
import json
import os
import sys
import time
import weakref

import pytest

torch = pytest.importorskip("torch")

from torch.utils.data import dataloader  # noqa: E402

FR_VARS = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_FR_DUMP_TEMP_FILE",
           "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")


@pytest.fixture
def clean_env(monkeypatch):
    for k in list(os.environ):
        if k.startswith("STEPWATCH_"):
            monkeypatch.delenv(k)
    for k in FR_VARS:
        monkeypatch.delenv(k, raising=False)
    yield
    import stepwatch

    stepwatch.shutdown()  # a failed assertion mid-cycle leaves no session running


def _cycle(run_dir, during=None, model=None, **cfg):
    """One session: init, a few training steps, shutdown. Returns a weak reference to it only."""
    import stepwatch

    cfg.setdefault("watchdog", "off")
    cfg.setdefault("capture", "off")
    s = stepwatch.init(dir=str(run_dir), console="off", flush_interval_s=0.05, **cfg)
    ref = weakref.ref(s)
    m = model if model is not None else torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    for _ in range(5):
        opt.zero_grad()
        m(torch.randn(2, 8)).sum().backward()
        opt.step()
    if during is not None:
        during(s)
    del s
    stepwatch.shutdown()
    return ref


def _wrapper_depth(f):
    d = 0
    while getattr(f, "__wrapped__", None) is not None:
        f, d = f.__wrapped__, d + 1
    return d


def _collected(refs, within_s=2.0):
    """Every weakly referenced object is gone after gc.collect() -- allowing for a daemon thread of
    the session that has returned but whose C-level start-up frame still holds it a moment."""
    deadline = time.monotonic() + within_s
    while True:
        gc.collect()
        alive = [r() for r in refs]
        if not any(a is not None for a in alive) or time.monotonic() > deadline:
            return [a is None for a in alive]
        del alive
        time.sleep(0.02)


def test_three_cycles_leave_the_excepthook_dataloader_and_sessions_as_they_were(tmp_path, clean_env):
    # torch's first optimizer imports torch._dynamo, whose cached rule map then keeps whatever
    # torch.autograd.grad is at the time -- stepwatch's wrapper, and through it that session, if
    # one is running (hooks/install.py's _Grad; not the memory feature's doing). Built first here.
    torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1)
    cls = dataloader._MultiProcessingDataLoaderIter
    orig_init = cls.__dict__["__init__"]
    hook = sys.excepthook
    refs = []
    for r in range(3):
        refs.append(_cycle(tmp_path / f"r{r}"))  # the memory feature is on by default
        assert sys.excepthook == hook, f"cycle {r}: {sys.excepthook!r}"
        f = cls.__dict__["__init__"]
        assert f is orig_init, f"cycle {r}: wrapped {_wrapper_depth(f)} deep"
    assert _collected(refs) == [True, True, True]


def test_sessions_that_timed_one_model_are_not_kept_alive_by_it(tmp_path, clean_env):
    """A notebook that re-runs its training cell on the same model (or train, shut down, fine-tune
    it): each finished session stayed alive as long as the model did (23 of 23 after 23 cycles,
    ~0.3-1.4 MB each), through the FLOP counter's finalizer on the model (``weakref.finalize``
    keeps its callback, a method of the session's collector, until the model dies). The
    finalizers are detached at shutdown."""
    torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1)  # torch._dynamo's rule cache first (above)
    model = torch.nn.Linear(8, 8)
    refs = [_cycle(tmp_path / f"r{r}", model=model) for r in range(4)]
    assert _collected(refs) == [True] * 4


def test_an_oom_after_shutdown_writes_nothing_into_the_old_run_dirs(tmp_path, clean_env, capsys):
    runs = [tmp_path / f"r{r}" for r in range(3)]
    for run in runs:
        _cycle(run)
    before = {run: sorted(os.listdir(run)) for run in runs}
    try:
        raise MemoryError("a later notebook cell runs out of memory")
    except MemoryError as e:
        sys.excepthook(type(e), e, e.__traceback__)  # what Python does with an uncaught one
    assert "a later notebook cell runs out of memory" in capsys.readouterr().err  # still printed
    for run in runs:
        assert sorted(os.listdir(run)) == before[run]
        assert not [n for n in os.listdir(run) if n.startswith("oom-")]


def _fake_instrumentation(cls):
    """What hooks.install's Instrumentation does to the iterator's __init__: wraps it, and puts back
    at uninstall what it found, unconditionally."""
    found = cls.__dict__["__init__"]

    def __init__(it, *a, **k):
        found(it, *a, **k)

    __init__.__wrapped__ = found
    cls.__init__ = __init__
    return lambda: setattr(cls, "__init__", found)


@pytest.mark.parametrize("memory_first", [True, False], ids=["memory-stops-first", "instrumentation-first"])
def test_the_dataloader_patch_comes_off_in_either_order(memory_first):
    from stepwatch.memory import MemoryFeature

    cls = dataloader._MultiProcessingDataLoaderIter
    orig_init = cls.__dict__["__init__"]
    try:
        for _ in range(3):
            uninstall = _fake_instrumentation(cls)
            feat = MemoryFeature.__new__(MemoryFeature)  # the patch alone: no hub needed
            feat._iters = []
            feat._patch_dataloader()
            assert cls.__dict__["__init__"] is not orig_init
            if memory_first:
                feat._unpatch_dataloader()
                uninstall()
            else:
                uninstall()
                feat._unpatch_dataloader()
            assert cls.__dict__["__init__"] is orig_init
    finally:
        cls.__init__ = orig_init


def _fr_said(run_dir):
    rj = json.loads((run_dir / "run.json").read_text())
    return rj["features"]["capture"]["hang_watchdog"]["flight_recorder"]


def test_flight_recorder_variables_are_undone_at_shutdown(tmp_path, clean_env):
    for r in range(2):
        run = tmp_path / f"s{r}"
        seen = {}
        _cycle(run, during=lambda s: seen.update({k: os.environ.get(k) for k in FR_VARS}), watchdog="on",
               hang_timeout=60)
        assert seen["TORCH_FR_BUFFER_SIZE"] == "2000"
        assert seen["TORCH_FR_DUMP_TEMP_FILE"] == str(run / "nccl_flight_recorder.rank")
        assert {k: os.environ.get(k) for k in FR_VARS} == dict.fromkeys(FR_VARS)
        said = _fr_said(run)
        assert f"TORCH_FR_DUMP_TEMP_FILE={run / 'nccl_flight_recorder.rank'} (set by stepwatch)" in said, said
        assert "set by the job" not in said


def test_a_flight_recorder_value_the_job_set_is_kept(tmp_path, clean_env, monkeypatch):
    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "500")  # the job's, before init: left alone

    def job_sets(s):
        os.environ["TORCH_FR_DUMP_TEMP_FILE"] = "/job/chose/this"  # the job's, during the session

    _cycle(tmp_path / "run", during=job_sets, watchdog="on", hang_timeout=60)
    assert os.environ.get("TORCH_FR_DUMP_TEMP_FILE") == "/job/chose/this"
    assert os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE") == "500"
    assert "TORCH_FR_BUFFER_SIZE" not in os.environ
    assert "TORCH_NCCL_TRACE_BUFFER_SIZE=500 (set by the job)" in _fr_said(tmp_path / "run")


def test_a_flight_recorder_variable_set_empty_before_init_is_put_back_empty(tmp_path, clean_env, monkeypatch):
    monkeypatch.setenv("TORCH_FR_DUMP_TEMP_FILE", "")  # empty counts as unset: stepwatch sets it
    seen = {}
    _cycle(tmp_path / "run", during=lambda s: seen.update(v=os.environ.get("TORCH_FR_DUMP_TEMP_FILE")),
           watchdog="on", hang_timeout=60)
    assert seen["v"] == str(tmp_path / "run" / "nccl_flight_recorder.rank")
    assert os.environ.get("TORCH_FR_DUMP_TEMP_FILE") == ""

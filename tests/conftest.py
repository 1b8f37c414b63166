import os
import sys

# One intra-op thread for torch in the test processes and the jobs they start (torchrun sets the
# same for its ranks), before anything imports torch. With torch's default (a thread per core),
# two pytest-xdist workers ran four OpenMP threads on two cores, which spin while they wait: a
# 300-step MLP took 145 ms a step instead of 4, and the unit tests half again as long.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SRC = os.path.join(ROOT, "src")
if SRC not in sys.path:
    sys.path.insert(0, SRC)


@pytest.fixture(params=["c", "python"])
def both_tracker_cores(request, monkeypatch):
    """The test runs twice: sessions with the step tracker's, the root call's, the backward's, the
    optimizer pre-hook's and the DataLoader fetch's C cores (hooks/_ctracker.c, as installed) and
    with their Python cores (as where the extension could not be built)."""
    from stepwatch import _session
    from stepwatch.hooks import install, phases

    if request.param == "python":
        monkeypatch.setattr(_session, "StepTracker", phases.PyStepTracker)
        monkeypatch.setattr(install, "_RootCall", install._PyRootCall)
        monkeypatch.setattr(install, "_OptPre", install._PyOptPre)
        monkeypatch.setattr(install, "_Backward", install._PyBackward)
        monkeypatch.setattr(install, "_DataNext", install._PyDataNext)
    elif phases._Core is phases._PyCore:
        pytest.skip("the C tracker is not built here (no C compiler at install)")
    return request.param


@pytest.fixture(autouse=True)
def _fresh_warn_once():
    """Each test starts with stepwatch's warn-once memory empty (it is per process: a warning a
    test expects must not have been spent by an earlier test)."""
    from stepwatch import _log

    _log._warned.clear()
    yield


@pytest.fixture
def sw(tmp_path, monkeypatch):
    """A running stepwatch session writing to a temp run dir, with an in-memory exporter.

    Yields ``(stepwatch_module, memory_exporter, start)`` where ``start(**config)`` starts the
    session; it is always shut down after the test."""
    import stepwatch

    for k in list(os.environ):
        if k.startswith("STEPWATCH_"):
            monkeypatch.delenv(k)
    mem = stepwatch.InMemoryExporter()

    def start(**cfg):
        cfg.setdefault("dir", str(tmp_path / "run"))
        cfg.setdefault("console", "off")
        cfg.setdefault("flush_interval_s", 0.05)
        cfg.setdefault("exporters", [mem])
        return stepwatch.init(**cfg)

    yield stepwatch, mem, start
    stepwatch.shutdown()


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    """The native cuda_ext module: the built one, else compiled here (skips without a compiler)."""
    from stepwatch.cuda_ext import _testing

    try:
        return _testing.load_native(tmp_path_factory.mktemp("native"))
    except RuntimeError as exc:
        pytest.skip(f"native extension not built and cannot be compiled here: {exc}")


@pytest.fixture
def one_rank_group():
    """A real one-rank gloo process group for the test (torch.distributed), destroyed after it."""
    import socket

    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield dist
    finally:
        dist.destroy_process_group()


@pytest.fixture
def refuse_threads(monkeypatch):
    """``refuse(prefix)``: from then on ``threading.Thread.start`` raises for a thread whose name
    starts with ``prefix``, as Python 3.12.0-3.12.2 do for any thread started in an atexit hook
    (CPython gh-113964), where stepwatch's exit shutdown runs. The suite runs on 3.11: this is
    those releases, simulated (_os/threads.py)."""
    import threading

    real_start = threading.Thread.start

    def refuse(prefix):
        def refusing(self):
            if self.name.startswith(prefix):
                raise RuntimeError("can't create new thread at interpreter shutdown")
            return real_start(self)

        monkeypatch.setattr(threading.Thread, "start", refusing)

    return refuse

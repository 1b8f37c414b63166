"""stepwatch never breaks the job: internal errors, unwritable run dirs, forked workers, torch.compile."""

import json
import logging
import os
import shutil
import subprocess
import sys
import threading

import pytest
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset

pytestmark = pytest.mark.usefixtures("both_tracker_cores")  # tests/conftest.py


def _train(steps, model=None):
    torch.manual_seed(0)
    m = model or nn.Linear(8, 2)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        loss = m(torch.randn(4, 8)).pow(2).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_internal_error_is_counted_logged_once_and_disables(sw, caplog):
    stepwatch, mem, start = sw
    s = start()
    calls = {"n": 0}

    def broken(raw):
        calls["n"] += 1
        raise RuntimeError("injected")

    s.tracker._emit = broken
    with caplog.at_level(logging.WARNING, logger="stepwatch"):
        stepwatch_logger = logging.getLogger("stepwatch")
        stepwatch_logger.addHandler(caplog.handler)
        try:
            losses = _train(6)
        finally:
            stepwatch_logger.removeHandler(caplog.handler)
    assert len(losses) == 6  # training went on
    assert calls["n"] == 1  # the tracker disabled itself after the first failure
    assert s.failures.total == 1
    msgs = [r.getMessage() for r in caplog.records if "injected" in r.getMessage()]
    assert len(msgs) == 1
    stepwatch.shutdown()
    assert [f.kind for f in mem.findings] == ["internal_error"]


def test_unwritable_run_dir_warns_and_goes_on(sw, tmp_path, caplog):
    stepwatch, mem, start = sw
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    if os.access(ro, os.W_OK):  # root ignores permissions: use a path under a file instead
        blocker = tmp_path / "file"
        blocker.write_text("x")
        target = str(blocker / "run")
    else:
        target = str(ro / "run")
    logging.getLogger("stepwatch").addHandler(caplog.handler)
    try:
        start(dir=target)
        losses = _train(3)
        stepwatch.shutdown()
    finally:
        logging.getLogger("stepwatch").removeHandler(caplog.handler)
    assert len(losses) == 3
    assert len(mem.records) == 3  # other exporters still get everything
    assert any("going on without" in r.getMessage() and target in r.getMessage() for r in caplog.records)


UNWRITABLE_JOB = r"""
import sys, time, torch, stepwatch
stepwatch.init(dir=sys.argv[1], console="off", watchdog="on", capture="on")
torch.manual_seed(0)
m = torch.nn.Linear(8, 2); opt = torch.optim.SGD(m.parameters(), lr=0.1)
for i in range(int(sys.argv[2])):
    m(torch.randn(4, 8)).pow(2).sum().backward(); opt.step(); opt.zero_grad()
    time.sleep(0.4 if i == 40 else 0.01)  # one slow step: a step_time_spike, which starts a capture
stepwatch.shutdown()
print("final", float(m.weight.sum()))
"""


def test_an_unwritable_run_dir_is_said_once_with_the_watchdog_on(tmp_path, both_tracker_cores):
    """A read-only run directory was said 6 times a rank (stack-dump file, the sidecar's board
    file, records, the manifest twice, the comm timeline), one of them an ``internal_error``
    asking for a bug report. Once now, and the job's result is the same. (As root a directory's
    mode does not stop writes: the run directory is a path under a file, which nothing can
    create either.) A slow step starts a capture where the run directory can be written (the
    second job shows it did); where it cannot, no capture is taken (one ran under a loaded CI
    and said "capture.export cannot go on", a second line: its trace had nowhere to go)."""
    if both_tracker_cores == "python":  # the job is a subprocess: the fixture cannot reach it
        pytest.skip("one process run is enough: the tracker's core plays no part here")
    blocker = tmp_path / "file"
    blocker.write_text("x")
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEPWATCH_")}
    env["PYTHONPATH"] = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                     "src") + os.pathsep + env.get("PYTHONPATH", "")
    runs = [subprocess.run([sys.executable, "-c", UNWRITABLE_JOB, str(where), "80"], env=env, capture_output=True,
                           text=True, timeout=180) for where in (blocker / "run", tmp_path / "ok")]
    (bad, good) = runs
    assert bad.returncode == 0 and good.returncode == 0, bad.stderr[-2000:]
    assert bad.stdout == good.stdout  # the same training result
    assert list((tmp_path / "ok" / "captures").glob("*.trace.json.gz")), good.stderr[-2000:]
    said = [line for line in bad.stderr.splitlines() if "cannot" in line or "internal_error" in line]
    assert len(said) == 1 and str(blocker / "run") in said[0] and "is not a directory" in said[0], bad.stderr


def test_run_dir_files_are_private(sw, tmp_path):
    stepwatch, mem, start = sw
    run = tmp_path / "private"
    start(dir=str(run))
    _train(2)
    stepwatch.shutdown()
    assert (os.stat(run).st_mode & 0o777) == 0o700
    for name in os.listdir(run):
        assert (os.stat(run / name).st_mode & 0o777) == 0o600, name
    lines = (run / "steps.rank0.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [0, 1]
    manifest = json.loads((run / "run.json").read_text())
    assert manifest["world_size"] == 1 and manifest["steps"] == 2 and manifest["hosts"]


class WorkerProbe(Dataset):
    """Reports, from inside a forked DataLoader worker, what stepwatch does there."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        import io

        import stepwatch

        names = [t.name for t in threading.enumerate()]
        s = stepwatch.get_session()
        torch.save({"i": i}, io.BytesIO())  # hooks must be inert in the worker
        return torch.tensor(
            [os.getpid(), sum("stepwatch" in n for n in names), 0 if s is None else 1], dtype=torch.long
        )


def test_forked_workers_start_no_threads_and_write_nothing(sw, tmp_path):
    stepwatch, mem, start = sw
    run = tmp_path / "fork"
    start(dir=str(run))
    m = nn.Linear(3, 1)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    seen = []
    dl = DataLoader(WorkerProbe(), batch_size=2, num_workers=2, multiprocessing_context="fork")
    for batch in dl:
        seen.append(batch)
        m(batch.float()).sum().backward()
        opt.step()
        opt.zero_grad()
    stepwatch.shutdown()
    rows = torch.cat(seen)
    assert set(rows[:, 0].tolist()) and os.getpid() not in rows[:, 0].tolist()
    assert rows[:, 1].sum().item() == 0, "a stepwatch thread exists in a forked worker"
    assert rows[:, 2].sum().item() == 0, "the session is live in a forked worker"
    steps = [json.loads(x) for x in (run / "steps.rank0.jsonl").read_text().splitlines()]
    assert len(steps) == 4 and len(mem.records) == 4
    assert sorted(os.listdir(run)) == ["findings.rank0.jsonl", "rank0.json", "run.json", "steps.rank0.jsonl"]


class Net(nn.Module):
    # A user-defined module: dynamo skips torch's own modules' frames under m.compile().
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


class SeqFirstNet(nn.Module):
    """Seq-first attention (``batch_first=False``): its first call is one the layout probe looks
    into (metrics/tokens.py)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.enc = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0)
        self.out = nn.Linear(16, 4)

    def forward(self, x):
        return self.out(self.enc(self.emb(x)))


@pytest.mark.parametrize("net, batch", [(Net, lambda: torch.randn(8, 16)), (Net, lambda: torch.randn(16)),
                                        (SeqFirstNet, lambda: torch.randint(0, 50, (12, 3)))],
                         ids=["batch", "one unbatched sample", "seq-first"])
@pytest.mark.parametrize("mode", ["wrap", "inplace"])
def test_torch_compile_gets_no_extra_graph_breaks_or_recompiles(mode, net, batch, sw):
    """dynamo's own counters, with and without stepwatch, for torch.compile(m) and m.compile().
    A seq-first model's first call was probed with global module hooks, which dynamo traced: a
    graph break and two more graphs."""
    from torch._dynamo.utils import counters

    stepwatch, mem, start = sw

    def run():
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        m = net()
        if mode == "wrap":
            cm = torch.compile(m, backend="eager")
        else:
            m.compile(backend="eager")
            cm = m
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        losses = []
        for _ in range(6):
            loss = cm(batch()).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        snap = {k: dict(v) for k, v in counters.items() if k in ("graph_break", "recompiles", "stats", "frames")}
        return losses, snap

    base_losses, base = run()
    start()
    sw_losses, with_sw = run()
    stepwatch.shutdown()
    assert base["stats"].get("calls_captured", 0) > 0, base  # compilation really happened
    assert with_sw == base
    assert sw_losses == base_losses
    assert len(mem.records) == 6
    assert all(r.forward_s > 0 for r in mem.records[1:]), "forward timed outside the compiled region"


def test_a_root_call_skips_only_a_compiling_check_that_is_constant(sw, monkeypatch, tmp_path, both_tracker_cores):
    """The C root call does not call torch's ``is_dynamo_compiling`` (``return False`` outside
    dynamo's tracing, which never runs C code): no Python frame a root call. A check that can
    say True (any other function) is still called, by either core, and a call it says is being
    compiled passes through untimed."""
    from stepwatch.hooks import install

    stepwatch, mem, start = sw
    start()
    m = nn.Linear(4, 1)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    call = m.__dict__["_compiled_call_impl"]
    assert (call.dynamo is None) == (both_tracker_cores == "c")
    if both_tracker_cores == "python":
        assert call.dynamo is torch.compiler.is_dynamo_compiling
    stepwatch.shutdown()

    flag = [False]
    asked = []

    def compiling():
        asked.append(flag[0])
        return flag[0]

    monkeypatch.setattr(torch.compiler, "is_dynamo_compiling", compiling)
    assert not install._constant_false(compiling)
    mem.records.clear()
    start(dir=str(tmp_path / "run2"))
    m = nn.Linear(4, 1)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for i in range(4):
        flag[0] = i == 3  # the last step's forward "inside dynamo's tracing"
        m(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    stepwatch.shutdown()
    assert asked.count(False) >= 3 and asked[-1] is True and asked.count(True) == 1  # asked at every call
    assert len(mem.records) == 4
    assert all(r.forward_s > 0 for r in mem.records[:3]) and mem.records[3].forward_s == 0


def test_nvtx_makes_no_call_when_no_tool_can_listen(sw, monkeypatch, caplog):
    """No NVTX tool named in the environment (nsys sets NVTX_INJECTION64_PATH in the job it
    launches) and none loaded: every range would be a no-op, so none is opened, and run.json
    says NVTX is off. Named or loaded: on (the tests below)."""
    import nvtx

    from stepwatch.hooks.nvtx import Nvtx, tool_injected

    stepwatch, mem, start = sw
    calls = []
    monkeypatch.setattr(nvtx, "get_domain", lambda name: calls.append(name))
    for name in ("NVTX_INJECTION64_PATH", "NVTX_INJECTION32_PATH"):
        monkeypatch.delenv(name, raising=False)
    with caplog.at_level(logging.INFO, logger="stepwatch"):
        s = start()
    assert "NVTX ranges off: no NVTX tool in this process" in caplog.text
    m = nn.Linear(4, 1)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for x in DataLoader(torch.randn(4, 4), batch_size=2):
        with stepwatch.phase("work"):
            m(x).sum().backward()
        opt.step()
    run_dir = s.ctx.run_dir
    stepwatch.shutdown()
    assert calls == [] and len(mem.records) == 2
    with open(os.path.join(run_dir, "run.json")) as f:
        assert json.load(f)["features"]["nvtx"] is False
    assert Nvtx(True).enabled is False and calls == []
    assert tool_injected({"NVTX_INJECTION32_PATH": "/t.so"})
    assert not tool_injected({"NVTX_INJECTION64_PATH": " ", "LD_PRELOAD": "/usr/lib/libjemalloc.so.2"})


def test_nvtx_sees_a_tool_already_loaded_in_the_process(tmp_path, both_tracker_cores):
    """NVTX's first lookup: an injection entry point in a library the process has loaded into its
    global scope (a preloaded tool), no variable set. A library with that entry point is built
    here and loaded in a fresh interpreter (the lookup is process-wide: not in pytest's)."""
    if both_tracker_cores == "python":  # the job is a subprocess: the fixture cannot reach it
        pytest.skip("one process run is enough: the tracker's core plays no part here")
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the stand-in NVTX tool")
    src, lib = tmp_path / "tool.c", tmp_path / "libtool.so"
    src.write_text("int InitializeInjectionNvtx2(void *get_export_table) { (void)get_export_table; return 0; }\n")
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib), str(src)], check=True, capture_output=True)
    code = (
        "import ctypes, sys\n"
        "from stepwatch.hooks.nvtx import tool_injected\n"
        "before = tool_injected({})\n"
        "ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL)\n"
        "print(before, tool_injected({}))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("NVTX_INJECTION64_PATH", "NVTX_INJECTION32_PATH")}
    out = subprocess.run([sys.executable, "-c", code, str(lib)], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "True"]


def test_nvtx_ranges_nest_per_step(sw, monkeypatch):
    """The real ``Nvtx`` over a recording domain (``nvtx.get_domain`` replaced: without a
    profiler the package's own domain is a no-op that shows nothing)."""
    import nvtx

    stepwatch, mem, start = sw
    events = []

    class Domain:
        def get_event_attributes(self, message):
            return message

        def push_range(self, attributes):
            events.append(("push", attributes))

        def pop_range(self):
            events.append(("pop",))

    monkeypatch.setattr(nvtx, "get_domain", lambda name: Domain())
    monkeypatch.setenv("NVTX_INJECTION64_PATH", "/opt/nsys/libToolsInjection64.so")  # as under nsys
    start()
    m = nn.Linear(4, 1)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for x in DataLoader(torch.randn(4, 4), batch_size=2):
        m(x).sum().backward()
        opt.step()
        opt.zero_grad()
    stepwatch.shutdown()
    pushes = [e[1] for e in events if e[0] == "push"]
    # The loader's last fetch (StopIteration) starts a step that never reaches an optimizer: its
    # range opens and is closed at shutdown, and it makes no record.
    assert pushes == ["step_0", "forward", "backward", "optimizer", "step_1", "forward", "backward", "optimizer", "step_2"]
    assert len(mem.records) == 2
    depth = 0
    for e in events:
        depth += 1 if e[0] == "push" else -1
        assert depth >= 0
    assert depth == 0


def test_roots_keep_torchs_fast_path_and_are_unwrapped_at_shutdown(sw):
    """A root's call is wrapped (``_compiled_call_impl``), not hooked: torch's no-hook fast path
    stays, forward is still timed, and shutdown leaves the module as it was."""
    stepwatch, mem, start = sw
    start()
    torch.manual_seed(0)
    m, loss_mod = Net(), nn.MSELoss()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for _ in range(3):
        loss_mod(m(torch.randn(8, 16)), torch.zeros(8, 4)).backward()
        opt.step()
        opt.zero_grad()
    for mod in (m, loss_mod):
        assert not mod._forward_pre_hooks and not mod._forward_hooks, "a forward hook: torch's slow path"
        assert type(mod.__dict__.get("_compiled_call_impl")).__module__.startswith("stepwatch")
    stepwatch.shutdown()
    assert "_compiled_call_impl" not in m.__dict__ and "_compiled_call_impl" not in loss_mod.__dict__
    assert len(mem.records) == 3 and all(r.forward_s > 0 for r in mem.records)


def test_compile_in_place_after_the_scan_is_still_timed_outside_the_compiled_code(sw):
    """``model.compile()`` after stepwatch hooked the model: the compiled callable is wrapped."""
    stepwatch, mem, start = sw
    start()
    torch.manual_seed(0)
    m = Net()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)  # the scan hooks m here
    m.compile(backend="eager")
    losses = []
    for _ in range(4):
        loss = m(torch.randn(8, 16)).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    call = m.__dict__["_compiled_call_impl"]
    assert type(call).__module__.startswith("stepwatch") and call.inner is not m._call_impl
    stepwatch.shutdown()
    assert len(mem.records) == 4 and all(r.forward_s > 0 for r in mem.records[1:])
    assert m.__dict__["_compiled_call_impl"] is call.inner  # the compiled callable, given back


def test_an_exception_from_a_root_forward_shows_no_stepwatch_frame(sw):
    """Roots are timed by wrapping their call (hooks/install.py _RootCall): an exception from the
    user's forward must reach them with their own frames and torch's only, as without stepwatch
    (the memory job test compares whole tracebacks; this is its fast form)."""
    import traceback

    stepwatch, _, start = sw
    start()

    class Boom(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, x):
            raise ValueError("boom")

    net = Boom()
    torch.optim.SGD(net.parameters(), lr=0.1)  # the optimizer's construction finds the roots
    assert "Boom" in stepwatch.get_session().instrumentation.roots
    with pytest.raises(ValueError, match="boom") as info:
        net(torch.ones(1, 2))
    files = [f.filename for f in traceback.extract_tb(info.value.__traceback__)]
    assert not [f for f in files if "/stepwatch/" in f], files
    assert files[-1] == __file__  # where it was raised

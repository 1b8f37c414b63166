"""A run's start and end as the run directory shows them: SIGTERM still writes the final
manifest, a second launch keeps the first one's rank file, stale progress boards are cleaned."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TRAIN = r"""
import sys, time, torch, stepwatch
stepwatch.init(dir=sys.argv[1], console="off", flush_interval_s=0.05, watchdog="off", capture="off")
m = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(m.parameters(), lr=0.1)
for _ in range(int(sys.argv[2])):
    m(torch.randn(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
print("trained", flush=True)
if sys.argv[3] == "sleep":
    time.sleep(120)  # killed here, as torchrun or a scheduler would
elif sys.argv[3] != "exit":
    # stuck in C++ with the GIL released, as a rank in a collective whose peer died: a Python
    # signal handler would not run before this returns (60 s)
    import datetime
    from torch.distributed import TCPStore
    TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=60)).get("never")
"""


def _env():
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEPWATCH_")}
    env["PYTHONPATH"] = os.path.join(ROOT, "src") + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _run_and_term(run, steps, how="sleep"):
    p = subprocess.Popen([sys.executable, "-c", TRAIN, str(run), str(steps), how], env=_env(),
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "trained"
        time.sleep(0.5)  # inside the sleep / the store call
        t0 = time.monotonic()
        p.send_signal(signal.SIGTERM)
        rc = p.wait(60)
        return rc, time.monotonic() - t0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


@pytest.mark.parametrize("how", ["sleep", "stuck_in_cxx"])
def test_sigterm_writes_the_final_manifest_and_still_dies_of_sigterm(tmp_path, how):
    run = tmp_path / "run"
    rc, took = _run_and_term(run, 7, how)
    assert rc == -signal.SIGTERM  # the job's exit status is what it was without stepwatch
    assert took < 15  # a stuck rank still ends within seconds, as it did without stepwatch
    m = json.loads((run / "run.json").read_text())
    assert m["end_time"] is not None and m["steps"] == 7
    assert m["ended_by"] == "SIGTERM"  # stopped, not finished: the report says so
    assert len((run / "steps.rank0.jsonl").read_text().splitlines()) == 7


def test_a_job_with_its_own_sigterm_handler_keeps_it(tmp_path):
    code = ("import signal, stepwatch; h = lambda s, f: None; signal.signal(signal.SIGTERM, h); "
            f"stepwatch.init(dir={str(tmp_path / 'run')!r}, console='off', watchdog='off', capture='off'); "
            "assert signal.getsignal(signal.SIGTERM) is h; stepwatch.shutdown(); "
            "assert signal.getsignal(signal.SIGTERM) is h; print('ok')")
    r = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


THREAD_SHUTDOWN = r"""
import gc, os, signal, sys, threading, time, weakref, torch, stepwatch

def train(n):
    m = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for _ in range(n):
        m(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()

# torch's first optimizer imports torch._dynamo, whose rule cache keeps the torch.autograd.grad
# of that moment (stepwatch's wrapper, inside a session) for good: made before any session here.
torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1)
first = stepwatch.init(dir=sys.argv[1] + "/s1", console="off", watchdog="off", capture="off")
t = threading.Thread(target=lambda: (train(5), stepwatch.shutdown()))
t.start()
t.join()
gone = weakref.ref(first)
del first, t
for _ in range(40):  # its own threads end a moment after the shutdown
    gc.collect()
    if gone() is None:
        break
    time.sleep(0.05)
print("first freed", gone() is None, flush=True)
stepwatch.init(dir=sys.argv[1] + "/s2", console="off", watchdog="off", capture="off", flush_interval_s=0.05)
train(int(sys.argv[2]))
print("trained", flush=True)
time.sleep(120)
"""


def test_a_session_after_one_shut_down_off_the_main_thread_still_finishes_on_sigterm(tmp_path):
    """Session 1 shut down on a trainer thread (a notebook helper): ``signal.signal`` is
    main-thread only, so its SIGTERM handler stayed, bound to the closed session; the next
    session found a handler that was not the default, installed none, and a SIGTERM then wrote 1
    of its 300 records and a run.json that never ended. The old handler is retired (it holds
    nothing of its session, which is freed) and the next session on the main thread takes over."""
    p = subprocess.Popen([sys.executable, "-c", THREAD_SHUTDOWN, str(tmp_path), "300"], env=_env(),
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "first freed True"
        assert p.stdout.readline().strip() == "trained"
        time.sleep(0.5)
        p.send_signal(signal.SIGTERM)
        rc = p.wait(30)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert rc == -signal.SIGTERM
    m = json.loads((tmp_path / "s2" / "run.json").read_text())
    assert m["ended_by"] == "SIGTERM" and m["steps"] == 300, m
    assert len((tmp_path / "s2" / "steps.rank0.jsonl").read_text().splitlines()) == 300


def test_a_second_launch_in_the_same_dir_keeps_the_first_ones_rank_file(sw, tmp_path):
    stepwatch, mem, start = sw
    run = tmp_path / "run"
    start(dir=str(run))
    stepwatch.shutdown()
    first = json.loads((run / "rank0.json").read_text())
    start(dir=str(run))
    stepwatch.shutdown()
    assert json.loads((run / "rank0.json").read_text()) == first
    second = json.loads((run / "rank0.1.json").read_text())
    assert second["start_time"] > first["start_time"]
    assert sorted(n for n in os.listdir(run) if n.startswith("run")) == ["run.1.json", "run.json"]


def test_a_killed_launchs_disk_reserve_is_given_back_by_the_next_and_hosts_are_the_launchs_own(tmp_path):
    """A rank 0 SIGKILLed (the OOM killer, a scheduler's kill after its grace period) left its
    64 KiB ``.reserve.rank0.<pid>`` for good, one more each such launch; the next launch on the
    host removes a dead process's. And a relaunch's ``run.<K>.json`` listed the hosts of every
    earlier launch (a rank file of another host's launch here)."""
    run = tmp_path / "run"
    p = subprocess.Popen([sys.executable, "-c", TRAIN, str(run), "3", "sleep"], env=_env(), stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "trained"
        time.sleep(0.3)
    finally:
        p.kill()
        p.wait()
    left = [n for n in os.listdir(run) if n.startswith(".reserve")]
    assert len(left) == 1 and left[0].endswith(f".{p.pid}"), left  # the killed launch's
    (run / "rank1.json").write_text(json.dumps({"rank": 1, "host": "old-node-7"}))  # another host, that launch
    r = subprocess.run([sys.executable, "-c", TRAIN, str(run), "3", "exit"], env=_env(), capture_output=True,
                       text=True, timeout=120)
    assert "trained" in r.stdout, r.stderr[-2000:]
    assert not [n for n in os.listdir(run) if n.startswith(".reserve")], os.listdir(run)
    hosts = json.loads((run / "run.1.json").read_text())["hosts"]
    assert "old-node-7" not in hosts and len(hosts) == 1, hosts


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")
def test_stale_boards_of_killed_trainers_are_removed_at_start_only_ours(sw, tmp_path):
    stepwatch, mem, start = sw
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    uid = os.getuid()
    victim = tmp_path / "victim"
    victim.write_text("keep")
    shm = "/dev/shm"
    names = {
        "stale": f"stepwatch-{uid}-job-x-1-rank0-{dead.pid}.board",
        "young": f"stepwatch-{uid}-job-y-rank0-{dead.pid}.board",
        "alive": f"stepwatch-{uid}-job-x-rank1-{alive.pid}.board",
        "other_user": f"stepwatch-{uid + 1}-job-x-rank0-{dead.pid}.board",
        "not_ours": f"someone-{uid}-job-x-rank0-{dead.pid}.board",
        "link": f"stepwatch-{uid}-job-z-rank0-{dead.pid}.board",
    }
    paths = {k: os.path.join(shm, n) for k, n in names.items()}
    try:
        for k, p in paths.items():
            if k == "link":
                os.symlink(victim, p)
            else:
                with open(p, "wb") as f:
                    f.write(b"\0" * 64)
            if k != "young":
                os.utime(p, (time.time() - 3600, time.time() - 3600), follow_symlinks=False)
        start(dir=str(tmp_path / "run"), watchdog="on", capture="off")
        gone = {k for k, p in paths.items() if not os.path.lexists(p)}
        assert gone == {"stale"}
        assert victim.read_text() == "keep"
        stepwatch.shutdown()
    finally:
        alive.kill()
        alive.wait()
        for p in paths.values():
            if os.path.lexists(p):
                os.unlink(p)


def test_a_checkpoint_after_the_last_step_is_no_step_in_the_manifest_or_the_console(tmp_path):
    """The save after the loop goes to a tail record (README "What is measured"); run.json's
    ``steps`` and the console's closing "done: N steps" counted it as one more step, and the
    console's last line named its step and took its zero step time into p50 and steps/s."""
    code = (
        "import io, sys, torch, stepwatch\n"
        "stepwatch.init(dir=sys.argv[1], console='on')\n"
        "m = torch.nn.Linear(4, 1); opt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
        "for _ in range(6):\n"
        "    m(torch.randn(8, 4)).sum().backward(); opt.step(); opt.zero_grad()\n"
        "torch.save(m, io.BytesIO())\n"
        "stepwatch.shutdown()\n"
    )
    run = tmp_path / "run"
    p = subprocess.run([sys.executable, "-c", code, str(run)], env=_env(), capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    lines = [json.loads(x) for x in (run / "steps.rank0.jsonl").read_text().splitlines()]
    assert [x.get("tail", False) for x in lines] == [False] * 6 + [True]  # the save is the tail
    assert json.loads((run / "run.json").read_text())["steps"] == 6
    done = [x for x in p.stderr.splitlines() if "done:" in x]
    assert len(done) == 1 and done[0].endswith("done: 6 steps") and "| step 5 |" in done[0], done


ENDED = {  # how the job ends at step 3: (its exit status, run.json's ended_by)
    "finished": (0, "shutdown"),
    "raised": (1, "uncaught RuntimeError: bad batch at step 3"),
    "raised_long": (1, "uncaught RuntimeError: " + "x" * 200 + "…"),  # cut, and it says so
    "exit_3": (3, "exit 3"),
    "exit_message": (1, "exit 1: no data left"),
    "exit_0": (0, "shutdown"),
    "exit_caught": (0, "shutdown"),  # a SystemExit the script caught, training on after it
}


@pytest.mark.parametrize("how", list(ENDED))
def test_the_manifest_says_how_the_job_ended(tmp_path, how):
    """A rank that died of an uncaught exception wrote the same end_time as one that finished:
    the report showed "ended <time>" for a crashed job. run.json's ``ended_by`` says which, and
    the report shows it beside the end time. A script that ends itself with ``sys.exit(3)`` (a
    NaN check, a failed precondition) read ``shutdown`` as a finished one did: the rank that gave
    up was the one the report did not name among the ranks that stopped."""
    code = (
        "import sys, torch, stepwatch\n"
        "how, interpreters = sys.argv[2], sys.exit\n"
        "stepwatch.init(dir=sys.argv[1], console='off')\n"
        "m = torch.nn.Linear(4, 1); opt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
        "for i in range(5):\n"
        "    if i == 3 and how == 'raised':\n"
        "        raise RuntimeError('bad batch at step 3')\n"
        "    if i == 3 and how == 'raised_long':\n"
        "        raise RuntimeError('x' * 300)\n"
        "    if i == 3 and how == 'exit_3':\n"
        "        sys.exit(3)\n"
        "    if i == 3 and how == 'exit_message':\n"
        "        sys.exit('no data left')\n"
        "    if i == 3 and how == 'exit_0':\n"
        "        sys.exit(0)\n"
        "    if i == 1 and how == 'exit_caught':\n"
        "        try:\n"
        "            sys.exit(3)\n"
        "        except SystemExit:\n"
        "            pass\n"
        "    m(torch.randn(8, 4)).sum().backward(); opt.step(); opt.zero_grad()\n"
        "if how == 'exit_caught':\n"
        "    stepwatch.shutdown()\n"
        "    assert sys.exit is interpreters, 'the shutdown leaves sys.exit as it found it'\n"
    )
    run = tmp_path / "run"
    p = subprocess.run([sys.executable, "-c", code, str(run), how], env=_env(), capture_output=True, text=True,
                       timeout=120)
    status, want = ENDED[how]
    assert p.returncode == status, p.stderr  # the script's own exit status, unchanged
    m = json.loads((run / "run.json").read_text())
    assert m["end_time"] is not None
    assert m["ended_by"] == want
    rank = json.loads((run / "rank0.json").read_text())
    assert rank["ended_by"] == want
    r = subprocess.run([sys.executable, "-m", "stepwatch", "report", str(run), "--no-html"], env=_env(),
                       capture_output=True, text=True, timeout=120)
    flat = "".join(r.stdout.split())  # a long ended_by wraps in the report's table
    assert ("stopped,notfinished" in flat) == (want != "shutdown"), r.stdout
    assert want == "shutdown" or "".join(want.split()) in flat, r.stdout



CRASH = r"""
import sys, torch
order = sys.argv[2]

def wrap():
    # A hook installed after stepwatch's that only passes the exception on to the one it found,
    # as sentry_sdk's ExcepthookIntegration does (sentry_sdk/integrations/excepthook.py).
    prev = sys.excepthook
    def hook(t, v, tb):
        prev(t, v, tb)
    sys.excepthook = hook

def replace():
    # A hook installed after stepwatch's that prints the exception itself and calls no other, as
    # rich.traceback.install() and loguru do.
    import traceback
    sys.excepthook = lambda t, v, tb: traceback.print_exception(t, v, tb)

def start_stepwatch():
    import stepwatch
    stepwatch.init(dir=sys.argv[1], console="off", memory=sys.argv[3] == "memory")

if order == "wandb_first":
    import wandb
    wandb.init(project="p", mode="offline")
    start_stepwatch()
else:
    start_stepwatch()
    if order == "then_wandb":
        import wandb
        wandb.init(project="p", mode="offline")
    elif order == "then_a_wrapper":
        wrap()
    elif order == "then_a_replacement":
        replace()
m = torch.nn.Linear(4, 1); opt = torch.optim.SGD(m.parameters(), lr=0.1)
for i in range(5):
    if i == 3 and sys.argv[4:] == ["exit"]:
        sys.exit(3)
    if i == 3:
        raise RuntimeError("bad batch at step 3")
    m(torch.randn(8, 4)).sum().backward(); opt.step(); opt.zero_grad()
"""


@pytest.mark.parametrize("order, memory", [
    *[(order, "no_memory") for order in ("alone", "then_wandb", "wandb_first", "then_a_wrapper", "then_a_replacement")],
    ("then_wandb", "memory"),
])
def test_a_crash_prints_its_traceback_once_whoever_hooks_after_stepwatch(tmp_path, order, memory):
    """W&B's excepthook (real wandb, offline) prints the traceback and then calls the hook it
    replaced; when that was stepwatch's (``import stepwatch.auto`` first, then ``wandb.init()``),
    stepwatch's called Python's default printer: the user's traceback twice. A hook that only
    passes the exception on (a stand-in shaped as sentry_sdk's) must still get it printed once;
    and run.json says how the job ended, whatever the order: also when a hook that calls no other
    (rich's, loguru's) replaced stepwatch's, which then never saw the exception (``shutdown``)."""
    if order in ("then_wandb", "wandb_first"):
        pytest.importorskip("wandb")
    env = _env()
    env = {k: v for k, v in env.items() if not k.startswith("WANDB_")}
    env.update(WANDB_MODE="offline", WANDB_DIR=str(tmp_path), WANDB_SILENT="true")
    run = tmp_path / "run"
    p = subprocess.run([sys.executable, "-c", CRASH, str(run), order, memory], env=env, cwd=tmp_path, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode != 0
    assert p.stderr.count("RuntimeError: bad batch at step 3") == 1, p.stderr
    assert p.stderr.count("Traceback (most recent call last)") == 1, p.stderr
    assert json.loads((run / "run.json").read_text())["ended_by"] == "uncaught RuntimeError: bad batch at step 3"


@pytest.mark.parametrize("order", ["then_wandb", "wandb_first"])
def test_an_exit_status_is_said_whoever_else_wraps_sys_exit(tmp_path, order):
    """W&B wraps ``sys.exit`` to learn the exit status (``ExitHooks``), as stepwatch does for
    ``ended_by``: with real wandb (offline) wrapped over stepwatch's or under it, ``sys.exit(3)``
    still ends the job with status 3, and run.json says so."""
    pytest.importorskip("wandb")
    env = {k: v for k, v in _env().items() if not k.startswith("WANDB_")}
    env.update(WANDB_MODE="offline", WANDB_DIR=str(tmp_path), WANDB_SILENT="true")
    run = tmp_path / "run"
    p = subprocess.run([sys.executable, "-c", CRASH, str(run), order, "no_memory", "exit"], env=env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 3, p.stderr
    assert "Traceback" not in p.stderr, p.stderr
    assert json.loads((run / "run.json").read_text())["ended_by"] == "exit 3"


ADOPT_AT_EXIT = r"""
import atexit, sys, torch, stepwatch
from stepwatch.exporters.base import Exporter

class Late(Exporter):
    name = "late"
    def export(self, batch):
        pass

late = Late()
stepwatch.init(dir=sys.argv[1], console="off", exporters=[late])
m = torch.nn.Linear(4, 1); opt = torch.optim.SGD(m.parameters(), lr=0.1)
for i in range(3):
    m(torch.randn(8, 4)).sum().backward(); opt.step(); opt.zero_grad()

def adopt():
    # What the W&B sink does when it first sees its run (exporters/wandb.py): move stepwatch's
    # exit shutdown ahead of the library's exit hook. Here it happens while the interpreter runs
    # its exit hooks already (a run first seen at exit).
    atexit.unregister(late.exit_first)
    atexit.register(late.exit_first)

atexit.register(adopt)
"""


def test_an_exporter_moving_the_exit_shutdown_while_exit_hooks_run_never_cancels_it(tmp_path):
    """An exporter re-registering ``exit_first`` during interpreter exit took out the session's
    own exit shutdown (the same bound method, unregistered): run.json had no end time, no steps,
    no ended_by -- 1 crash run in ~5 under W&B, where the sink first saw its run at exit."""
    run = tmp_path / "run"
    p = subprocess.run([sys.executable, "-c", ADOPT_AT_EXIT, str(run)], env=_env(), capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    manifest = json.loads((run / "run.json").read_text())
    assert manifest["end_time"] is not None and manifest["steps"] == 3 and manifest["ended_by"] == "shutdown", manifest


def test_an_exception_a_notebook_kept_is_not_how_the_job_ended(sw, monkeypatch):
    """The interpreter keeps the last exception it printed (``sys.last_value``), and so does a
    notebook for a cell's, and the job goes on. Only one printed while the session ran, with
    stepwatch's excepthook replaced by one that may not pass it on, is taken as the job's end."""
    stepwatch, _, start = sw
    cases = [("before init, hook replaced", True, True), ("while running, our hook in place", False, False)]
    for label, before, replace in cases:
        monkeypatch.delattr(sys, "last_value", raising=False)
        monkeypatch.delattr(sys, "last_exc", raising=False)
        if before:
            monkeypatch.setattr(sys, "last_value", RuntimeError("a cell of before"), raising=False)
        s = start(console="off")
        if replace:
            monkeypatch.setattr(sys, "excepthook", lambda *a: None)
        if not before:
            monkeypatch.setattr(sys, "last_value", RuntimeError("a cell that failed"), raising=False)
        stepwatch.shutdown()
        monkeypatch.undo()
        with open(os.path.join(s.ctx.run_dir, "run.json")) as f:
            assert json.load(f)["ended_by"] == "shutdown", label

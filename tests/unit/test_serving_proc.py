"""serve-vllm: process trees, stall dumps with the real py-spy, the wrapper's signals and exit codes.

Real processes throughout: a small Python tree stands in for vLLM's API server -> EngineCore ->
Worker (tests/fixtures/vllm/fake_server.py); py-spy dumps it for real. The real vLLM runs in
tests/integration/test_vllm_serve.py.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import time

import pytest

from stepwatch._os.ptrace import find_pyspy
from stepwatch._os import procs
from stepwatch.serving.stall import Dump, capture_stall, parse_pyspy, verdict
from stepwatch.serving.wrapper import VllmServer, is_vllm_command, server_url, with_load_tracking

FIX = os.path.join(os.path.dirname(__file__), "..", "fixtures", "vllm")
FAKE = os.path.join(FIX, "fake_server.py")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_tree(root: int, n: int, timeout: float = 20.0) -> list[procs.ProcStat]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        t = procs.tree(root)
        if len(t) >= n:
            return t
        time.sleep(0.05)
    raise AssertionError(f"tree of {root} never reached {n} processes: {procs.tree(root)}")


def _kill_all(w: subprocess.Popen, tree: list[procs.ProcStat]) -> None:
    """A test's cleanup: the wrapper's process group, then whatever of the server tree is left."""
    if w.poll() is None:
        os.killpg(w.pid, signal.SIGKILL)
        w.wait()
    for t in tree:
        if procs.alive(t.pid, t.starttime):
            os.kill(t.pid, signal.SIGKILL)


def test_parse_real_pyspy_dump_of_a_stalled_enginecore():
    with open(os.path.join(FIX, "pyspy-0.4.3-stalled-enginecore.txt"), encoding="utf-8") as f:
        threads = parse_pyspy(f.read())
    assert len(threads) == 5
    main = threads["10064"]
    assert main["name"] == "MainThread" and main["status"] == "idle"
    assert main["frames"][0] == "Poller.poll (zmq/sugar/poll.py:106)"
    assert "EngineCore.step (vllm/v1/engine/core.py:674)" in main["frames"]


def test_verdict_without_stopped_process_picks_the_deepest_unmoving_one():
    with open(os.path.join(FIX, "pyspy-0.4.3-stalled-enginecore.txt"), encoding="utf-8") as f:
        same = f.read()
    moved = same.replace("Poller.poll (zmq/sugar/poll.py:106)", "Poller.poll (zmq/sugar/poll.py:107)")
    stats = {1: procs.ProcStat(1, "api", "S", 0, 1, 1), 2: procs.ProcStat(2, "core", "S", 1, 1, 1),
             3: procs.ProcStat(3, "worker", "S", 2, 1, 1)}
    first = {p: Dump(p, "S", True, same, 0.1, False) for p in stats}
    second = {1: Dump(1, "S", True, same, 0.1, False), 2: Dump(2, "S", True, same, 0.1, False),
              3: Dump(3, "S", True, moved, 0.1, False)}
    v = verdict(1, stats, first, second)
    assert v["stuck"]["pid"] == 2  # 3 moved; 2 is the deepest that did not
    assert v["stuck"]["where"]["frames"][0].startswith("Poller.poll")
    rows = {r["pid"]: r for r in v["processes"]}
    assert rows[3]["stacks_moved"] is True and rows[1]["stacks_moved"] is False


def test_stall_capture_dumps_every_process_and_names_the_stopped_one(tmp_path):
    pyspy = find_pyspy()
    if pyspy is None:
        pytest.skip("py-spy not installed (pip install py-spy)")
    ready = tmp_path / "ready"
    ready.mkdir()
    p = subprocess.Popen([sys.executable, FAKE, "--port", str(free_port())], stdout=subprocess.DEVNULL,
                         start_new_session=True, env={**os.environ, "FAKE_READY_DIR": str(ready)})
    try:
        tree = wait_tree(p.pid, 3)
        worker = tree[-1].pid
        deadline = time.monotonic() + 20
        while not (ready / f"worker.{worker}").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        os.kill(worker, signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while procs.read_stat(worker).state != "T" and time.monotonic() < deadline:
            time.sleep(0.02)
        report = capture_stall(p.pid, str(tmp_path / "stall-1"), pyspy=pyspy, info={"in_flight": 3},
                               gap_s=0.3)
        files = sorted(os.listdir(tmp_path / "stall-1"))
        assert files == sorted(["report.json"] + [f"stacks.{t.pid}.txt" for t in tree])
        if report["dumped"] == 0:
            pytest.skip(f"py-spy cannot attach here: {report['processes'][0]['error']}")
        assert report["dumped"] == 3
        assert report["stuck"]["pid"] == worker and report["stuck"]["state"] == "T"
        assert "stopped" in report["stuck"]["why"][0]
        assert report["stuck"]["where"]["frames"]  # where it sleeps
        on_disk = json.loads((tmp_path / "stall-1" / "report.json").read_text())
        assert on_disk["stuck"]["pid"] == worker and on_disk["in_flight"] == 3
        text = (tmp_path / "stall-1" / f"stacks.{worker}.txt").read_text()
        assert "--nonblocking" in text and "Thread" in text and "## sample 2" in text
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def test_tree_and_alive():
    p = subprocess.Popen([sys.executable, FAKE, "--port", str(free_port())], stdout=subprocess.DEVNULL,
                         start_new_session=True)
    try:
        tree = wait_tree(p.pid, 3)
        assert tree[0].pid == p.pid and tree[1].ppid == p.pid and tree[2].ppid == tree[1].pid
        assert procs.alive(tree[2].pid, tree[2].starttime)
        assert not procs.alive(tree[2].pid, tree[2].starttime + 1)  # a re-used pid is not ours
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    assert procs.tree(p.pid) == []


def test_command_helpers():
    api = ["python", "-m", "vllm.entrypoints.openai.api_server", "--model", "m", "--port", "9001"]
    assert is_vllm_command(api) and is_vllm_command(["vllm", "serve", "m"])
    assert not is_vllm_command(["python", "server.py"])
    assert with_load_tracking(api)[-1] == "--enable-server-load-tracking"
    assert with_load_tracking(with_load_tracking(api)).count("--enable-server-load-tracking") == 1
    assert with_load_tracking(["python", "x.py"]) == ["python", "x.py"]
    assert server_url(api) == "http://127.0.0.1:9001"
    assert server_url(["vllm", "serve", "m", "--host=0.0.0.0"]) == "http://127.0.0.1:8000"
    with pytest.raises(ValueError, match="cmd"):
        VllmServer([])


@pytest.mark.parametrize("ignore_term", [False, True])
def test_stop_leaves_no_process_behind(ignore_term):
    cmd = [sys.executable, FAKE, "--port", str(free_port()), "--exit-code", "7"] + (["--ignore-term"] if ignore_term else [])
    s = VllmServer(cmd, stdout=subprocess.DEVNULL).start()
    tree = wait_tree(s.pid, 3)
    s.refresh_tree()
    t0 = time.monotonic()
    rc = s.stop(grace_s=10.0, orphan_grace_s=1.0)
    took = time.monotonic() - t0
    assert rc == 7
    assert not [t.pid for t in tree if procs.alive(t.pid, t.starttime)]
    assert took < 5.0  # the orphan grace, not the whole grace


def test_exit_code_of_a_signalled_child():
    s = VllmServer([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"]).start()
    s.proc.wait(10)
    assert s.stop() == 128 + signal.SIGKILL


def test_cli_forwards_sigterm_exits_with_the_child_code_and_leaves_nothing(tmp_path):
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src")}
    w = subprocess.Popen(
        [sys.executable, "-m", "stepwatch", "serve-vllm", "--run-dir", str(tmp_path), "--interval", "0.2",
         "--grace", "8", "--", sys.executable, FAKE, "--port", str(port), "--exit-code", "5",
         "--metrics", os.path.join(FIX, "metrics-0.32.0-midflight.txt")],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
    )
    try:
        tree = wait_tree(w.pid, 4)  # wrapper -> api -> engine -> worker
        time.sleep(1.0)  # a few scrapes
        os.kill(w.pid, signal.SIGTERM)
        rc = w.wait(30)
        out = w.stdout.read().decode()
        assert rc == 5, out
        assert "serve-vllm: started pid" in out
        left = [t.pid for t in tree if procs.alive(t.pid, t.starttime)]
        assert not left, (left, out)
    finally:
        if w.poll() is None:
            os.killpg(w.pid, signal.SIGKILL)
            w.wait()


def test_cli_rejects_bad_arguments(capsys):
    from stepwatch.cli import main

    assert main(["serve-vllm"]) == 2
    assert "either a server command" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve-vllm", "--stall-timeout", "0", "--attach", "http://127.0.0.1:1"])
    assert "--stall-timeout" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve-vllm", "--attach", "127.0.0.1:1"])
    assert "argument --attach: expected an http(s) URL" in capsys.readouterr().err


@pytest.mark.parametrize("opt, value, says", [
    ("--prometheus-port", "99999", "expected a TCP port 1-65535, got '99999'"),
    ("--prometheus-port", "0", "expected a TCP port 1-65535, got '0'"),
    ("--stall-timeout", "x", "expected a finite number > 0, got 'x'"),
    ("--max-num-seqs", "0", "expected an integer > 0, got '0'"),
    ("--kv-threshold", "2", "expected a number within (0, 1], got '2'"),
    ("--windows", "a", "expected seconds like 60,300, got 'a'"),
    ("--windows", "60,0", "expected positive seconds like 60,300, got '60,0'"),
    ("--windows", "60,inf", "expected positive seconds like 60,300, got '60,inf'"),
    # accepted before: inf killed the watcher thread (OverflowError), nan read as 0, -1 as a pid
    ("--interval", "inf", "expected a finite number > 0, got 'inf'"),
    ("--grace", "nan", "expected a finite number > 0, got 'nan'"),
    ("--pid", "-1", "expected an integer > 0, got '-1'"),
    ("--pid", "0", "expected an integer > 0, got '0'"),
    ("--kv-sustain", "nan", "expected a finite number >= 0, got 'nan'"),
    ("--kv-sustain", "-5", "expected a finite number >= 0, got '-5'"),  # was "kv_sustain_s must be >= 0"
    ("--attach", "localhost:8000", "expected an http(s) URL like http://127.0.0.1:8000, got 'localhost:8000'"),
    ("--url", "localhost:1", "expected an http(s) URL like http://127.0.0.1:8000, got 'localhost:1'"),
    ("--attach", "http://", "expected an http(s) URL like http://127.0.0.1:8000, got 'http://'"),
])
def test_cli_bad_values_are_argparse_errors_naming_the_option_once(capsys, opt, value, says):
    """Rejected while parsing (exit 2, before anything starts), in argparse's words plus what is
    valid: the option named once ("argument --stall-timeout: --stall-timeout: ..." before; the port
    was accepted, then warned about STEPWATCH_PROMETHEUS_PORT; --windows exited 1)."""
    from stepwatch.cli import main

    # With --attach also a command: had the URL passed, run() returns 2 at once instead of watching.
    with pytest.raises(SystemExit) as ex:
        main(["serve-vllm", opt, value] + (["--", "true"] if opt == "--attach" else []))
    assert ex.value.code == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == f"stepwatch serve-vllm: error: argument {opt}: {says}", err
    assert "STEPWATCH_PROMETHEUS_PORT" not in err


def test_cli_missing_server_command_is_one_line_and_127_as_stepwatch_run(tmp_path):
    """A server command that cannot be started: one line and 127, the same as `stepwatch run`
    (both through runner.cli.cannot_start); it was a FileNotFoundError traceback and 1."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEPWATCH_")}
    env["PYTHONPATH"] = os.path.join(ROOT, "src")
    missing = str(tmp_path / "nonexist" / "vllm")
    res = {}
    for cmd in (["serve-vllm", "--run-dir", str(tmp_path / "run"), "--", missing], ["run", "--", missing]):
        res[cmd[0]] = subprocess.run([sys.executable, "-m", "stepwatch", *cmd], env=env, capture_output=True,
                                     text=True, timeout=60)
    sv, rn = res["serve-vllm"], res["run"]
    assert sv.returncode == 127 == rn.returncode, (sv.stderr, rn.stderr)
    assert sv.stderr.strip() == f"stepwatch serve-vllm: cannot start {missing!r}: No such file or directory"
    assert rn.stderr.strip() == f"stepwatch run: cannot start {missing!r}: No such file or directory"
    assert sv.stdout == rn.stdout == ""


def test_cli_attach_never_signals_the_server(tmp_path):
    port = free_port()
    srv = subprocess.Popen([sys.executable, FAKE, "--port", str(port), "--metrics",
                            os.path.join(FIX, "metrics-0.32.0-midflight.txt")],
                           stdout=subprocess.DEVNULL, start_new_session=True)
    try:
        tree = wait_tree(srv.pid, 3)
        env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src")}
        w = subprocess.Popen(
            [sys.executable, "-m", "stepwatch", "serve-vllm", "--run-dir", str(tmp_path), "--interval", "0.2",
             "--queue-threshold", "10", "--attach", f"http://127.0.0.1:{port}", "--pid", str(srv.pid)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 20
        while not (tmp_path / "findings.serve.jsonl").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        w.send_signal(signal.SIGINT)
        rc = w.wait(30)
        out = w.stdout.read().decode()
        assert rc == 0, out
        f = json.loads((tmp_path / "findings.serve.jsonl").read_text().splitlines()[0])
        assert f["kind"] == "queue_depth" and f["data"]["waiting"] == 24.0  # the fixture's 24 > 10
        assert all(procs.alive(t.pid, t.starttime) for t in tree)  # untouched
    finally:
        os.killpg(srv.pid, signal.SIGKILL)
        srv.wait()


def test_a_killed_wrapper_takes_the_server_down_with_it(tmp_path):
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src")}
    w = subprocess.Popen(
        [sys.executable, "-m", "stepwatch", "serve-vllm", "--run-dir", str(tmp_path), "--interval", "0.5",
         "--", sys.executable, FAKE, "--port", str(port)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    tree = wait_tree(w.pid, 4)
    server = tree[1]
    os.kill(w.pid, signal.SIGKILL)  # no chance to clean up
    w.wait()
    deadline = time.monotonic() + 10
    while procs.alive(server.pid, server.starttime) and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        assert not procs.alive(server.pid, server.starttime)  # PR_SET_PDEATHSIG: SIGTERM
    finally:
        for t in tree:
            if procs.alive(t.pid, t.starttime):
                os.kill(t.pid, signal.SIGKILL)


def test_cli_shutdown_is_bounded_by_grace_when_the_api_server_hangs(tmp_path):
    """The API server SIGSTOPped: the watcher sits in a 10 s HTTP call. SIGTERM to the wrapper
    stopped the server only after joining the watcher (its scrape and /load timeouts, ~20 s);
    the server is stopped first now, within --grace."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src")}
    w = subprocess.Popen(
        [sys.executable, "-m", "stepwatch", "serve-vllm", "--run-dir", str(tmp_path), "--interval", "0.2",
         "--stall-timeout", "300", "--grace", "1", "--", sys.executable, FAKE, "--port", str(port), "--exit-code", "5",
         "--metrics", os.path.join(FIX, "metrics-0.32.0-idle-after-load.txt")],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
    )
    try:
        tree = wait_tree(w.pid, 4)  # wrapper -> api -> engine -> worker
        time.sleep(0.8)  # a few scrapes answered
        os.kill(tree[1].pid, signal.SIGSTOP)
        time.sleep(0.6)  # the next scrape now waits on the stopped server
        t0 = time.monotonic()
        os.kill(w.pid, signal.SIGTERM)
        rc = w.wait(40)
        took = time.monotonic() - t0
        out = w.stdout.read().decode()
        assert took < 6.0, (took, out)
        assert rc == 5, out
        assert not [t.pid for t in tree if procs.alive(t.pid, t.starttime)]
    finally:
        _kill_all(w, tree)


# -- the watched server ends: attached with --pid, launched, and a --pid that is not running ------

# Default --interval is 2 s: the watch must end within two polling intervals of the server's end.
GONE_BOUND_S = 4.0


def _watch_attached(tmp_path, url: str, pid: int, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src")}
    return subprocess.Popen(
        [sys.executable, "-m", "stepwatch", "serve-vllm", "--run-dir", str(tmp_path / "run"), *extra,
         "--attach", url, "--pid", str(pid)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
    )


def _wait_bounded(w: subprocess.Popen, t0: float) -> tuple[int | None, float, str]:
    """(exit status or None if still running after GONE_BOUND_S, seconds since t0, its output)."""
    try:
        rc = w.wait(max(0.0, GONE_BOUND_S - (time.monotonic() - t0)))
    except subprocess.TimeoutExpired:
        rc = None
    took = time.monotonic() - t0
    if rc is None:
        os.killpg(w.pid, signal.SIGKILL)
        w.wait()
    return rc, took, w.stdout.read().decode()


def test_cli_attached_watch_ends_when_the_pid_dies(tmp_path):
    """Attached with --pid, the server crashes (its whole tree SIGKILLed): the watcher kept
    scraping a refused URL forever. One line naming the pid, the findings on disk, exit status 3,
    within two default polling intervals."""
    port = free_port()
    srv = subprocess.Popen([sys.executable, FAKE, "--port", str(port), "--metrics",
                            os.path.join(FIX, "metrics-0.32.0-midflight.txt")],
                           stdout=subprocess.DEVNULL, start_new_session=True)
    w = None
    try:
        wait_tree(srv.pid, 3)
        w = _watch_attached(tmp_path, f"http://127.0.0.1:{port}", srv.pid, "--queue-threshold", "10")
        findings = tmp_path / "run" / "findings.serve.jsonl"
        deadline = time.monotonic() + 30
        while not findings.exists() and time.monotonic() < deadline and w.poll() is None:
            time.sleep(0.05)
        assert findings.exists(), w.poll()
        os.killpg(srv.pid, signal.SIGKILL)
        srv.wait()
        rc, took, out = _wait_bounded(w, time.monotonic())
        assert rc is not None, f"still watching {took:.1f} s after the server died:\n{out}"
        assert rc == 3, out
        assert took < GONE_BOUND_S, (took, out)
        said = [line for line in out.splitlines() if f"--pid {srv.pid}" in line]
        assert len(said) == 1 and "has exited" in said[0], out
        assert "still watching" not in out
        f = [json.loads(line) for line in findings.read_text().splitlines()]
        assert [x["kind"] for x in f] == ["queue_depth"] and f[0]["data"]["waiting"] == 24.0
    finally:
        if w is not None and w.poll() is None:
            os.killpg(w.pid, signal.SIGKILL)
            w.wait()
        if srv.poll() is None:
            os.killpg(srv.pid, signal.SIGKILL)
            srv.wait()


def test_cli_attached_watch_ends_when_the_pid_dies_while_a_scrape_hangs(tmp_path):
    """The --pid process exits but its URL still accepts connections and never answers (an
    orphaned child holding the server's socket): the watcher sits in a 10 s scrape. It still ends
    within the bound, not after the scrape timeout or --grace."""
    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen(16)  # connections complete in the backlog; nobody ever accepts or answers
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    w = None
    try:
        w = _watch_attached(tmp_path, f"http://127.0.0.1:{ls.getsockname()[1]}", victim.pid)
        assert select.select([ls], [], [], 30)[0], "the watcher never scraped"  # it is in the call now
        time.sleep(0.6)  # past at least one check of the pid while it was alive
        assert w.poll() is None
        victim.kill()
        victim.wait()
        rc, took, out = _wait_bounded(w, time.monotonic())
        assert rc == 3, (rc, took, out)
        assert took < GONE_BOUND_S, (took, out)
        assert len([line for line in out.splitlines() if f"--pid {victim.pid}" in line]) == 1, out
        assert "still in a call" not in out
    finally:
        if w is not None and w.poll() is None:
            os.killpg(w.pid, signal.SIGKILL)
            w.wait()
        if victim.poll() is None:
            victim.kill()
            victim.wait()
        ls.close()


def test_cli_attach_with_a_pid_that_is_not_running_is_refused(tmp_path):
    """--pid of no running process was accepted and watched forever (and later reported as a
    server that "is gone"): one line naming --pid, exit status 2, no run directory made."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src")}
    try:
        r = subprocess.run([sys.executable, "-m", "stepwatch", "serve-vllm", "--run-dir", str(tmp_path / "run"),
                            "--attach", f"http://127.0.0.1:{free_port()}", "--pid", str(dead.pid)],
                           env=env, capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"still running 20 s after start with --pid {dead.pid} (not running)") from e
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stderr.strip() == (f"stepwatch serve-vllm: error: argument --pid: no process {dead.pid} is running "
                                "(give the server's top process)"), r.stderr
    assert not (tmp_path / "run").exists()


def test_cli_launched_server_that_dies_ends_the_watch_in_one_line(tmp_path):
    """Launched, the API server SIGKILLed: the wrapper exits 137 (128 + 9) at once, its tree is
    gone, and the end is one line naming the pid (it was "the server exited with 137" without the
    pid, and often also the watcher's "(pid N) is gone ... (still watching the URL)")."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src")}
    w = subprocess.Popen(
        [sys.executable, "-m", "stepwatch", "serve-vllm", "--run-dir", str(tmp_path), "--interval", "0.2",
         "--queue-threshold", "10", "--", sys.executable, FAKE, "--port", str(port),
         "--metrics", os.path.join(FIX, "metrics-0.32.0-midflight.txt")],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
    )
    tree = []
    try:
        tree = wait_tree(w.pid, 4)  # wrapper -> api -> engine -> worker
        deadline = time.monotonic() + 20
        while not (tmp_path / "findings.serve.jsonl").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        api = tree[1].pid
        os.kill(api, signal.SIGKILL)
        rc, took, out = _wait_bounded(w, time.monotonic())
        assert rc == 128 + signal.SIGKILL, (rc, took, out)
        assert took < GONE_BOUND_S, (took, out)
        said = [line for line in out.splitlines() if f"pid {api}" in line and "started" not in line]
        assert len(said) == 1 and "exited with 137" in said[0], out
        assert "still watching" not in out
        assert not [t.pid for t in tree if procs.alive(t.pid, t.starttime)]
        assert json.loads((tmp_path / "findings.serve.jsonl").read_text().splitlines()[0])["kind"] == "queue_depth"
    finally:
        _kill_all(w, tree)


def test_the_wrappers_signal_handler_takes_no_lock_the_main_loop_may_hold():
    """``serve-vllm``'s SIGTERM handler set the watch's ``threading.Event``, which the main loop
    waited on. A handler runs in the main thread between two bytecodes; one that landed while the
    loop was inside that Event's ``wait`` (holding its lock) waited for the lock forever: in one
    suite run the server stopped and the wrapper slept on, for good. The loop now sleeps without a
    lock and the handler only records the signal and passes it on. Here the real handler
    interrupts the real sleep every millisecond, in the main thread: the sleep ends at once, and
    every signal was passed on."""
    from stepwatch.serving.cli import Interrupts

    sent = []

    class Server:
        def send_signal(self, sig):
            sent.append(sig)

    it = Interrupts(Server())
    old = signal.signal(signal.SIGALRM, it.handler)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.001, 0.001)
        t0 = time.monotonic()
        it.sleep(5.0)
        took = time.monotonic() - t0
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0, 0)
        signal.signal(signal.SIGALRM, old)
    assert took < 0.5, took
    assert it.got and set(it.got) == {signal.SIGALRM} and sent == it.got
    quiet = Interrupts()
    t0 = time.monotonic()
    quiet.sleep(0.2)
    assert 0.15 <= time.monotonic() - t0 < 1.0


def test_a_run_dir_that_cannot_be_made_is_one_line_before_the_server_starts(tmp_path):
    """``--run-dir`` under a file: a traceback and exit 1 from deep inside, after the server
    command was started (a minute of vLLM's model loading, then killed). One line, exit 2, nothing
    started."""
    afile = tmp_path / "afile"
    afile.write_text("")
    marker = tmp_path / "started"
    server = [sys.executable, "-c", f"open({str(marker)!r}, 'w').close(); import time; time.sleep(30)"]
    r = subprocess.run([sys.executable, "-m", "stepwatch", "serve-vllm", "--run-dir", str(afile / "run"), "--", *server],
                       capture_output=True, text=True, timeout=60, env=dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src")))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "cannot use the run directory" in r.stderr and "--run-dir" in r.stderr, r.stderr
    assert not marker.exists()


def test_two_watchers_started_in_one_second_get_run_dirs_of_their_own():
    """The default run id was the second alone (``serve-%Y%m%d-%H%M%S``): two watchers started
    together wrote one findings file and one stall-1/ (one's report overwrote the other's). The
    process id is in it now, as a training run's."""
    from stepwatch.serving.cli import default_run_id

    rid = default_run_id()
    assert rid.startswith("serve-") and rid.endswith(f"-{os.getpid()}"), rid

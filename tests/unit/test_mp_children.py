"""A session started in a child of ``multiprocessing`` ('forkserver', or 'fork' where the child
calls ``stepwatch.init()`` itself, or a Pool's worker that trains) finishes its run directory.

Such a child leaves through ``os._exit()`` at the end of ``BaseProcess._bootstrap``: ``atexit``
never runs there, and the session, which shut down only at ``atexit``, never did: of 200 steps
the records file held 1 to 28 and run.json said ``steps: 0``, ``ended_by: null``. It now shuts down
from multiprocessing's own exit (``multiprocessing.util._exit_function``), which the child runs.
"""

import glob
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
N = 60  # steps each child trains

SCRIPT = r'''
import stepwatch.auto  # noqa: F401  (the one line: a forkserver child imports it again)
import gc, json, multiprocessing as mp, os, sys, threading, time, weakref
import torch, torch._dynamo, torch.nn as nn  # torch.optim imports torch._dynamo: here, once
import stepwatch

def train(n):
    m = nn.Linear(8, 8)
    opt = torch.optim.SGD(m.parameters(), lr=1e-2)
    for _ in range(n):
        opt.zero_grad(); (m(torch.randn(4, 8)) ** 2).mean().backward(); opt.step()
    return os.getpid()

def child(kind, n, done, out):
    if kind == "init":  # a child that starts stepwatch itself (a fork child has no other way)
        stepwatch.init()
    if kind == "grandchild":  # a fork of this child must not end this child's session
        train(n // 2)
        sys.stdout.flush(); sys.stderr.flush()
        if os.fork() == 0:
            sys.exit(0)  # unwinds through multiprocessing's exit, with this child's finalizers
        os.wait()
        s = stepwatch.get_session()
        train(n - n // 2)
        with open(out, "w") as f:
            json.dump({"same_session": s is not None and s is stepwatch.get_session()}, f)
    else:
        train(n)
    if kind == "by_hand":  # shut down by hand: nothing of the session stays registered or alive
        import multiprocessing.util as mu
        ref = weakref.ref(stepwatch.get_session())
        stepwatch.shutdown()
        for _ in range(100):  # its threads end on their own, just after the shutdown
            gc.collect()
            if ref() is None:
                break
            time.sleep(0.05)
        left = [f for f in list(mu._finalizer_registry.values())
                if "stepwatch" in (getattr(getattr(f, "_callback", None), "__module__", None) or "")]
        with open(out, "w") as f:
            json.dump({"freed": ref() is None, "left": len(left)}, f)
    done.value = time.monotonic()  # trained: from here to its exit is the session's shutdown
    if kind == "raise":
        raise ValueError("boom in the child")
    if kind == "exit":  # a child that gives up with an exit status of its own
        sys.exit(3)

if __name__ == "__main__":
    method, what, n, res = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(["torch", "torch._dynamo"])  # what each child would import again (slow)
    out = {}
    joiners = []

    def join(kind, p, done):
        p.join(60)
        out[kind] = {"pid": p.pid, "exitcode": p.exitcode, "took": time.monotonic() - done.value}
        if p.exitcode is None:
            p.kill()

    for kind in what.split(","):  # the children all at once
        if kind != "pool":
            done = ctx.Value("d", float("-inf"))
            p = ctx.Process(target=child, args=(kind, n, done, os.path.join(res, kind + ".json")))
            p.start()
            joiners.append(threading.Thread(target=join, args=(kind, p, done)))
            joiners[-1].start()
    if "pool" in what.split(","):  # meanwhile Pools whose workers train (a sweep's trials)
        pool = ctx.Pool(1)
        pending = pool.map_async(train, [n] * 2, chunksize=1)
        # One as a context manager: its exit terminates the workers (SIGTERM), which may come
        # while a worker that got its end-of-work sentinel is already shutting down.
        with ctx.Pool(2) as pool_with:
            pids = pool_with.map(train, [n] * 4, chunksize=1)
            t0 = time.monotonic()
        out["pool_with"] = {"pids": pids, "took": time.monotonic() - t0,
                            "exitcodes": [p.exitcode for p in pool_with._pool]}
        pids = pending.get(60)
        t0 = time.monotonic()
        pool.close(); pool.join()  # the workers leave as a finished Pool's do
        out["pool"] = {"pids": pids, "took": time.monotonic() - t0}
    for t in joiners:
        t.join()
    print("RESULT " + json.dumps(out), flush=True)
'''


def _run(tmp_path, method, what):
    (tmp_path / "train.py").write_text(SCRIPT)
    res = tmp_path / "res"
    res.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEPWATCH_")}
    env.update({"PYTHONPATH": os.path.join(ROOT, "src"), "OMP_NUM_THREADS": "1", "STEPWATCH_CONSOLE": "off",
                "STEPWATCH_WATCHDOG": "off", "STEPWATCH_CAPTURE": "off", "STEPWATCH_GPU_TELEMETRY": "off"})
    r = subprocess.run([sys.executable, "train.py", method, what, str(N), str(res)], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):]), r


def _run_dir(tmp_path, pid):
    dirs = glob.glob(str(tmp_path / "stepwatch-runs" / f"run-*-{pid}"))
    assert len(dirs) == 1, (pid, os.listdir(tmp_path / "stepwatch-runs"))
    return dirs[0]


def _records(run_dir):
    with open(os.path.join(run_dir, "steps.rank0.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def _manifest(run_dir):
    with open(os.path.join(run_dir, "run.json")) as f:
        return json.load(f)


def _assert_finished(run_dir, steps, ended_by="shutdown"):
    recs = _records(run_dir)
    assert len(recs) == steps, (run_dir, len(recs))  # every step, the last one too
    assert [r["step"] for r in recs] == sorted({r["step"] for r in recs})  # once each
    m = _manifest(run_dir)
    assert m["steps"] == steps and m["ended_by"] == ended_by and m["end_time"] is not None, m


def _assert_pools_finished(tmp_path, out):
    """Every Pool worker's run directory holds the steps of the tasks it ran. ``with Pool``: a
    worker terminated while it waits for work finishes on SIGTERM; one that was shutting down
    already finishes that shutdown first (then dies of the SIGTERM)."""
    pids = out["pool"]["pids"]
    for pid in sorted(set(pids)):
        _assert_finished(_run_dir(tmp_path, pid), pids.count(pid) * N)
    pids = out["pool_with"]["pids"]
    for pid in sorted(set(pids)):
        d = _run_dir(tmp_path, pid)
        _assert_finished(d, pids.count(pid) * N, ended_by=_manifest(d)["ended_by"])
        assert _manifest(d)["ended_by"] in ("shutdown", "SIGTERM")


def test_forkserver_children_and_pool_workers_finish_their_run_directories(tmp_path):
    """'forkserver' children that start at their first optimizer (``import stepwatch.auto``):
    one that returns (after it forked a grandchild that left through multiprocessing's exit with
    a copy of its finalizers: it must not end its parent's session), one that dies of an
    exception, one that calls ``sys.exit(3)``, one shut down by hand (then freed, and nothing of it left in multiprocessing's exit
    registry); a Pool's worker that trains (one session over the tasks it ran), closed and
    joined; and the workers of a Pool used as a context manager (terminated)."""
    out, r = _run(tmp_path, "forkserver", "grandchild,raise,exit,by_hand,pool")
    for kind, c in out.items():
        if not kind.startswith("pool"):
            assert c["exitcode"] == {"raise": 1, "exit": 3}.get(kind, 0), (kind, c, r.stderr[-3000:])
        assert c["took"] < 15, (kind, c)  # it exits promptly (shutdown: 1.5 s; a busy machine: more)
    # From Python 3.13 on, multiprocessing's child catches the exception (and prints it) before
    # its exit runs the finalizers and atexit hooks: the shutdown no longer sees it (README).
    raised = "uncaught ValueError: boom in the child" if sys.version_info < (3, 13) else "shutdown"
    _assert_finished(_run_dir(tmp_path, out["raise"]["pid"]), N, ended_by=raised)
    _assert_finished(_run_dir(tmp_path, out["exit"]["pid"]), N, ended_by="exit 3")  # as a script's sys.exit(3)
    _assert_finished(_run_dir(tmp_path, out["by_hand"]["pid"]), N)
    assert json.loads((tmp_path / "res" / "by_hand.json").read_text()) == {"freed": True, "left": 0}
    _assert_finished(_run_dir(tmp_path, out["grandchild"]["pid"]), N)
    assert json.loads((tmp_path / "res" / "grandchild.json").read_text()) == {"same_session": True}
    _assert_pools_finished(tmp_path, out)


def test_a_fork_child_that_calls_init_finishes_its_run_directory(tmp_path):
    out, r = _run(tmp_path, "fork", "init")
    c = out["init"]
    assert c["exitcode"] == 0 and c["took"] < 15, (c, r.stderr[-3000:])
    _assert_finished(_run_dir(tmp_path, c["pid"]), N)
    # the parent's session (inherited by the fork, closed there) is the parent's alone
    parent = [d for d in glob.glob(str(tmp_path / "stepwatch-runs" / "run-*")) if not d.endswith(f"-{c['pid']}")]
    assert len(parent) == 1 and _manifest(parent[0])["ended_by"] == "shutdown"
    assert not os.path.exists(os.path.join(parent[0], "steps.rank0.jsonl")) or _records(parent[0]) == []


def test_pool_workers_forked_from_a_job_with_a_session_measure_what_they_train(tmp_path):
    """Linux's default start method: a Pool's workers are forks of a process whose session is
    running (``import stepwatch.auto``). The fork leaves the parent's session off in the child,
    as in a DataLoader worker, and a worker that trained was not measured at all, without a word.
    Such a worker now starts a session of its own at its first optimizer, as a spawned one does."""
    out, r = _run(tmp_path, "fork", "pool")
    _assert_pools_finished(tmp_path, out)

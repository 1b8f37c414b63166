"""`stepwatch trace` and `stepwatch capture` on real files and real runs: ranks compared within one
capture only, no host sync claimed on a CPU trace, a JSON file that is not a trace, a finished run.

The GPU traces are HTA's real A100/V100 traces in ../shared/traces/ (test_traces.py), laid out as
stepwatch's captures/ folder; the CPU trace and the runs are made here by torch.profiler and
`stepwatch run`.
"""

import importlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

from stepwatch.cli import main
from stepwatch.traces import analyse_with_findings

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRACES = os.path.join(os.path.dirname(ROOT), "shared", "traces")
needs_traces = pytest.mark.skipif(not os.path.isdir(TRACES), reason="../shared/traces/ not present")

# Idle % of the GPU span (HTA's definition): sampled rank 0 53.56, sampled rank 1 54.72, v100 2.63;
# distributedInfo.rank 0, 1, 0.
SAMPLED0, SAMPLED1, V100 = "sampled-128rank-rank0.json.gz", "sampled-128rank-rank1.json.gz", "v100-single-rank0.json.gz"


def _captures(d, layout):
    d.mkdir()
    for name, src in layout.items():
        shutil.copy(os.path.join(TRACES, src), d / name)
    return d


def _rank_idle(out):
    return [(os.path.basename(s["trace"]), f) for s in out for f in s["findings"] if f["kind"] == "trace_rank_idle"]


@needs_traces
def test_ranks_are_compared_within_one_capture_only(tmp_path, capsys):
    # The tester's layout: capture 1 (ranks 0 and 1, both ~54% idle) and capture 2 (rank 0 only, 2.6%).
    # Rank 1 of capture 1 was compared with rank 0 of capture 2.
    d = _captures(tmp_path / "caps", {"capture-1-steps10-12.rank0.trace.json.gz": SAMPLED0,
                                      "capture-1-steps10-12.rank1.trace.json.gz": SAMPLED1,
                                      "capture-2-steps50-52.rank0.trace.json.gz": V100})
    assert main(["trace", str(d), "--json"]) == 0
    assert _rank_idle(json.loads(capsys.readouterr().out)) == []
    # Capture 2 gets a rank 1 that idled: its own finding, on its own rank 1 file only.
    shutil.copy(os.path.join(TRACES, SAMPLED1), d / "capture-2-steps50-52.rank1.trace.json.gz")
    assert main(["trace", str(d), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    (where, f), = _rank_idle(out)
    assert where == "capture-2-steps50-52.rank1.trace.json.gz" and f["rank"] == 1
    assert f["summary"].startswith("capture-2-steps50-52: rank 1's GPU idled 54.7%") and "idled 2.6%" in f["summary"]
    assert f["data"]["idle_pct"] == {"0": 2.63, "1": 54.72} and f["data"]["trace"].endswith(where)
    # The table says which file each row is.
    assert main(["trace", str(d)]) == 0
    text = capsys.readouterr().out
    for n in os.listdir(d):
        assert n.replace(".trace.json.gz", "") in text, n


def test_which_files_are_one_captures_ranks():
    from stepwatch.traces.findings import group_key as k

    assert k("c/capture-3-steps5-7.rank0.trace.json.gz") == k("c/capture-3-steps5-7.rank12.trace.json.gz")
    assert k("c/capture-3-steps5-7.rank0.trace.json.gz") != k("c/capture-4-steps5-7.rank1.trace.json.gz")
    assert k("c/capture-3-steps5-7.rank0.trace.json.gz") != k("other/capture-3-steps5-7.rank1.trace.json.gz")
    assert k("t/sampled-128rank-rank0.json.gz") == k("t/sampled-128rank-rank1.json.gz")
    assert k("t/sampled-128rank-rank0.json.gz") != k("t/v100-single-rank0.json.gz")
    # No rank in the name (torch's tensorboard_trace_handler): the directory's rank-less files together.
    assert k("tb/host_1.1712.pt.trace.json") == k("tb/host_2.1713.pt.trace.json") != k("tb/job-rank0.json")


@needs_traces
def test_a_rank_that_comes_twice_in_a_group_is_not_compared(tmp_path, capsys):
    # Two rank-less names in one directory, one rank-0 trace each: which covers the other's steps is unknown.
    # (Keyed by rank, the last rank-0 file, the dense V100 one, made rank 1 look idle.)
    d = _captures(tmp_path / "tb", {"host_1.1.pt.trace.json.gz": SAMPLED0, "host_2.2.pt.trace.json.gz": V100,
                                    "host_3.3.pt.trace.json.gz": SAMPLED1})
    assert main(["trace", str(d), "--json"]) == 0
    assert _rank_idle(json.loads(capsys.readouterr().out)) == []


CPU_JOB = r'''
import sys, time, torch
from torch.profiler import ProfilerActivity, profile, record_function
model = torch.nn.Linear(64, 64)
x = torch.randn(32, 64)
with profile(activities=[ProfilerActivity.CPU]) as prof:
    for step in range(100, 103):
        with record_function(f"stepwatch_step_{step}"):
            loss = model(x).pow(2).mean()
            loss.backward()
            v = loss.item()   # the last op before the sleep: it ends where the gap starts
            time.sleep(0.03)  # 30 ms of Python without an op: a CPU job's gap
prof.export_chrome_trace(sys.argv[1])
'''


def test_a_cpu_trace_names_no_host_sync_and_no_cuda_action(tmp_path, capsys):
    pytest.importorskip("torch")
    job = tmp_path / "job.py"
    job.write_text(CPU_JOB)
    trace = tmp_path / "cpu.trace.json"
    r = subprocess.run([sys.executable, str(job), str(trace)], capture_output=True, text=True, timeout=180,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stderr[-2000:]
    got = analyse_with_findings(str(trace))
    assert got["note"] == "no GPU kernels" and got["temporal"] is None
    big = [g for g in got["gaps"] if g["dur_us"] > 25_000]
    assert len(big) == 3 and all(g["where"] == "cpu" and g["cause"] == "python" for g in big), got["gaps"]
    assert all(g["host_sync"] is None for g in got["gaps"])  # aten::item on a CPU tensor waits on nothing
    assert got["host_syncs"] == []
    (f,) = [f for f in got["findings"] if f["kind"] == "trace_idle_gaps"]
    assert "CUDA" not in f["action"] + f["diagnosis"] and "GPU idles" not in f["diagnosis"]
    assert "trace_host_sync" not in {f["kind"] for f in got["findings"]}
    assert main(["trace", str(trace)]) == 0
    text = capsys.readouterr().out
    assert "aten::item" not in text and "CUDA Graphs" not in text.replace("\n", " ")


def test_a_cpu_gap_spent_waiting_on_gloos_allreduce_is_communication(capsys):
    # Rank 1 of a real 2-rank gloo DDP capture (torchrun, steps 157-159): the training thread runs no
    # op while DDP waits for its bucket; the AllReduce runs on gloo's thread (gloo:all_reduce,
    # 4.14-5.98 ms and 7.97-14.50 ms), which the gap naming did not look at: "python", and an action
    # to move Python work off the step.
    trace = os.path.join(ROOT, "tests", "unit", "data", "gloo_ddp_cpu_capture.rank1.trace.json.gz")
    got = analyse_with_findings(trace)
    gaps = {round(g["start_us"] / 1000, 2): g for g in got["gaps"]}
    for at, dur in ((4.0, 2.0), (7.9, 3.4)):
        g = gaps[at]
        assert round(g["dur_us"] / 1000, 1) == dur and g["where"] == "cpu", g
        assert g["cause"] == "communication" and g["cpu_op"] == "gloo:all_reduce", g
    # 11.86 ms, after the optimizer step: the thread already had that AllReduce's result (DDP copied
    # the bucket back at 11.38 ms); the range goes on (gloo's completion callbacks), the wait does not.
    assert gaps[11.86]["cause"] == "python", gaps[11.86]
    (f,) = [f for f in got["findings"] if f["kind"] == "trace_idle_gaps" and f["data"]["gap"]["cause"] == "communication"]
    assert "3.4 ms in step 159 while the CPU waited on gloo:all_reduce (communication)" in f["summary"]
    assert "Python" not in f["action"] and "off the step" not in f["action"] and "communication" in f["diagnosis"]
    assert main(["trace", trace]) == 0
    assert "communication" in capsys.readouterr().out


def test_a_run_dir_is_its_captures(tmp_path, capsys):
    """``stepwatch trace RUN_DIR`` analysed the run's manifests (``run.json``, ``rank0.json``...),
    each an error ("not a profiler trace"), and none of its captures. A run dir is its
    ``captures/`` folder; one without says how to take a capture."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    run = tmp_path / "run"
    (run / "captures").mkdir(parents=True)
    for name in ("run.json", "rank0.json"):
        (run / name).write_text(json.dumps({"run_id": "r", "rank": 0}))
    assert main(["trace", str(run)]) == 2
    err = capsys.readouterr().err
    assert "without captures/" not in err and "no .json or .json.gz trace" in err, err  # an empty captures/
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.ones(64, 64).matmul(torch.ones(64, 64))
    prof.export_chrome_trace(str(run / "captures" / "capture-1-steps3-5.rank0.trace.json"))
    assert main(["trace", str(run), "--json"]) == 0
    (s,) = json.loads(capsys.readouterr().out)
    assert s["trace"].endswith("capture-1-steps3-5.rank0.trace.json")
    shutil.rmtree(run / "captures")
    assert main(["trace", str(run)]) == 2
    err = capsys.readouterr().err
    assert "run directory without captures/" in err and f"stepwatch capture {run}" in err, err


def test_a_json_file_that_is_not_a_trace_is_an_error_naming_it(tmp_path, capsys):
    obj = tmp_path / "a.json"
    obj.write_text('{"a": 1}')
    assert main(["trace", str(obj)]) == 1
    err = capsys.readouterr().err
    assert f"{obj}: not a profiler trace" in err and "traceEvents" in err and err.count(str(obj)) == 1
    lst = tmp_path / "l.json"
    lst.write_text("[1, 2, 3]")
    assert main(["trace", str(lst)]) == 1
    assert f"{lst}: not a profiler trace" in capsys.readouterr().err
    # A trace with no events is still a trace; an empty list, or a traceEvents list of values, is none.
    empty = tmp_path / "e.json"
    empty.write_text('{"traceEvents": []}')
    assert main(["trace", str(empty)]) == 0
    capsys.readouterr()
    for name, text in (("bare.json", "[]"), ("values.json", '{"traceEvents": [1, 2, 3]}')):
        (tmp_path / name).write_text(text)
        assert main(["trace", str(tmp_path / name)]) == 1
        assert f"{tmp_path / name}: not a profiler trace" in capsys.readouterr().err


def test_malformed_events_are_skipped_and_counted_and_one_bad_file_stops_no_other(tmp_path, capsys):
    """A string or NaN ``ts``/``dur``, a negative ``dur``, an ``args`` that is no object: skipped
    and counted (a traceback before, or an idle of 111% for a negative duration, or a bare NaN in
    the ``--json`` output); a file whose analysis fails anyway is an error line of its own, and the
    other files are still analysed."""
    X = lambda name, ts, dur, **kw: {"ph": "X", "cat": kw.pop("cat", "kernel"), "name": name, "pid": 1, "tid": 1,
                                     "ts": ts, "dur": dur, **kw}
    good = [X("k0", 100, 5, args={"stream": 7, "correlation": 100}),
            X("cudaLaunchKernel", 90, 2, cat="cuda_runtime", args={"correlation": 100})]
    bad = [X("k1", "10", 5, args={"stream": 7, "correlation": 1}), X("k2", 30, 5, args="no object"),
           X("k3", 40, "5", args={"stream": 7, "correlation": 3}), X("ProfilerStep#1", 0, "x", cat="cpu_op"),
           X("ProfilerStep#2", {}, 3, cat="cpu_op"), X("k5", 60, -10, args={"stream": 7, "correlation": 5}),
           X("k4", 50, float("nan"), args={"stream": 7, "correlation": 4}),
           X("k6", 70, float("inf"), args={"stream": 7, "correlation": 6})]
    p = tmp_path / "bad.json"
    p.write_text(json.dumps({"traceEvents": good + bad}))
    assert main(["trace", str(p), "--json"]) == 0
    out = capsys.readouterr().out
    assert "NaN" not in out and "Infinity" not in out
    (got,) = json.loads(out)
    assert got["malformed_events"] == 8 and "8 malformed event(s) skipped" in got["note"]
    assert got["temporal"] == {"idle_pct": 0.0, "compute_pct": 100.0, "non_compute_pct": 0.0, "span_us": 5.0}
    # One file the analysis cannot take (a failure it did not foresee) and a good one: both named.
    mod = importlib.import_module("stepwatch.traces.analyse")  # the package's ``analyse`` is the function
    real = mod._Pass1.feed

    def feed(self, e):
        if e.get("name") == "boom":
            raise KeyError("boom")
        return real(self, e)

    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "a.json").write_text(json.dumps({"traceEvents": [X("boom", 1, 1)]}))
    (tmp_path / "dir" / "b.json").write_text(json.dumps({"traceEvents": good}))
    mod._Pass1.feed = feed
    try:
        assert main(["trace", str(tmp_path / "dir"), "--json"]) == 1
    finally:
        mod._Pass1.feed = real
    cap = capsys.readouterr()
    assert f"{tmp_path / 'dir' / 'a.json'}: could not be analysed (KeyError: 'boom')" in cap.err
    assert "Traceback" not in cap.err and [g["trace"] for g in json.loads(cap.out)] == [str(tmp_path / "dir" / "b.json")]


TRAIN = r'''
import sys, time, torch
model = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(int(sys.argv[1])):
    loss = model(torch.randn(4, 8)).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    time.sleep(0.05)
'''


def _run_env():
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEPWATCH_")}
    env.update({"PYTHONPATH": os.path.join(ROOT, "src") + os.pathsep + os.environ.get("PYTHONPATH", ""),
                "OMP_NUM_THREADS": "1", "STEPWATCH_CONSOLE": "off", "STEPWATCH_GPU_TELEMETRY": "0",
                "STEPWATCH_CAPTURE": "on"})
    return env


def _start(tmp_path, steps, **env):
    pytest.importorskip("torch")
    (tmp_path / "train.py").write_text(TRAIN)
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "stepwatch", "run", "--dir", str(run), "--", sys.executable,
                             str(tmp_path / "train.py"), str(steps)], env={**_run_env(), **env}, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    return proc, run


def _capture(run, capsys, timeout="30"):
    t0 = time.monotonic()
    rc = main(["capture", str(run), "--timeout", timeout])
    return rc, time.monotonic() - t0, capsys.readouterr().err


def _requests_left(run):
    return [p.name for p in (run / "requests").glob("capture-*.json")
            if not p.name.endswith(".taken.json")] if (run / "requests").exists() else []


def test_capture_on_a_finished_run_says_so_at_once(tmp_path, capsys):
    proc, run = _start(tmp_path, 5)
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 0, out[-3000:]
    assert json.loads((run / "run.json").read_text())["end_time"] is not None
    rc, took, err = _capture(run, capsys)
    assert rc == 2 and took < 5, (rc, took, err)
    assert f"the run in {run} has ended" in err and "end_time" in err
    assert _requests_left(run) == []


def _wait_for_manifests(proc, run):
    end = time.monotonic() + 120
    while time.monotonic() < end and not ((run / "rank0.json").exists() and (run / "run.json").exists()):
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        time.sleep(0.3)


def test_capture_of_a_run_with_captures_off_says_so_at_once(tmp_path, capsys):
    # The job runs with captures off: no rank would ever take the request. The command waited its
    # whole --timeout (300 s by default), then asked whether captures were on; run.json says so now.
    proc, run = _start(tmp_path, 100_000, STEPWATCH_CAPTURE="off")
    try:
        _wait_for_manifests(proc, run)
        rc, took, err = _capture(run, capsys)
        assert proc.poll() is None  # the job still runs
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=30)
    assert rc == 2 and took < 5, (rc, took, err)
    assert f"captures are off in the run in {run}" in err and "STEPWATCH_CAPTURE=on" in err, err
    assert _requests_left(run) == []


def test_capture_stops_waiting_when_every_rank_is_gone(tmp_path, capsys):
    # A stopped job (SIGSTOP: a debugger, a job-control stop) never takes the request, so the
    # command waits -- until the rank dies.
    proc, run = _start(tmp_path, 100_000)
    result = {}
    try:
        _wait_for_manifests(proc, run)
        pid = json.loads((run / "rank0.json").read_text())["pid"]
        os.kill(pid, signal.SIGSTOP)
        waiter = threading.Thread(target=lambda: result.update(zip(("rc", "took", "err"), _capture(run, capsys, "60"))))
        waiter.start()
        time.sleep(2.0)
        assert waiter.is_alive()  # the job runs: the command waits for it
        os.kill(pid, signal.SIGKILL)  # killed: no shutdown, run.json keeps end_time null
        waiter.join(90)
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=30)
    assert json.loads((run / "run.json").read_text())["end_time"] is None
    assert result["rc"] == 1 and result["took"] < 15, result
    gone = f"the run in {run} has ended: no rank's process is running (rank 0 pid {pid})"
    assert gone + ", before any rank took the request" in result["err"]
    assert _requests_left(run) == []
    # And asked again: at once.
    rc, took, err = _capture(run, capsys)
    assert rc == 2 and took < 5 and gone in err, (rc, took, err)


def test_capture_finds_the_job_in_the_private_subfolder_of_a_shared_run_dir(tmp_path, capsys):
    # A run dir others may write to: the job writes into RUN_DIR/private-<uid>/ (_files.private_run_dir),
    # and `stepwatch capture RUN_DIR` -- the directory the user gave the job -- must find it there: its
    # run.json, its world size, its ranks, its requests/ and captures/.
    run = tmp_path / "run"
    run.mkdir()
    run.chmod(0o770)
    proc, _ = _start(tmp_path, 100_000)
    sub = run / f"private-{os.getuid()}"
    try:
        end = time.monotonic() + 120
        while time.monotonic() < end and not ((sub / "rank0.json").exists() and (sub / "run.json").exists()):
            assert proc.poll() is None, proc.communicate()[0][-3000:]
            time.sleep(0.3)
        assert sorted(os.listdir(run)) == [sub.name]
        rc = main(["capture", str(run), "--steps", "2", "--json", "--timeout", "120"])
        out, err = capsys.readouterr()
        assert rc == 0, err
        assert "on 1 rank(s)" in err
        (got,) = json.loads(out)
        assert got["rank"] == 0 and got["note"] == "no GPU kernels"
        assert [p.name.endswith(".taken.json") for p in (sub / "requests").iterdir()] == [True]
        assert sorted((sub / "captures").glob("capture-*.rank0.analysis.json"))
        assert not (run / "requests").exists() and not (run / "captures").exists()
        # A run.json left at the top by an earlier job (of 4 ranks, before the directory was shared):
        # the live job's own manifest still gives the world size.
        (run / "run.json").write_text(json.dumps({"run_id": "older", "world_size": 4, "end_time": None}))
        rc = main(["capture", str(run), "--steps", "2", "--json", "--timeout", "120"])
        out, err = capsys.readouterr()
        assert rc == 0 and "on 1 rank(s)" in err, err
        assert [s["rank"] for s in json.loads(out)] == [0]
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=60)


@needs_traces
def test_a_trace_saved_with_a_byte_order_mark_is_read(tmp_path, capsys):
    """A trace re-saved by a Windows tool starts with a UTF-8 BOM: it was "expected one of '{'
    near character 0, got '\\ufeff'". The BOM is not the trace: the same analysis as without it."""
    import gzip

    with gzip.open(os.path.join(TRACES, V100), "rb") as f:
        body = f.read()
    plain, bom = tmp_path / "plain.json", tmp_path / "bom.json"
    plain.write_bytes(body)
    bom.write_bytes(b"\xef\xbb\xbf" + body)
    assert main(["trace", "--json", str(plain)]) == 0
    want = json.loads(capsys.readouterr().out)
    assert main(["trace", "--json", str(bom)]) == 0
    got = json.loads(capsys.readouterr().out)
    for s in want + got:  # the same but for the file's name, the time taken and each finding's time
        s.pop("trace")
        s.pop("seconds")
        for f in s["findings"]:
            f.pop("time")
            f["data"].pop("trace", None)
    assert got == want and want[0]["events"] > 0


def test_json_output_is_a_list_even_when_no_trace_could_be_read(tmp_path, capsys):
    """``--json`` with every file failing printed nothing at all to stdout: a script reading it
    (``| jq``) got no JSON. It prints ``[]``, the errors on stderr and exit 1 as before."""
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert main(["trace", "--json", str(bad)]) == 1
    out = capsys.readouterr()
    assert json.loads(out.out) == [] and f"{bad}:" in out.err

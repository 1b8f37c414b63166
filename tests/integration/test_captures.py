"""Anomaly-triggered captures on a real 2-rank gloo DDP job (torchrun, one-line import).

Injected step-time spikes (a rank-wide sleep before the forward) at steps 15 and 25 fall in one
cooldown window, 150 in the next, 200 after the maximum count: exactly two torch.profiler
captures per rank, of the same steps on both ranks, each a valid Chrome trace holding the
training thread's ops inside the chosen steps.
"""

import gzip
import json
import os

import pytest

from test_hang import start_job, stop_job

pytestmark = pytest.mark.integration

COOLDOWN_S = 6.0


def test_spikes_yield_one_capture_per_cooldown_window_on_every_rank(tmp_path):
    proc = start_job(
        tmp_path,
        ["--steps", "260", "--step-sleep", "0.05", "--spike-steps", "15,25,150,200"],
        {"STEPWATCH_CAPTURE": "on", "STEPWATCH_CAPTURE_COOLDOWN": str(COOLDOWN_S), "STEPWATCH_CAPTURE_MAX": "2",
         "STEPWATCH_CAPTURE_STEPS": "3", "STEPWATCH_WINDOW": "10"},
    )
    try:
        proc.wait(timeout=180)
    finally:
        out = stop_job(proc, tmp_path / "run")
    assert proc.returncode == 0, out[-3000:]
    cap = tmp_path / "run" / "captures"
    metas = {r: sorted((json.loads(p.read_text()) for p in cap.glob(f"capture-*.rank{r}.json")),
                       key=lambda m: m["capture"]) for r in (0, 1)}
    assert [m["capture"] for m in metas[0]] == [1, 2], out[-3000:]
    assert [(m["first_step"], m["last_step"]) for m in metas[0]] == [(m["first_step"], m["last_step"]) for m in metas[1]]
    assert metas[0][1]["started"] - metas[0][0]["started"] >= COOLDOWN_S
    for r in (0, 1):
        for m in metas[r]:
            assert m["last_step"] - m["first_step"] == 2 and m["reason"]
            assert m["trace"].endswith(".trace.json.gz")
            with gzip.open(m["trace"], "rt") as f:
                trace = json.load(f)  # valid JSON, Chrome trace format
            events = trace["traceEvents"]
            marks = {e["name"]: e for e in events if str(e.get("name", "")).startswith("stepwatch_step_")}
            assert set(marks) == {f"stepwatch_step_{s}" for s in range(m["first_step"], m["last_step"] + 1)}
            tid = {e["tid"] for e in marks.values()}
            assert len(tid) == 1
            (t,) = tid
            first = marks[f"stepwatch_step_{m['first_step']}"]
            last = marks[f"stepwatch_step_{m['last_step']}"]
            ops = [e for e in events if e.get("tid") == t and str(e.get("name", "")).startswith(("aten::", "autograd::"))
                   and first["ts"] <= e["ts"] <= last["ts"] + last["dur"]]
            names = {e["name"] for e in ops}
            assert "aten::addmm" in names or "aten::linear" in names, sorted(names)[:20]
            assert os.stat(m["trace"]).st_mode & 0o777 == 0o600
    manifest = json.loads((tmp_path / "run" / "run.json").read_text())
    caps = manifest["features"]["capture"]["captures"]
    assert len(caps["captures"]) == 2 and caps["skipped"].get("max_count", 0) >= 1

"""Every capture is analysed off the job, and `stepwatch capture` captures on demand (real jobs).

1. A plain CPU training script under `stepwatch run` (no code change) whose DataLoader turns slow
   from step 30 on: the anomaly-triggered capture is analysed by its own process, which names
   the data wait (`enumerate(DataLoader)#...__next__`) as the gap's cause; the finding lands in
   findings.rank0.jsonl, linked to the capture, and in `stepwatch report`.
2. A 2-rank gloo DDP job (torchrun): `stepwatch capture RUN_DIR --steps 3` makes both ranks
   capture the same three steps, and prints both ranks' analyses.
"""

import json
import os
import subprocess
import sys
import time

import pytest

from test_hang import ROOT, start_job, stop_job

pytestmark = pytest.mark.integration

SLOW_DATA = r'''
import time
import torch, torch.nn as nn
from torch.utils.data import DataLoader, Dataset

SLOW_FROM = 30

class Data(Dataset):
    def __len__(self):
        return 4000
    def __getitem__(self, i):
        if i // 8 >= SLOW_FROM and i % 8 == 0:  # batch size 8: from step 30 on, each batch waits on "storage"
            time.sleep(0.04)
        return torch.randn(32), torch.randn(1)

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step, (x, y) in enumerate(DataLoader(Data(), batch_size=8)):
    if step == 160:  # room for the capture: a multi-rank job starts it up to 100 steps (MAX_LAG_STEPS) after the trigger
        break
    loss = (model(x) - y).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
print("done", flush=True)
'''


def _env(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEPWATCH_")}
    env.update({"PYTHONPATH": os.path.join(ROOT, "src") + os.pathsep + os.environ.get("PYTHONPATH", ""),
                "OMP_NUM_THREADS": "1", "STEPWATCH_CONSOLE": "off", "STEPWATCH_GPU_TELEMETRY": "0"})
    return env


def test_the_automatic_capture_of_a_data_stall_is_analysed_and_names_the_dataloader(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SLOW_DATA[1:])
    run = tmp_path / "run"
    env = _env(tmp_path)
    env.update({"STEPWATCH_WINDOW": "10", "STEPWATCH_CAPTURE_STEPS": "3"})
    r = subprocess.run([sys.executable, "-m", "stepwatch", "run", "--dir", str(run), "--", sys.executable, str(script)],
                       env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    cap = run / "captures"
    analyses = sorted(cap.glob("capture-*.rank0.analysis.json"))
    assert analyses, (sorted(os.listdir(cap)) if cap.exists() else "no captures/", r.stderr[-3000:])
    summary = json.loads(analyses[0].read_text())
    assert summary["torch_imported"] is False  # the analysis process stays small
    assert summary["note"] == "no GPU kernels" and summary["temporal"] is None
    meta = json.loads(analyses[0].with_name(analyses[0].name.replace(".analysis.json", ".json")).read_text())
    assert meta["first_step"] >= 30  # captured while the data was slow
    top = summary["gaps"][0]
    assert "DataLoader" in top["cpu_op"] and top["cause"] == "data_loading", summary["gaps"]
    assert top["dur_us"] > 30_000  # the 40 ms sleep: no aten:: op in it
    assert meta["first_step"] <= top["step"] <= meta["last_step"]
    found = [json.loads(x) for x in (run / "findings.rank0.jsonl").read_text().splitlines()]
    stall = [f for f in found if f["kind"] == "trace_data_stall"]
    assert stall, [f["kind"] for f in found]
    f = stall[0]
    assert "DataLoader" in f["summary"] and f["data"]["capture"] == meta["capture"]
    assert f["data"]["reason"] == meta["reason"] and f["data"]["trace"] == meta["trace"]
    assert f["step"] == top["step"] and "num_workers" in f["action"]
    html = tmp_path / "report.html"
    rep = subprocess.run([sys.executable, "-m", "stepwatch", "report", str(run), "--html", str(html)], env=env,
                         capture_output=True, text=True, timeout=120)
    assert rep.returncode == 0, rep.stderr[-2000:]
    assert f"Capture {meta['capture']}: steps {meta['first_step']}-{meta['last_step']}" in rep.stdout
    section = rep.stdout[rep.stdout.index(f"Capture {meta['capture']}:"):]
    assert "trace_data_stall" in section and "enumerate(DataLoader)" in section, section[:3000]
    page = html.read_text()
    assert "Captures: what the traces show" in page and "trace_data_stall" in page


def test_stepwatch_capture_takes_the_same_steps_on_every_rank_of_a_live_job(tmp_path):
    proc = start_job(tmp_path, ["--steps", "4000", "--step-sleep", "0.02"], {"STEPWATCH_CAPTURE_COOLDOWN": "3600"})
    run = tmp_path / "run"
    try:
        end = time.monotonic() + 120
        while time.monotonic() < end and not (run / "steps.rank1.jsonl").exists():
            assert proc.poll() is None, stop_job(proc, run)[-3000:]
            time.sleep(0.5)
        time.sleep(2.0)
        r = subprocess.run([sys.executable, "-m", "stepwatch", "capture", str(run), "--steps", "3", "--json",
                            "--timeout", "180"], env=_env(tmp_path), capture_output=True, text=True, timeout=240)
        assert proc.poll() is None
    finally:
        out = stop_job(proc, run)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:] + out[-3000:]
    got = json.loads(r.stdout)
    assert sorted(s["rank"] for s in got) == [0, 1]
    metas = [json.loads(p.read_text()) for p in sorted((run / "captures").glob("capture-*.rank*.json"))
             if not p.name.endswith(".analysis.json")]
    # (A step-time spike on the busy test machine may have triggered a capture of its own too.)
    metas = [m for m in metas if m["reason"] == "on demand (stepwatch capture)"]
    assert sorted(m["rank"] for m in metas) == [0, 1] and metas[0]["capture"] == metas[1]["capture"]
    assert metas[0]["first_step"] == metas[1]["first_step"]
    assert metas[0]["last_step"] == metas[1]["last_step"] == metas[0]["first_step"] + 2
    for s in got:
        assert s["steps"]["stepwatch_steps"] == list(range(metas[0]["first_step"], metas[0]["last_step"] + 1))
        assert s["note"] == "no GPU kernels" and s["torch_imported"] is False
    # The request was answered and removed.
    assert [p.name.endswith(".taken.json") for p in (run / "requests").iterdir()] == [True]

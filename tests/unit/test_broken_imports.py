"""A broken install of one optional dependency: one clear log line, everything else works.

Each case runs a small training job in a child process whose import system refuses one module
(a ``sys.meta_path`` finder raising ImportError, as a half-installed or ABI-mismatched package
does). They all stay dependencies of the package; this only simulates an install where one is
broken. py-spy is a binary, not a module: its case makes ``find_pyspy`` find nothing, as on a
machine where the wheel's binary is missing.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PRELUDE = r'''
import sys, importlib.abc
BLOCK = sys.argv[1]
class Broken(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if BLOCK and (name == BLOCK or name.startswith(BLOCK + ".")):
            raise ImportError(f"simulated broken install of {name}")
        return None
sys.meta_path.insert(0, Broken())
if sys.argv[2] == "nopyspy":
    import stepwatch._os.ptrace as _p
    _p.find_pyspy = lambda: None
'''

JOB = PRELUDE + r'''
import json, os, torch, stepwatch
torch.manual_seed(0)
m = torch.nn.Linear(8, 8)
opt = torch.optim.SGD(m.parameters(), lr=0.01)
stepwatch.init()
losses = []
for i in range(12):
    loss = m(torch.randn(4, 8)).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    losses.append(loss.item())
rd = stepwatch.get_session().ctx.run_dir
stepwatch.shutdown()
from stepwatch.cuda_ext import native_status
from stepwatch.hooks import phases
from stepwatch.metrics import tokens
print("RESULT " + json.dumps({"run_dir": rd, "losses": losses, "native": native_status(),
                              "tracker_core": phases._Core.__qualname__,
                              "throughput_core": tokens._ThroughputCore.__qualname__}))
'''

REPORT = PRELUDE + r'''
from stepwatch.cli import main
sys.exit(main(["report", sys.argv[3]]))
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(code: str, block: str, tmp_path, *extra: str, env: dict | None = None):
    full = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src"), "STEPWATCH_DIR": str(tmp_path / "run"),
            "STEPWATCH_CONSOLE": "off", **(env or {})}
    for k in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT"):
        if env is None or k not in env:
            full.pop(k, None)
    return subprocess.run([sys.executable, "-c", code, block, *extra], env=full, capture_output=True,
                          text=True, timeout=180)


def _job(block: str, tmp_path, mode: str = "", env: dict | None = None):
    p = _run(JOB, block, tmp_path, mode or "-", env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(next(l for l in p.stdout.splitlines() if l.startswith("RESULT "))[7:])
    with open(os.path.join(res["run_dir"], "steps.rank0.jsonl")) as f:
        records = [json.loads(l) for l in f]
    assert [r["step"] for r in records] == list(range(12))
    res["records"] = records
    with open(os.path.join(res["run_dir"], "run.json")) as f:
        manifest = json.load(f)
    return p.stderr, res, manifest


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    _, res, _ = _job("", tmp_path_factory.mktemp("base"))
    return res


@pytest.fixture(scope="module")
def baseline_losses(baseline):
    return baseline["losses"]


@pytest.mark.parametrize(
    "block,mode,env,needle",
    [
        ("opentelemetry", "", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"}, "metrics export is off"),
        ("prometheus_client", "", {"STEPWATCH_PROMETHEUS_PORT": "free"}, "prometheus_client"),
        ("pynvml", "", None, "nvidia-ml-py is not installed"),
        ("nvtx", "", None, "NVTX ranges off"),
        ("", "nopyspy", {"STEPWATCH_WATCHDOG": "on"}, "py-spy not found"),
    ],
)
def test_job_runs_with_one_line_when_a_dependency_is_broken(block, mode, env, needle, tmp_path, baseline_losses):
    if env and env.get("STEPWATCH_PROMETHEUS_PORT") == "free":
        env = {**env, "STEPWATCH_PROMETHEUS_PORT": str(_free_port())}
    stderr, res, manifest = _job(block, tmp_path, mode, env)
    assert res["losses"] == baseline_losses
    lines = [l for l in stderr.splitlines() if needle in l]
    assert len(lines) == 1, stderr[-3000:]
    assert "Traceback" not in stderr
    if block == "nvtx":
        assert manifest["features"]["nvtx"] is False


def test_native_extension_missing_is_named_and_job_runs(tmp_path, baseline_losses):
    stderr, res, _ = _job("stepwatch.cuda_ext._native", tmp_path)
    assert res["losses"] == baseline_losses
    assert res["native"]["extension"] is False
    assert "stepwatch.cuda_ext._native is not available" in res["native"]["error"]
    assert "Traceback" not in stderr


def test_step_line_extension_missing_writes_the_same_records(tmp_path, baseline_losses):
    """stepwatch._speedups only fills step lines faster; without it the Python template writes the
    same bytes, so nothing is said (tests/unit/test_records_lines.py checks the bytes both ways)."""
    stderr, res, _ = _job("stepwatch._speedups", tmp_path)
    assert res["losses"] == baseline_losses
    assert "Traceback" not in stderr and "_speedups" not in stderr


def test_tracker_extension_missing_writes_the_same_records(tmp_path, baseline_losses):
    """stepwatch.hooks._ctracker only runs the tracker's hot methods faster; without it the Python
    core hands over the same records (tests/unit/test_tracker_core.py compares the two), so
    nothing is said."""
    stderr, res, _ = _job("stepwatch.hooks._ctracker", tmp_path)
    assert res["losses"] == baseline_losses
    assert "Traceback" not in stderr and "_ctracker" not in stderr
    assert res["tracker_core"] == "_PyCore"


def test_flops_extension_missing_counts_the_same(tmp_path, baseline):
    """stepwatch.metrics._cmetrics only runs the FLOPs/tokens collector's per-forward path faster;
    without it the Python one counts the same FLOPs and samples each step
    (tests/unit/test_metrics_core.py compares the two call for call), so nothing is said."""
    stderr, res, _ = _job("stepwatch.metrics._cmetrics", tmp_path)
    assert res["losses"] == baseline["losses"]
    assert "Traceback" not in stderr and "_cmetrics" not in stderr
    assert res["throughput_core"] == "_PyThroughputCore" and baseline["throughput_core"] == "ThroughputCore"
    fields = ("flops", "samples", "tokens")
    want = [{k: r.get(k) for k in fields} for r in baseline["records"]]
    assert [{k: r.get(k) for k in fields} for r in res["records"]] == want
    # Step 0's forward ran before the roots were found (the optimizer predates init): from step 1.
    assert all(w["flops"] and w["samples"] == 4 for w in want[1:])


def test_report_without_rich_prints_plain_text(tmp_path):
    _, res, _ = _job("", tmp_path)
    p = _run(REPORT, "rich", tmp_path, "-", res["run_dir"])
    assert p.returncode == 0, p.stderr[-3000:]
    assert [l for l in p.stderr.splitlines() if "rich cannot be imported" in l] and "Traceback" not in p.stderr
    assert "step" in p.stdout.lower() and len(p.stdout.splitlines()) > 5


SCRAPE = PRELUDE + r'''
import urllib.request, torch, stepwatch
m = torch.nn.Linear(4, 4)
opt = torch.optim.SGD(m.parameters(), lr=0.01)
stepwatch.init(prometheus_port=int(sys.argv[3]), otel=False)
for i in range(5):
    m(torch.randn(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
import time
deadline = time.monotonic() + 30  # the background thread exports at its flush interval
while True:
    try:  # the endpoint starts with the exporters, off the training thread
        body = urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[3]}/metrics", timeout=10).read().decode()
    except OSError:
        body = ""
    lines = [l for l in body.splitlines() if l.startswith("training_steps_total")]
    if lines or time.monotonic() > deadline:
        break
    time.sleep(0.2)
stepwatch.shutdown()
print("\n".join(lines))
'''


def test_prometheus_endpoint_needs_no_opentelemetry_exporter_prometheus(tmp_path):
    """The endpoint is served without opentelemetry-exporter-prometheus (not a dependency)."""
    p = _run(SCRAPE, "opentelemetry.exporter.prometheus", tmp_path, "-", str(_free_port()))
    assert p.returncode == 0, p.stderr[-3000:]
    assert 'training_steps_total{rank="0"}' in p.stdout, p.stdout + p.stderr[-2000:]

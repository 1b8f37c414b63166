"""The GPU check scripts stay runnable: a device lease is short (minutes) and must not be spent on
the scripts' own bugs. On this CPU machine: the session check's rehearsal (``--cpu``: the same
loop and comparisons, the device-only checks left out), the timing check's clean skip, and the
shell script's syntax. The device-only parts run on a GPU machine (scripts/gpu_check.sh)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"))
    env = {k: v for k, v in env.items() if not k.startswith("STEPWATCH_")}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_session_check_rehearsal_passes_on_cpu(tmp_path):
    out = tmp_path / "seen.json"
    r = _run("scripts/gpu_check_session.py", "--cpu", "--json", str(out))
    assert r.returncode == 0 and "gpu_check_session: PASS" in r.stdout, r.stdout + r.stderr
    import json

    seen = json.loads(out.read_text())
    assert len(seen["rows"]) == 30 and seen["failures"] == []
    # the comparisons ran against real values, not Nones
    assert all(row["grad_norm"] is not None and row["loss"] is not None for row in seen["rows"])


@pytest.mark.skipif(os.path.exists("/proc/driver/nvidia"), reason="a GPU driver is here: the real check applies")
def test_timing_check_says_it_cannot_run_without_a_gpu():
    r = _run("scripts/gpu_check_timing.py")
    assert r.returncode == 2 and "SKIP" in r.stdout, r.stdout + r.stderr


def test_gpu_check_shell_script_parses():
    r = subprocess.run(["bash", "-n", os.path.join(ROOT, "scripts", "gpu_check.sh")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_ddp_check_rehearsal_captures_a_trace_and_analyses_it(tmp_path):
    """gpu_check_ddp.py --cpu: gloo instead of NCCL, the same loop, capture request and trace analysis."""
    import json

    r = _run("scripts/gpu_check_ddp.py", "--cpu", "--out", str(tmp_path))
    assert r.returncode == 0 and "gpu_check_ddp: PASS" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
    seen = json.loads((tmp_path / "ddp.json").read_text())
    assert seen["failures"] == [] and seen["records"] == seen["steps"] >= 80
    assert seen["features"]["comm"]["ddp_models"] == 1
    # the on-demand capture, and a step-time-spike capture too when the machine is busy
    assert list(tmp_path.glob("*.trace.json.gz")) and list(tmp_path.glob("*.analysis.json"))
    ranks = json.loads((tmp_path / "stepwatch_trace.json").read_text())
    assert len(ranks) == 1 and ranks[0]["note"] == "no GPU kernels"  # a CPU trace: no kernels to analyse


def test_overhead_check_rehearsal_prints_every_variant(tmp_path):
    import json

    out = tmp_path / "o.json"
    r = _run("scripts/gpu_check_overhead.py", "--cpu", "--blocks", "2", "--steps", "20", "--json", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    loop = json.loads(out.read_text())["loops"]["launch-bound"]
    assert loop["off_wall_us"][0] > 0
    for v in ("floor (off, loop norms)", "foundation, host clock", "foundation", "all defaults"):
        assert f"{v}: training thread +" in r.stdout and set(loop[v]) == {"host_us", "cpu_us", "wall_us"}

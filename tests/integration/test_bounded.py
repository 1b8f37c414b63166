"""Memory does not grow with steps: a trivial loop with stepwatch on. The spec (issue 2) is
200,000 steps < 20 MB, i.e. under 100 bytes a step; here 40,000 steps after a 10,000-step warm-up
must grow resident memory by < 4 MB, the same bound per step (a leak of 100 bytes a step shows as
4 MB). The pipeline passes every 20 ms here: at the default 0.25 s, this ~8,000-steps-a-second
loop has ~2,000 records in flight between passes (its base RSS ~10 MB higher), and where in that
cycle each RSS mark fell moved the difference by 0.4-5.9 MB (a CI failure at 5.9 MB, the same
spread on the code before). Measured at 20 ms: 0.01-0.16 MB."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = [pytest.mark.integration, pytest.mark.shares_cores]

SCRIPT = r"""
import json, resource, sys
import torch
import stepwatch

def rss_mb():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024

stepwatch.init(dir=sys.argv[1], console="off", flush_interval_s=0.02)
p = torch.nn.Parameter(torch.ones(4))
opt = torch.optim.SGD([p], lr=1e-6)
x = torch.ones(4)
marks = {}
for i in range(50_000):
    loss = (p * x).sum()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=False)
    if i == 10_000:
        marks["warm"] = rss_mb()
marks["end"] = rss_mb()
s = stepwatch.get_session()
stepwatch.shutdown()
marks["steps"] = s.steps_seen
marks["dropped"] = s.dropped
print(json.dumps(marks))
"""


def test_steps_grow_resident_memory_by_less_than_100_bytes_a_step(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src"), "OMP_NUM_THREADS": "1"}
    r = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "run")], env=env, capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stderr[-3000:]
    marks = json.loads(r.stdout.strip().splitlines()[-1])
    assert marks["steps"] + marks["dropped"] == 50_000
    assert marks["end"] - marks["warm"] < 4, marks  # MB over the 40,000 steps after warm-up

"""The OTel exporter started by a real session from its config (`stepwatch.init(prometheus_port=...)`),
fed by the real hooks on a small CPU training loop, read back from the endpoint over HTTP."""

import socket
import time
import urllib.request

import torch
import torch.nn as nn


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_session_serves_step_metrics_and_scalars(sw):
    stepwatch, mem, start = sw
    port = _free_port()
    start(prometheus_port=port, records=False)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(6):
        loss = model(torch.randn(4, 8)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        stepwatch.log(loss=1.25)
    stepwatch.step()
    s = stepwatch.get_session()
    deadline = time.monotonic() + 10
    body, n_steps = "", -1.0
    while time.monotonic() < deadline:  # the background thread passes every 50 ms here
        otel = [e for e in s.exporters if getattr(e, "name", "") == "otel"]
        if otel:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                body = r.read().decode()
            steps = [l for l in body.splitlines() if l.startswith("training_steps_total{")]
            n_steps = float(steps[0].split()[-1]) if steps else -1.0
            if n_steps >= 5 and n_steps == len(mem.records) and "training_scalar{" in body:
                break
        time.sleep(0.05)
    assert len(otel) == 1 and otel[0].prometheus.bound
    assert n_steps == len(mem.records) >= 5, (n_steps, len(mem.records))
    assert 'training_scalar{name="loss",rank="0"} 1.25' in body
    assert "training_step_seconds_bucket{" in body

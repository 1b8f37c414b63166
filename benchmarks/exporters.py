"""The training-thread cost with every exporter on: records files, the OTel exporter with its
Prometheus endpoint (scraped once a second, as Prometheus would) and OTLP/gRPC to a local
receiver (or to a dead port with ``--collector-down``).

    python benchmarks/exporters.py [--blocks 6] [--steps 150] [--collector-down]

Three tables:
1. the OTel exporter's own cost per record on the background thread (SDK calls, no training);
2. the same CPU training loop in interleaved blocks with stepwatch off and on (all exporters),
   per step size: median step time, the added microseconds per step and the ratio;
3. the tracker's per-step bookkeeping (one step's hook sequence) with all exporters running,
   against the foundation's 20 us budget.

Everything the exporters do runs off the training thread but competes for the GIL; tables 2 and
3 include that on purpose.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent import futures

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import stepwatch  # noqa: E402
from overhead import SIZES, hook_sequence, make_loop  # noqa: E402  -- the same loop as the overhead benchmark
BUDGET_US = 20.0  # the foundation's per-step budget on the training thread (README, "Overhead")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_receiver():
    import grpc
    from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc

    class R(metrics_service_pb2_grpc.MetricsServiceServicer):
        n = 0

        def Export(self, request, context):  # noqa: N802
            R.n += 1
            return metrics_service_pb2.ExportMetricsServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(R(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port, R


class Scraper:
    """Hits the Prometheus endpoint once a second, like a real scraper."""

    def __init__(self, url: str) -> None:
        self.url, self.n, self.stop = url, 0, threading.Event()
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()

    def _run(self) -> None:
        while not self.stop.wait(1.0):
            try:
                with urllib.request.urlopen(self.url, timeout=2) as r:
                    r.read()
                    self.n += 1
            except OSError:
                pass

    def close(self) -> None:
        self.stop.set()
        self.t.join(3)


def export_cost(n: int) -> None:
    from stepwatch.context import RunContext
    from stepwatch.exporters.base import Batch
    from stepwatch.exporters.otel import OTelExporter
    from stepwatch.record import StepRecord

    ctx = RunContext(rank=0, local_rank=0, world_size=1, host="bench", run_id="bench", run_dir="/tmp", pid=os.getpid())
    e = OTelExporter(ctx, prometheus_port=free_port(), environ={})
    recs = [
        StepRecord(step=i, rank=0, time=time.time(), step_s=0.1, data_wait_s=0.001, forward_s=0.03, backward_s=0.05,
                   optimizer_s=0.01, mfu=0.4, grad_norm=1.0, allreduce_s=0.01, comm_s=0.012, comm_exposed_s=0.002,
                   overlap=0.8, tokens=4096, scalars={"loss": 1.0})
        for i in range(n)
    ]
    sample = {"gpu": 0, "uuid": "GPU-0", "DCGM_FI_DEV_GPU_TEMP": 60, "DCGM_FI_PROF_SM_ACTIVE": 0.8,
              "DCGM_FI_DEV_CLOCKS_EVENT_REASONS": 0, "DCGM_FI_DEV_POWER_USAGE": 300}
    t = time.perf_counter_ns()
    for r in recs:
        e.export(Batch(records=[r]))
    per_rec = (time.perf_counter_ns() - t) / n
    t = time.perf_counter_ns()
    for i in range(0, n, 25):  # 100 steps/s at the default 0.25 s pass
        e.export(Batch(records=recs[i:i + 25]))
    per_rec_25 = (time.perf_counter_ns() - t) / n
    t = time.perf_counter_ns()
    for _ in range(n):
        e.export(Batch(samples=[sample]))
    per_sample = (time.perf_counter_ns() - t) / n
    e.shutdown()
    print("1. OTel exporter, background thread:")
    print(f"   {per_rec / 1e3:.1f} us per step record alone in a pass, {per_rec_25 / 1e3:.1f} us per record "
          f"in passes of 25, {per_sample / 1e3:.1f} us per GPU sample")


def init_all(run_dir: str, prom_port: int) -> None:
    stepwatch.init(dir=run_dir, console="off", prometheus_port=prom_port, flush_interval_s=0.25)


def side_by_side(blocks: int, steps: int, run_dir: str) -> None:
    print("\n2. training loop, stepwatch off vs on (records + OTel: Prometheus scraped 1/s + OTLP):")
    print(f"   {'step size':>10} {'off (ms)':>10} {'on (ms)':>10} {'added (us)':>11} {'ratio':>7}")
    for label, (width, batch) in SIZES.items():
        run_block = make_loop(width, batch, steps)
        run_block()
        off, on = [], []
        for i in range(blocks):
            off.append(run_block()[0])  # median wall time per step
            port = free_port()
            init_all(os.path.join(run_dir, f"{label.strip('~ ')}-{i}"), port)
            scraper = Scraper(f"http://127.0.0.1:{port}/metrics")
            on.append(run_block()[0])
            scraper.close()
            stepwatch.shutdown()
        m_off, m_on = statistics.median(off), statistics.median(on)
        print(f"   {label:>10} {m_off * 1e3:10.3f} {m_on * 1e3:10.3f} {(m_on - m_off) * 1e6:11.1f} {m_on / m_off:7.3f}")


def bookkeeping(n: int, run_dir: str) -> None:
    port = free_port()
    s = stepwatch.init(dir=os.path.join(run_dir, "bookkeeping"), console="off", queue_size=n + 16, prometheus_port=port)
    scraper = Scraper(f"http://127.0.0.1:{port}/metrics")
    one_step = hook_sequence(s.tracker)

    def noop() -> None:
        pass

    def timed(fn) -> float:
        best = float("inf")
        for _ in range(5):
            t = time.perf_counter_ns()
            for _ in range(n):
                fn()
            best = min(best, (time.perf_counter_ns() - t) / n)
        return best

    base = timed(noop)
    cost = timed(one_step)
    scraper.close()
    stepwatch.shutdown()
    added = (cost - base) / 1e3
    verdict = "within" if added <= BUDGET_US else "OVER"
    print(f"\n3. bookkeeping per step with every exporter on (best of 5 x {n}):")
    print(f"   {added:.2f} us added -> {verdict} the {BUDGET_US:.0f} us budget")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=6)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--collector-down", action="store_true", help="point OTLP at a port nothing listens on")
    args = p.parse_args()
    torch.set_num_threads(1)
    server = None
    if args.collector_down:
        os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = f"http://127.0.0.1:{free_port()}"
    else:
        server, port, R = start_receiver()
        os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = f"http://127.0.0.1:{port}"
    os.environ["OTEL_METRIC_EXPORT_INTERVAL"] = "1000"  # ms; the SDK default is 60 s
    try:
        export_cost(5000)
        with tempfile.TemporaryDirectory() as d:
            side_by_side(args.blocks, args.steps, d)
            bookkeeping(20000, d)
    finally:
        if server is not None:
            server.stop(0)
            print(f"\nOTLP receiver got {R.n} export requests")


if __name__ == "__main__":
    main()

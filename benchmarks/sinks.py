"""The training-thread cost of the TensorBoard, W&B and MLflow sinks, side by side in one run.

    python benchmarks/sinks.py [--blocks 6] [--steps 150]

Three tables:
1. the one thing the sinks add to the training thread: MLflow's and W&B's run probes at each
   step end (not imported / imported without a run / with an active run), in ns per call;
2. the background thread's cost per record for each sink (TensorBoard event file, MLflow on a
   local SQLite store, W&B offline run);
3. the same CPU training loop as overhead.py, ~0.5 ms and ~2 ms steps, in interleaved blocks:
   stepwatch on with the sinks off (STEPWATCH_WANDB=0, STEPWATCH_MLFLOW=0, no TensorBoard) and on
   with all three logging into live runs. The training thread's own CPU time per step is the
   figure to read; the sinks' work competes for the GIL from the background thread.

W&B runs offline and MLflow on SQLite in a temp dir: nothing leaves the machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import timeit

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import stepwatch  # noqa: E402
from overhead import SIZES, make_loop  # noqa: E402  -- the same loop as the overhead benchmark
from stepwatch.context import RunContext  # noqa: E402
from stepwatch.exporters.base import Batch  # noqa: E402
from stepwatch.exporters.mlflow import MlflowExporter, _active_mlflow_run, _with_tracking_uri  # noqa: E402
from stepwatch.exporters.tracking import RunProbe  # noqa: E402
from stepwatch.exporters.wandb import _active_wandb_run  # noqa: E402
from stepwatch.record import StepRecord  # noqa: E402


def probe_cost() -> None:
    n = 200_000
    noop = lambda step: None  # noqa: E731
    base = timeit.timeit(lambda: noop(1), number=n) / n
    p = RunProbe(_active_mlflow_run, _with_tracking_uri)
    rows = [("a no-op listener (reference)", base)]
    saved = sys.modules.pop("mlflow", None)
    rows.append(("mlflow not imported", timeit.timeit(lambda: p.on_step_end(1), number=n) / n))
    if saved is not None:
        sys.modules["mlflow"] = saved
    import mlflow

    rows.append(("mlflow imported, no run", timeit.timeit(lambda: p.on_step_end(1), number=n) / n))
    with mlflow.start_run():
        rows.append(("mlflow imported, active run", timeit.timeit(lambda: p.on_step_end(1), number=n) / n))
    print("1. MLflow and W&B run probes at each step end (training thread), per call:")
    for label, s in rows:
        print(f"   {label:32s} {s * 1e9:8.0f} ns")
    os.environ.setdefault("WANDB_SILENT", "true")
    import wandb

    w = RunProbe(_active_wandb_run)
    print(f"   {'wandb imported, no run':32s} {timeit.timeit(lambda: w.on_step_end(1), number=n) / n * 1e9:8.0f} ns")
    run = wandb.init(project="stepwatch-bench", mode="offline", dir=tempfile.mkdtemp())
    try:
        print(f"   {'wandb imported, active run':32s} {timeit.timeit(lambda: w.on_step_end(1), number=n) / n * 1e9:8.0f} ns")
    finally:
        run.finish()


def records(n: int, step0: int = 0) -> list[StepRecord]:
    now = time.time()
    return [
        StepRecord(step=step0 + i, rank=0, time=now, step_s=0.002, data_wait_s=1e-4, forward_s=5e-4, backward_s=9e-4,
                   optimizer_s=3e-4, other_s=2e-4, scalars={"loss": 1.0 / (i + 1)}, tokens=512, grad_norm=0.5,
                   mem_peak_bytes=1 << 30)
        for i in range(n)
    ]


def background_cost(tmp: str) -> None:
    import mlflow
    import wandb

    from stepwatch.exporters.tensorboard import TensorBoardExporter
    from stepwatch.exporters.wandb import WandbExporter

    ctx = RunContext(0, 0, 1, "host", "bench", os.path.join(tmp, "run"))
    n = 500
    print(f"2. background thread per row logged ({n} records in passes of 50; rows beyond each sink's")
    print("   rate limit are sampled out, see docs/sinks.md):")
    tb = TensorBoardExporter(ctx, os.path.join(tmp, "tb"))
    mf = MlflowExporter(ctx)
    wb = WandbExporter(ctx)
    run = wandb.init(project="stepwatch-bench", mode="offline", dir=tmp)
    with mlflow.start_run():
        mf.probe.on_step_end(0)
        for name, e in (("tensorboard", tb), ("mlflow (sqlite)", mf), ("wandb (offline)", wb)):
            t0 = time.perf_counter()
            for k in range(0, n, 50):
                e.export(Batch(records=records(50, k)))
            e.force_flush()
            dt = time.perf_counter() - t0
            logged = n - e.rows.sampled_out
            print(f"   {name:20s} {logged:4d} rows  {dt / logged * 1e6:8.0f} us a row")
    tb.shutdown()
    run.finish()


def side_by_side(blocks: int, steps: int, tmp: str) -> None:
    import mlflow
    import wandb

    from stepwatch.exporters import mlflow as m_mlflow, tensorboard as m_tb, wandb as m_wandb

    mods = (m_tb, m_wandb, m_mlflow)
    bursts = {m: m.ROWS_BURST for m in mods}

    def set_burst(steady: bool) -> None:
        # Each block is a new session, so each starts with a full burst (100-200 rows logged as
        # fast as the steps come); "steady" starts with it spent, as a long run is after its start.
        for m in mods:
            m.ROWS_BURST = 1 if steady else bursts[m]

    variants = {
        "sinks off": (dict(wandb=False, mlflow=False), False),
        "all 3, burst": (dict(tensorboard=os.path.join(tmp, "tb-loop")), False),
        "all 3, steady": (dict(tensorboard=os.path.join(tmp, "tb-loop")), True),
    }
    print("3. training loop, stepwatch on; cpu = the training thread's own CPU time per step")
    print(f"{'step size':>10} {'variant':>14} {'wall':>9} {'cpu':>9} {'cpu added vs sinks off':>24}")
    run = wandb.init(project="stepwatch-bench", mode="offline", dir=tmp)
    with mlflow.start_run():
        for label, (width, batch) in list(SIZES.items())[:2]:
            run_block = make_loop(width, batch, steps)
            run_block()
            got: dict[str, list[tuple[float, float]]] = {v: [] for v in variants}
            for i in range(blocks):
                for name, (cfg, steady) in variants.items():
                    set_burst(steady)
                    stepwatch.init(dir=os.path.join(tmp, f"{i}-{name}"), console="off", training_metrics=False,
                                   comm=False, gpu_telemetry=False, **cfg)
                    got[name].append(run_block())
                    stepwatch.shutdown()
            c_ref = statistics.median(x[1] for x in got["sinks off"])
            for name in variants:
                w = statistics.median(x[0] for x in got[name])
                c = statistics.median(x[1] for x in got[name])
                print(f"{label:>10} {name:>14} {w * 1e3:7.3f}ms {c * 1e3:7.3f}ms {(c - c_ref) * 1e6:+21.1f}us")
    run.finish()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=6)
    p.add_argument("--steps", type=int, default=150)
    a = p.parse_args()
    torch_threads = os.environ.get("OMP_NUM_THREADS")
    import torch

    torch.set_num_threads(int(torch_threads or 1))
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{tmp}/mlflow.db")
        os.environ.setdefault("WANDB_MODE", "offline")
        os.environ.setdefault("WANDB_SILENT", "true")
        os.chdir(tmp)
        probe_cost()
        background_cost(tmp)
        side_by_side(a.blocks, a.steps, tmp)


if __name__ == "__main__":
    main()

"""Which rank logs where, in a real 2-rank gloo DDP job under torchrun: TensorBoard gets one
folder per rank, each with its own rank's steps; MLflow and W&B runs that only rank 0 started
get rank 0's steps only, once each. Real libraries (SQLite MLflow store, W&B offline).

Run as a script, this file is the job:  torchrun --nproc-per-node 2 test_sinks_ddp.py OUT STEPS
"""

import glob
import json
import os
import sys

if __name__ == "__main__":
    import stepwatch.auto  # noqa: F401  -- the one line, before everything else

import torch
import torch.distributed as dist
import torch.nn as nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "unit"))

STEPS = 30

if __name__ != "__main__":  # under pytest (the job itself need not import it)
    import pytest

    pytestmark = [pytest.mark.integration, pytest.mark.shares_cores]


def job(out: str, steps: int) -> None:
    import mlflow
    import wandb

    import stepwatch

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ml = mlflow.start_run() if rank == 0 else None
    wb = wandb.init(project="stepwatch-ddp", mode="offline") if rank == 0 else None
    for i in range(steps):
        g = torch.Generator().manual_seed(i * 2 + rank)
        loss = model(torch.randn(8, 16, generator=g)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    stepwatch.shutdown()
    if rank == 0:
        with open(os.path.join(out, "runs.json"), "w") as f:
            json.dump({"mlflow": ml.info.run_id, "wandb_dir": os.path.dirname(wb.dir)}, f)
        mlflow.end_run()
        wb.finish()
    dist.destroy_process_group()


def test_each_rank_logs_its_own_series_and_only_the_owner_logs_into_the_run(tmp_path):
    from mlflow import MlflowClient
    from test_comm_ddp import records, torchrun
    from test_sinks import _scalars, _wandb_rows

    run = tmp_path / "run"
    db = f"sqlite:///{tmp_path}/mlflow.db"
    env = {
        "STEPWATCH_DIR": str(run),
        "STEPWATCH_TENSORBOARD": str(tmp_path / "tb"),
        "STEPWATCH_WATCHDOG": "off",
        "STEPWATCH_CAPTURE": "off",
        "MLFLOW_TRACKING_URI": db,
        "WANDB_MODE": "offline",
        "WANDB_DIR": str(tmp_path),
        "WANDB_SILENT": "true",
    }
    torchrun([__file__, str(tmp_path), str(STEPS)], env, tmp_path, script=[], timeout=300)

    recs = {r: records(run, r) for r in (0, 1)}
    assert all(sorted(recs[r]) == list(range(STEPS)) for r in (0, 1))
    assert sorted(os.listdir(tmp_path / "tb")) == ["rank0", "rank1"]
    for r in (0, 1):
        _, step_s = _scalars(str(tmp_path / "tb" / f"rank{r}"), "stepwatch/step_s")
        assert [s for s, _ in step_s] == list(range(STEPS))
        assert all(abs(v - recs[r][s]["step_s"]) < 1e-6 * max(1.0, recs[r][s]["step_s"]) for s, v in step_s)

    ids = json.load(open(tmp_path / "runs.json"))
    hist = MlflowClient(tracking_uri=db).get_metric_history(ids["mlflow"], "stepwatch/step_s")
    assert sorted(m.step for m in hist) == list(range(STEPS))  # once per step: rank 1 has no run
    assert all(abs(m.value - recs[0][m.step]["step_s"]) < 1e-9 for m in hist)

    files = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(files) == 1  # rank 0's run only
    rows, done = _wandb_rows(files[0])
    ours = [r for r in rows if "stepwatch/step_s" in r]
    assert sorted(r["stepwatch/step"] for r in ours) == list(range(STEPS)), done
    assert all(abs(r["stepwatch/step_s"] - recs[0][r["stepwatch/step"]]["step_s"]) < 1e-9 for r in ours)


if __name__ == "__main__":
    job(sys.argv[1], int(sys.argv[2]))

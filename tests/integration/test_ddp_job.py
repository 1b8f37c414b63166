"""The main job for real: `torchrun --nproc-per-node 2 examples/ddp_train.py` over gloo, with the
one-line import, checked through the files a user would read."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "ddp_train.py")
pytestmark = [pytest.mark.integration, pytest.mark.shares_cores]


def torchrun(args, env_extra, cwd, timeout=300):
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEPWATCH_")}
    env.update({"PYTHONPATH": os.path.join(ROOT, "src"), "OMP_NUM_THREADS": "1"})
    env.update(env_extra)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", EXAMPLE, *args]
    r = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def read_jsonl(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def test_two_rank_job_writes_one_record_per_step_per_rank(tmp_path):
    run = tmp_path / "run"
    torchrun(
        ["--steps", "40", "--batch-size", "2", "--slow-data-ms", "8", "--eval-every", "10",
         "--ckpt-every", "12", "--ckpt-dir", str(tmp_path)],
        {"STEPWATCH_DIR": str(run), "STEPWATCH_WINDOW": "6"},
        cwd=tmp_path,
    )
    manifest = json.loads((run / "run.json").read_text())
    assert manifest["world_size"] == 2
    assert manifest["hosts"] and manifest["end_time"] is not None
    assert manifest["features"]["root_modules"], manifest["features"]
    for rank in (0, 1):
        recs = read_jsonl(run / f"steps.rank{rank}.jsonl")
        # The eval after the last step (step 39's end, eval every 10) is kept in one tail record.
        assert recs[-1]["tail"] and recs[-1]["eval_s"] > 0 and recs[-1]["step_s"] == 0
        recs = recs[:-1]
        assert [r["step"] for r in recs] == list(range(40))
        assert {r["rank"] for r in recs} == {rank}
        for r in recs:
            parts = r["data_wait_s"] + r["forward_s"] + r["backward_s"] + r["optimizer_s"] + r["other_s"]
            assert abs(parts - r["step_s"]) < 1e-6
            assert isinstance(r["scalars"]["loss"], float)
        # Two samples sleeping 8 ms each: ~16 ms of data wait per step.
        waits = sorted(r["data_wait_s"] for r in recs[1:])
        assert 0.016 * 0.85 <= waits[len(waits) // 2] <= 0.016 * 1.5, waits
        assert all(r["forward_s"] > 0 and r["backward_s"] > 0 for r in recs[1:])
        assert recs[10]["eval_s"] > 0 and recs[10]["step_s"] < 0.5
        findings = read_jsonl(run / f"findings.rank{rank}.jsonl")
        kinds = {f["kind"] for f in findings}
        assert "data_loading" in kinds, findings
        f = next(f for f in findings if f["kind"] == "data_loading")
        assert "num_workers" in f["action"] and f["rank"] == rank
    ckpt = read_jsonl(run / "steps.rank0.jsonl")[12]
    assert ckpt["checkpoint_s"] > 0
    # Everything stepwatch left in the run dir is the job user's only.
    for dirpath, dirnames, filenames in os.walk(run):
        assert os.stat(dirpath).st_mode & 0o777 == 0o700, dirpath
        for n in filenames:
            assert os.stat(os.path.join(dirpath, n)).st_mode & 0o777 == 0o600, n
    assert (run / "comm_timeline.rank1.json").exists()


def test_losses_are_bit_identical_with_and_without_stepwatch(tmp_path):
    common = ["--steps", "12", "--grad-accum", "2", "--dropout", "0.2", "--batch-size", "4"]
    torchrun([*common, "--losses-out", str(tmp_path / "on")], {"STEPWATCH_DIR": str(tmp_path / "run")}, cwd=tmp_path)
    torchrun([*common, "--losses-out", str(tmp_path / "off"), "--no-stepwatch"], {}, cwd=tmp_path)
    for rank in (0, 1):
        on = (tmp_path / f"on.rank{rank}").read_text()
        off = (tmp_path / f"off.rank{rank}").read_text()
        assert len(on.splitlines()) == 12
        assert on == off, f"rank {rank} losses differ with stepwatch on"
    assert len(read_jsonl(tmp_path / "run" / "steps.rank1.jsonl")) == 12

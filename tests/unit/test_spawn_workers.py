"""``import stepwatch.auto`` at the top of the script and a DataLoader whose workers are started
with 'spawn' (macOS's default; what a Dataset that uses CUDA needs). A spawned worker imports
the script's main module again, and so ran the import: each worker of each epoch started a whole
session, with its own run directory (under torchrun, its own ``run.<n>.json`` and steps file in
the job's directory, which ``stepwatch report`` then read as restarts). Only the trainer is
measured now."""

import os
import subprocess
import sys

from torch.utils.data import DataLoader, Dataset

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = '''
import stepwatch.auto  # noqa: F401  (the one line)
import torch, torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

def main():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(TensorDataset(torch.randn(32, 16), torch.randn(32, 4)), batch_size=8,
                        num_workers=2, multiprocessing_context="spawn")
    for epoch in range(1):
        for x, y in loader:
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad(); loss.backward(); opt.step()

if __name__ == "__main__":
    main()
'''


def test_spawned_dataloader_workers_start_no_session(tmp_path):
    (tmp_path / "train.py").write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEPWATCH_")}
    env.update({"PYTHONPATH": os.path.join(ROOT, "src"), "OMP_NUM_THREADS": "1", "STEPWATCH_CONSOLE": "off",
                "STEPWATCH_DIR": str(tmp_path / "run"), "TORCHELASTIC_RUN_ID": "job"})
    r = subprocess.run([sys.executable, "train.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    files = sorted(os.listdir(tmp_path / "run"))
    steps = [f for f in files if f.startswith("steps.")]
    manifests = [f for f in files if f.startswith("run") and f.endswith(".json")]
    assert steps == ["steps.rank0.jsonl"] and manifests == ["run.json"], files  # one attempt, the trainer's
    with open(tmp_path / "run" / "steps.rank0.jsonl") as f:
        assert sum(1 for line in f if line.strip()) == 4  # 4 batches
    assert not (tmp_path / "stepwatch-runs").exists()


class _Mark(Dataset):
    """Each item: what the worker process sees of the mark."""

    def __len__(self):
        return 4

    def __getitem__(self, i):
        from stepwatch import _env

        return os.environ.get(_env.DATALOADER_WORKER, "")


def test_the_workers_mark_is_set_only_while_they_start(sw):
    """The variable that tells a worker what it is: a worker sees the trainer's pid; the trainer
    has it only while it starts its workers (a process the job starts later is not a worker)."""
    from stepwatch import _env

    stepwatch, mem, start = sw
    start()
    seen = [b for batch in DataLoader(_Mark(), batch_size=2, num_workers=1) for b in batch]
    assert seen == [str(os.getpid())] * 4
    assert _env.DATALOADER_WORKER not in os.environ
    assert [b for batch in DataLoader(_Mark(), batch_size=2) for b in batch] == [""] * 4  # no workers: no mark


POOL_SCRIPT = '''
import stepwatch.auto  # noqa: F401  (the one line)
import multiprocessing as mp
import os, sys
import torch, torch.nn as nn
import stepwatch


def prep(i):  # a Pool worker's preprocessing: no training, no session
    return stepwatch.get_session() is not None


def train(n):
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(n):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()


def rank():  # a process that trains (torch.multiprocessing.spawn's shape): measured
    train(3)
    stepwatch.shutdown()


if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    with ctx.Pool(2) as pool:
        live = pool.map(prep, range(4))
    train(4)
    p = ctx.Process(target=rank)
    p.start()
    p.join()
    print("live", live, "exit", p.exitcode)
    sys.exit(0 if p.exitcode == 0 and not any(live) else 1)
'''


def test_spawned_pool_workers_start_no_session_and_a_spawned_trainer_does(tmp_path):
    """A spawn Pool's workers import the script again (and its ``import stepwatch.auto``): they
    each started a session, with a run directory (under torchrun also a watchdog sidecar, a
    profiler warm-up and the rank's watchdog file replaced). A spawned process starts stepwatch
    when it makes its first optimizer: the Pool's workers never do; a trainer does."""
    (tmp_path / "train.py").write_text(POOL_SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEPWATCH_")}
    env.update({"PYTHONPATH": os.path.join(ROOT, "src"), "OMP_NUM_THREADS": "1", "STEPWATCH_CONSOLE": "off"})
    r = subprocess.run([sys.executable, "train.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    runs = sorted(os.listdir(tmp_path / "stepwatch-runs"))
    assert len(runs) == 2, runs  # the script's and the spawned trainer's, none of the Pool's
    counts = []
    for d in runs:
        with open(tmp_path / "stepwatch-runs" / d / "steps.rank0.jsonl") as f:
            counts.append(sum(1 for line in f if line.strip()))
    assert sorted(counts) == [3, 4], counts


MP_SPAWN_SCRIPT = '''
import stepwatch.auto  # noqa: F401  (the one line, in the launcher and in each rank)
import os, torch, torch.nn as nn, torch.distributed as dist, torch.multiprocessing as mp

def rank_main(rank, world):
    # No RANK/WORLD_SIZE in the environment (mp.spawn sets none): the process group says them.
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(4):
        model(torch.randn(4, 8)).sum().backward(); opt.step(); opt.zero_grad()
    dist.destroy_process_group()

if __name__ == "__main__":
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"])
    mp.spawn(rank_main, args=(2,), nprocs=2)
'''


def test_the_launcher_of_torch_multiprocessing_spawn_leaves_no_run_of_its_own(tmp_path):
    """``mp.spawn(main, nprocs=2)`` under ``import stepwatch.auto``: the launcher, which trains
    nothing, started a whole session and wrote its own manifest, rank file and empty steps file
    in the job's directory (``run.1.json``...), which ``stepwatch report`` then showed as the run
    (world size 1, "attempts 0, 1"). The launcher's session now ends when it launches the ranks,
    and takes its files with it. Each rank, whose session starts at its first optimizer after
    ``init_process_group`` with no RANK/WORLD_SIZE in its environment, took itself for a lone
    process (world size 1) when its features started: the hang watchdog's ``auto`` left it off.
    The session reads the process group at its start."""
    import json
    import socket

    (tmp_path / "train.py").write_text(MP_SPAWN_SCRIPT)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEPWATCH_")}
    env.update({"PYTHONPATH": os.path.join(ROOT, "src"), "OMP_NUM_THREADS": "1", "STEPWATCH_CONSOLE": "off",
                "STEPWATCH_DIR": str(tmp_path / "run"), "PORT": str(port), "STEPWATCH_FLUSH_INTERVAL": "0.2"})
    r = subprocess.run([sys.executable, "train.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    files = sorted(f for f in os.listdir(tmp_path / "run") if not os.path.isdir(tmp_path / "run" / f))
    assert [f for f in files if f.startswith(("run", "rank", "steps."))] == [
        "rank0.json", "rank1.json", "run.json", "steps.rank0.jsonl", "steps.rank1.jsonl"], files
    manifest = json.loads((tmp_path / "run" / "run.json").read_text())
    assert manifest["world_size"] == 2 and manifest["steps"] == 4
    assert "watchdog.rank0.json" in files and "watchdog.rank1.json" in files, files  # the watchdog ran
    assert not (tmp_path / "stepwatch-runs").exists()


def test_the_ranks_torch_multiprocessing_spawns_under_stepwatch_run_measure_themselves(tmp_path):
    """The same job with no stepwatch line, under ``stepwatch run``: the shim starts stepwatch in
    the command's first Python process and marks it (``STEPWATCH_RUN_ACTIVE``) so that the
    processes it starts (DataLoader workers) stay out. The ranks ``mp.spawn`` started inherited
    the mark: none was measured (no steps file), while the launcher said "each rank measures
    itself". The launcher now lifts the mark for the processes torch.multiprocessing starts."""
    import json
    import socket

    (tmp_path / "train.py").write_text(MP_SPAWN_SCRIPT.replace("import stepwatch.auto", "pass"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEPWATCH_")}
    env.update({"PYTHONPATH": os.path.join(ROOT, "src"), "OMP_NUM_THREADS": "1", "STEPWATCH_CONSOLE": "off",
                "PORT": str(port), "STEPWATCH_FLUSH_INTERVAL": "0.2"})
    r = subprocess.run([sys.executable, "-m", "stepwatch", "run", "--dir", str(tmp_path / "run"), "--",
                        sys.executable, "train.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    files = sorted(f for f in os.listdir(tmp_path / "run") if not os.path.isdir(tmp_path / "run" / f))
    assert [f for f in files if f.startswith(("run", "rank", "steps."))] == [
        "rank0.json", "rank1.json", "run.json", "steps.rank0.jsonl", "steps.rank1.jsonl"], files
    manifest = json.loads((tmp_path / "run" / "run.json").read_text())
    assert manifest["world_size"] == 2 and manifest["steps"] == 4, manifest
    for rank in (0, 1):
        with open(tmp_path / "run" / f"steps.rank{rank}.jsonl") as f:
            assert [json.loads(line)["step"] for line in f] == [0, 1, 2, 3]
    assert not (tmp_path / "stepwatch-runs").exists()


HOGWILD_SCRIPT = '''
import torch, torch.nn as nn, torch.multiprocessing as mp

def train(rank):
    torch.manual_seed(0)
    model = nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad(); model(torch.randn(4, 8)).sum().backward(); opt.step()

def square(x):
    return x * x

if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    with ctx.Pool(2) as pool:
        assert pool.map(square, range(4)) == [0, 1, 4, 9]
    p = ctx.Process(target=train, args=(0,))
    p.start(); p.join()
    assert p.exitcode == 0
'''


def test_a_spawned_trainer_under_stepwatch_run_is_measured_and_a_pools_workers_are_not(tmp_path):
    """pytorch/examples' mnist_hogwild trains in ``mp.Process`` children started with 'spawn', and
    preprocessing often runs in a spawn Pool. Under ``stepwatch run`` the trainer inherited the
    shim's mark and was not measured. A spawned child of the measured process now starts
    stepwatch at its first optimizer: the trainer's 3 steps are recorded; the Pool's workers,
    which make no optimizer, start nothing. The launcher, which trained nothing, leaves an empty
    steps file beside the trainer's, which the report read as a second attempt (a restart)."""
    import json

    (tmp_path / "train.py").write_text(HOGWILD_SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEPWATCH_")}
    env.update({"PYTHONPATH": os.path.join(ROOT, "src"), "OMP_NUM_THREADS": "1", "STEPWATCH_CONSOLE": "off"})
    r = subprocess.run([sys.executable, "-m", "stepwatch", "run", "--dir", str(tmp_path / "run"), "--",
                        sys.executable, "train.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    steps = {}
    for f in os.listdir(tmp_path / "run"):
        if f.startswith("steps."):
            with open(tmp_path / "run" / f) as fh:
                steps[f] = [json.loads(line)["step"] for line in fh]
    # the trainer's steps, and the launcher's (which trained nothing) empty file: no Pool worker's
    assert sorted(steps.values()) == [[], [0, 1, 2]], steps
    # the report reads one attempt: the launcher's empty file is no restart
    from stepwatch.report.load import load_run

    assert load_run(str(tmp_path / "run")).attempts == {0: [0]}


TCP_SPAWN_SCRIPT = MP_SPAWN_SCRIPT.replace(
    'dist.init_process_group("gloo", rank=rank, world_size=world)',
    'dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + os.environ["PORT"], rank=rank, '
    'world_size=world)').replace(
    '    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"])\n', '')


def _tcp_spawn(tmp_path, *, under_run):
    import socket

    (tmp_path / "train.py").write_text(TCP_SPAWN_SCRIPT.replace("import stepwatch.auto", "pass") if under_run
                                       else TCP_SPAWN_SCRIPT)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STEPWATCH_", "MASTER_", "TORCHELASTIC_"))}
    env.update({"PYTHONPATH": os.path.join(ROOT, "src"), "OMP_NUM_THREADS": "1", "STEPWATCH_CONSOLE": "off",
                "PORT": str(port), "STEPWATCH_FLUSH_INTERVAL": "0.2"})
    cmd = [sys.executable, "train.py"]
    if under_run:
        cmd = [sys.executable, "-m", "stepwatch", "run", "--", *cmd]
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return port, r.stderr


def test_ranks_spawned_with_a_tcp_init_method_share_one_run(tmp_path):
    """``mp.spawn`` ranks that meet through ``init_method="tcp://HOST:PORT"``, with no
    MASTER_ADDR/MASTER_PORT or TORCHELASTIC_RUN_ID: each rank took a lone process's run id (a
    timestamp and its pid), so each wrote a run directory of its own (rank 1's without run.json),
    and the straggler exchange, the hang verdict and captures, keyed by the run id, never joined
    the ranks. A rank whose session starts after its process group exists takes the default
    store's address as the job's id, the same on every rank."""
    import json

    port, err = _tcp_spawn(tmp_path, under_run=False)
    assert os.listdir(tmp_path / "stepwatch-runs") == [f"job-127.0.0.1-{port}"], err[-3000:]
    run = tmp_path / "stepwatch-runs" / f"job-127.0.0.1-{port}"
    files = sorted(os.listdir(run))
    assert [f for f in files if f.startswith(("run", "rank", "steps."))] == [
        "rank0.json", "rank1.json", "run.json", "steps.rank0.jsonl", "steps.rank1.jsonl"], files
    assert json.loads((run / "run.json").read_text())["world_size"] == 2
    assert "before the process group existed" not in err


def test_the_same_job_under_stepwatch_run_leaves_one_run_directory(tmp_path):
    """Under ``stepwatch run`` the launcher's session (captures on) wrote its SIGUSR1 file into a
    run directory of its own, which it left behind when it stood down for the ranks."""
    port, err = _tcp_spawn(tmp_path, under_run=True)
    assert os.listdir(tmp_path / "stepwatch-runs") == [f"job-127.0.0.1-{port}"], err[-3000:]


def test_ranks_that_start_stepwatch_before_their_process_group_are_told_to_set_a_run_id(tmp_path):
    """``stepwatch.init()`` first in each spawned rank, then ``init_process_group`` with a tcp
    init method: nothing tells the ranks' sessions apart at init, and each writes its own run
    directory. One warning per rank says so and how to join them."""
    import socket

    script = TCP_SPAWN_SCRIPT.replace(
        "    dist.init_process_group(", "    import stepwatch; stepwatch.init(console='off')\n    dist.init_process_group(")
    (tmp_path / "train.py").write_text(script.replace("import stepwatch.auto", "pass"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STEPWATCH_", "MASTER_", "TORCHELASTIC_"))}
    env.update({"PYTHONPATH": os.path.join(ROOT, "src"), "OMP_NUM_THREADS": "1", "PORT": str(port)})
    r = subprocess.run([sys.executable, "train.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [x for x in r.stderr.splitlines() if "before the process group existed" in x]
    assert len(lines) == 2 and all("STEPWATCH_RUN_ID" in x for x in lines), r.stderr[-3000:]
    assert len(os.listdir(tmp_path / "stepwatch-runs")) == 2

"""On-demand stacks while a real 2-rank job keeps training: `stepwatch dump RUN_DIR`,
`stepwatch dump PID`, and `kill -USR1 <rank pid>` -- with the job's own SIGUSR1 handler (installed
after `import stepwatch.auto`) still running."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from stepwatch.runner import cli as runner
from test_hang import ROOT, start_job, stop_job

pytestmark = [pytest.mark.integration, pytest.mark.shares_cores]


def stepwatch_cli(*args):
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"))
    return subprocess.run([sys.executable, "-m", "stepwatch", *args], env=env, capture_output=True, text=True, timeout=60)


def test_dump_and_sigusr1_while_the_job_trains(tmp_path):
    run = tmp_path / "run"
    proc = start_job(tmp_path, ["--steps", "90", "--step-sleep", "0.1", "--usr1-handler", "--ready", str(tmp_path / "ready")],
                     {})
    try:
        end = time.monotonic() + 90
        while not all((tmp_path / f"ready.rank{r}").exists() and (run / f"rank{r}.json").exists() for r in (0, 1)):
            assert proc.poll() is None and time.monotonic() < end, stop_job(proc, run)[-3000:]
            time.sleep(0.2)
        pids = {r: int((tmp_path / f"ready.rank{r}").read_text()) for r in (0, 1)}

        r = stepwatch_cli("dump", str(run))
        assert r.returncode == 0, r.stderr
        for rank in (0, 1):
            text = (run / "dump-1" / f"stacks.rank{rank}.txt").read_text()
            assert '"MainThread"' in text and "job.py:" in text, text

        r = stepwatch_cli("dump", str(pids[0]))
        assert r.returncode == 0 and f"Process {pids[0]}" in r.stdout and "job.py:" in r.stdout, r.stderr

        sig_file = run / "sigusr1.rank1.txt"
        before = sig_file.stat().st_size
        os.kill(pids[1], signal.SIGUSR1)
        deadline = time.monotonic() + 10
        while sig_file.stat().st_size == before and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
        text = sig_file.read_text()[before:]
        assert "most recent call first" in text and "job.py" in text, text
        assert proc.poll() is None  # still training
        proc.wait(timeout=120)
    finally:
        out = stop_job(proc, run)
    assert proc.returncode == 0, out[-3000:]
    assert "rank 1 done; SIGUSR1 handler calls: 1" in out and "rank 0 done; SIGUSR1 handler calls: 0" in out, out[-3000:]
    for rank in (0, 1):
        steps = [json.loads(x) for x in (run / f"steps.rank{rank}.jsonl").read_text().splitlines()]
        assert len(steps) == 90
    manifest = json.loads((run / "run.json").read_text())
    sig = manifest["features"]["capture"]["hang_watchdog"]["sigusr1"]
    assert sig["signal"] == "SIGUSR1" and sig["sa_restart"]


PLAIN = """
import gc, torch, torch.distributed as dist, torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("gloo")
model = DDP(nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(12):
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    opt.zero_grad()
# the example's teardown (examples/ddp_train.py): barrier, DDP freed on the main thread, destroy
dist.barrier()
model = opt = None
gc.collect()
dist.destroy_process_group()
"""


def test_stepwatch_run_enables_every_rank_without_a_code_change(tmp_path):
    script = tmp_path / "plain.py"
    script.write_text(PLAIN)
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEPWATCH_")}
    env.update({"PYTHONPATH": os.path.join(ROOT, "src"), "OMP_NUM_THREADS": "1", "STEPWATCH_CONSOLE": "off",
                "STEPWATCH_GPU_TELEMETRY": "0"})
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "stepwatch", "run", "--dir", str(run), "--",
           sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]
    r = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    for rank in (0, 1):
        steps = [json.loads(x) for x in (run / f"steps.rank{rank}.jsonl").read_text().splitlines()]
        assert len(steps) == 12 and steps[-1]["rank"] == rank
        assert json.loads((run / f"watchdog.rank{rank}.json").read_text())["rank"] == rank
    # Only the two ranks: not torchrun's agent, not the sidecars.
    assert sorted(p.name for p in run.glob("rank*.json")) == ["rank0.json", "rank1.json"]


CHILD = r"""
import json, os, subprocess, sys
import stepwatch
s = stepwatch.get_session()
kid = subprocess.run([sys.executable, "-c", "import stepwatch; print(stepwatch.get_session() is not None)"],
                     capture_output=True, text=True)
print(json.dumps({"session": s is not None, "child_session": kid.stdout.strip(), "own": os.environ.get("OWN_SITE")}))
"""


def test_shim_starts_stepwatch_in_the_command_not_its_children_and_chains_sitecustomize(tmp_path):
    own = tmp_path / "own"
    own.mkdir()
    (own / "sitecustomize.py").write_text("import os\nos.environ['OWN_SITE'] = 'ran'\n")
    src = os.path.dirname(os.path.dirname(runner.__file__))
    environ = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": os.pathsep.join([os.path.dirname(src), str(own)]),
               "STEPWATCH_CONSOLE": "off", "STEPWATCH_GPU_TELEMETRY": "0", "STEPWATCH_WATCHDOG": "off",
               "STEPWATCH_CAPTURE": "off"}
    argv, env = runner.build([sys.executable, "-c", CHILD], nsys=False, nsys_ranges=5, run_dir=str(tmp_path / "run"),
                             environ=environ)
    r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out == {"session": True, "child_session": "False", "own": "ran"}


def test_shim_leaves_a_launcher_alone_and_starts_stepwatch_in_what_it_launches(tmp_path):
    """`stepwatch run -- accelerate launch train.py`: the launcher (a console script named
    accelerate, here a stand-in that starts the script as accelerate's simple launcher does) is not
    the job; the process it starts is, and gets stepwatch."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    launcher = bindir / "accelerate"
    launcher.write_text(
        f"#!{sys.executable}\n"
        "import json, subprocess, sys\nimport stepwatch\n"
        "kid = subprocess.run([sys.executable, sys.argv[2]], capture_output=True, text=True)\n"
        "print(json.dumps({'launcher_session': stepwatch.get_session() is not None, 'script': kid.stdout.strip()}))\n"
    )
    launcher.chmod(0o755)
    script = tmp_path / "train.py"
    script.write_text("import stepwatch\nprint(stepwatch.get_session() is not None)\n")
    src = os.path.dirname(os.path.dirname(runner.__file__))
    environ = {"PATH": f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}", "PYTHONPATH": os.path.dirname(src),
               "STEPWATCH_CONSOLE": "off", "STEPWATCH_GPU_TELEMETRY": "0", "STEPWATCH_WATCHDOG": "off",
               "STEPWATCH_CAPTURE": "off"}
    argv, env = runner.build(["accelerate", "launch", str(script)], nsys=False, nsys_ranges=5,
                             run_dir=str(tmp_path / "run"), environ=environ)
    r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1]) == {"launcher_session": False, "script": "True"}

"""Grad-norm spikes are judged against the same optimizer's norms, not against another model's.

A process that trains two models with optimizers of their own (rank 0 also trains a small linear
probe every third iteration, as a monitoring head) has two scales of grad norm. Before this test
was written the detector kept one rolling median per rank over both, and called the
probe's ordinary norms spikes of the main model's median (the hunter's job: main ~0.45, probe
~1.8, "grad norm 3.56 (6.2x the rolling median 0.575)", 8 false warnings in 150 iterations; the
job here: main ~0.57, probe ~3.8, 27 false warnings, and the one real spike lost in their
episode). Now each optimizer's records have a history of their own: no false spike, and a real
one of either model is still found.

A real 2-rank gloo job under torchrun (DDP main model, the probe on rank 0, the one-line import,
a real run dir), then the enricher and the detector in one pipeline, on records built by hand."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import torch

from stepwatch.context import RunContext
from stepwatch.exporters.base import InMemoryExporter
from stepwatch.exporters.builtin import ExporterSpec
from stepwatch.metrics.grads import GradNormEnricher, GradNormSources, GradNormSpikeDetector, PendingGradNorm
from stepwatch._pipeline import Pipeline
from stepwatch.record import RawStep

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ITERS = 150
SPIKE_AT = 120  # the main model's loss x20 at this iteration, on both ranks: a real spike

JOB = r'''
import stepwatch.auto  # noqa: F401  -- the one line
import json, sys
import torch, torch.distributed as dist, torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

iters, spike_at = int(sys.argv[1]), int(sys.argv[2])
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1)))
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
probe = nn.Linear(32, 1)
popt = torch.optim.SGD(probe.parameters(), lr=1e-3)


def norm(ps):
    return float(torch.linalg.vector_norm(torch.stack([p.grad.double().norm() for p in ps])))


steps = []  # (which model, its true grad norm), one per optimizer step, in order
for it in range(iters):
    g = torch.Generator().manual_seed(it)  # the same batch on both ranks: one scale of norm
    loss = model(torch.randn(8, 32, generator=g)).pow(2).mean()
    (loss * (20.0 if it == spike_at else 1.0)).backward()
    steps.append(("main", norm(model.parameters())))
    opt.step()
    opt.zero_grad()
    if rank == 0 and it % 3 == 0:  # rank 0's own probe, with an optimizer of its own
        (2.0 * probe(torch.randn(8, 32, generator=g)).pow(2).mean()).backward()
        steps.append(("probe", norm(probe.parameters())))
        popt.step()
        popt.zero_grad()
with open(f"{sys.argv[3]}/out.rank{rank}.json", "w") as f:
    json.dump(steps, f)
dist.barrier()
dist.destroy_process_group()
'''


def _read(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def test_two_models_on_one_rank_no_false_spike_and_a_real_one_is_found(tmp_path):
    job = tmp_path / "job.py"
    job.write_text(JOB)
    run = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEPWATCH_")}
    env.update({"PYTHONPATH": os.path.join(ROOT, "src"), "OMP_NUM_THREADS": "1", "STEPWATCH_DIR": str(run),
                "STEPWATCH_CONSOLE": "off", "STEPWATCH_WATCHDOG": "off", "STEPWATCH_CAPTURE": "off",
                "STEPWATCH_GPU_TELEMETRY": "0"})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(job),
           str(ITERS), str(SPIKE_AT), str(tmp_path)]
    r = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for rank in (0, 1):
        steps = json.loads((tmp_path / f"out.rank{rank}.json").read_text())
        recs = _read(run / f"steps.rank{rank}.jsonl")
        assert len(recs) == len(steps) == ITERS + (ITERS + 2) // 3 * (rank == 0)
        # each optimizer step a record, with its own model's norm
        assert all(math.isclose(rec["grad_norm"], want, rel_tol=1e-5) for rec, (_, want) in zip(recs, steps))
        spike_step = [i for i, (what, _) in enumerate(steps) if what == "main"][SPIKE_AT]
        fpath = run / f"findings.rank{rank}.jsonl"
        spikes = [f for f in (_read(fpath) if fpath.exists() else []) if f["kind"] == "grad_norm_spike"]
        assert [f["step"] for f in spikes] == [spike_step], [f["summary"] for f in spikes]
        if rank == 0:  # the probe's norms really are another scale: one history would have misread them
            probe_norms = sorted(n for what, n in steps if what == "probe")
            main_norms = sorted(n for what, n in steps if what == "main")
            assert probe_norms[len(probe_norms) // 2] > 5 * main_norms[len(main_norms) // 2]
            assert probe_norms[-1] < 10  # none of the probe's is a spike of its own (absolute or relative)


# ------------------------------------------------------------- the enricher and detector in a pipeline

MS = 1_000_000
MAIN, PROBE = 1111, 2222  # two optimizers' ids


def _raw(step, norm, opt_id):
    pend = PendingGradNorm(torch.tensor([0.0, norm], dtype=torch.float64), optimizer_id=opt_id)
    return RawStep(step, 0, 10 * MS, 0, 3 * MS, 4 * MS, 2 * MS, 0, 0, {}, {}, False, None, {"grad_norm": [pend]}, False)


def _pipeline(abs_threshold=10.0):
    out = InMemoryExporter()
    # the findings' rate limit over 3 steps: two spikes 6 steps apart are two episodes
    p = Pipeline(RunContext(rank=0, local_rank=0, world_size=1, host="h", run_id="r", run_dir="/nonexistent"),
                 sinks=lambda: [ExporterSpec("records", lambda: out, inline=True)], window=3)
    sources = GradNormSources()  # shared, as metrics/__init__.py wires them
    p.add_enricher(GradNormEnricher(sources=sources))
    p.add_detector(GradNormSpikeDetector(abs_threshold=abs_threshold, factor=5.0, window=100, sources=sources))
    return p, out


def _run(p, out, norms):
    """``norms``: (value, optimizer id) per step, a pass every 7 steps; the spike findings' steps."""
    for step, (norm, opt_id) in enumerate(norms):
        p.enqueue(_raw(step, norm, opt_id))
        if step % 7 == 6:
            p.run_pass()
    p.run_pass()
    assert [r.grad_norm for r in out.records] == [n for n, _ in norms]
    return [f.step for f in out.findings if f.kind == "grad_norm_spike"]


def _two_models(iters):
    """The main model every iteration (0.40-0.50), a probe every third (1.5, 2.5 or 3.5)."""
    norms = []
    for it in range(iters):
        norms.append((0.4 + 0.01 * (it % 11), MAIN))
        if it % 3 == 0:
            norms.append((1.5 + (it // 3) % 3, PROBE))
    return norms


def test_each_optimizer_has_its_own_rolling_median():
    """The probe's 3.5 is 7x the main model's median (0.45) but its own ordinary norm: no spike.
    One history over both (the median stays the main model's) flagged it."""
    p, out = _pipeline()
    assert _run(p, out, _two_models(90)) == []
    assert not p.detectors[0].sources.by_id  # every note was taken by the detector


def test_a_real_spike_of_either_model_is_found_against_its_own_median():
    """The main model's 3.0 (6.7x its 0.45) and the probe's 13.0 (5.2x its 2.5) are spikes; the
    probe's 9.5 (3.8x its own median, 20x the main model's) is not. The absolute threshold is
    out of the way here: only the medians judge."""
    p, out = _pipeline(abs_threshold=100.0)
    norms = _two_models(60)
    main_spike = len(norms)
    norms += [(3.0, MAIN), (0.45, MAIN), (0.45, MAIN), (9.5, PROBE), (0.45, MAIN), (2.5, PROBE)]
    probe_spike = len(norms)
    norms += [(13.0, PROBE), (0.45, MAIN)]
    assert _run(p, out, norms) == [main_spike, probe_spike]


def test_one_optimizer_notes_nothing_and_judges_as_before():
    """A job with one optimizer (nearly every job): no note per record, the one history as it was."""
    p, out = _pipeline()
    norms = [(0.4 + 0.01 * (i % 11), MAIN) for i in range(40)] + [(3.0, MAIN), (0.45, MAIN)]
    assert _run(p, out, norms) == [40]
    assert not p.detectors[0].sources.by_id
    det = p.detectors[0]
    assert len(det._recent) == 42 and not det._others

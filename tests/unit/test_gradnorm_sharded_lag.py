"""Sharded grad-norm (FSDP2 ``fully_shard``) through the c10d store keeps up with a fast loop.

Each rank's partial norm (its shards' sum of squares) goes through the store and comes back as the
global norm. Before this test was written each pass published only the record at the head of the
held ones, and a record waited for the previous one's global value: about one step per pass
(~4 records/s), so the records file fell ever further behind a fast loop, records held 30 s left
with ``grad_norm`` null, and shutdown released thousands at once. Now each pass publishes every
record whose local value is in, and releases every record whose global norm is back, in order.

A real 2-rank gloo job under torchrun (FSDP2 on CPU, the one-line import, a real run dir): mid-run
the records file lags the loop by about a pass, and every record carries the global norm the job
computes itself (an all-reduce of the squared local shard norms). Then two pipelines on one
HashStore, driven pass by pass, for the protocol's edges."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from stepwatch import _pipeline as pipeline_mod
from stepwatch.context import RunContext
from stepwatch.exporters.base import InMemoryExporter
from stepwatch.exporters.builtin import ExporterSpec
from stepwatch.metrics.grads import GradNormEnricher, PendingGradNorm, StoreNormExchange
from stepwatch._pipeline import Pipeline
from stepwatch.record import RawStep

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

LOOP_S = 5.0  # the job's loop: long enough that a lag of one step per pass shows seconds behind
LAG_BOUND_S = 1.5  # a record reaches the file within this of its step's end (passes are 0.25 s)

JOB = r'''
import stepwatch.auto  # noqa: F401  -- the one line
import json, math, os, sys, time
import torch, torch.distributed as dist, torch.nn as nn
from torch.distributed.fsdp import fully_shard

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
for layer in (model[0], model[2], model[4]):
    fully_shard(layer)
fully_shard(model)
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
loop_s = float(sys.argv[1])
path = os.path.join(os.environ["STEPWATCH_DIR"], f"steps.rank{rank}.jsonl")


def lines_on_disk():
    try:
        with open(path, "rb") as f:
            return f.read().count(b"\n")
    except FileNotFoundError:
        return 0


sqs, ends, checks = [], [], []
t0 = time.monotonic()
next_check = t0 + 2.0
step = 0
while True:
    g = torch.Generator().manual_seed(1000 * step + rank)
    loss = model(torch.randn(16, 32, generator=g)).pow(2).mean()
    loss.backward()
    with torch.no_grad():  # this rank's part of the true norm: its shards' sum of squares
        sqs.append(sum((p.grad.to_local().double() ** 2).sum() for p in model.parameters()))
    opt.step()
    opt.zero_grad()
    ends.append(time.monotonic())
    step += 1
    now = time.monotonic()
    if now >= next_check:
        next_check = now + 1.0
        n = lines_on_disk()
        # how long ago the oldest step not yet on disk ended (0: every step done is there)
        lag = now - ends[n] if n < step else 0.0
        checks.append({"t": now - t0, "done": step, "on_disk": n, "lag_s": lag})
    if step % 20 == 0:  # both ranks stop at the same step
        stop = torch.tensor([1.0 if now - t0 > loop_s else 0.0])
        dist.all_reduce(stop, op=dist.ReduceOp.MAX)
        if stop.item() > 0:
            break
sq = torch.stack(sqs)
dist.all_reduce(sq)  # the sum over ranks of each step's squared shard norms
with open(os.path.join(sys.argv[2], f"out.rank{rank}.json"), "w") as f:
    json.dump({"steps": step, "gt": [math.sqrt(float(v)) for v in sq], "checks": checks}, f)
dist.barrier()
dist.destroy_process_group()
'''


def _run_job(tmp_path):
    job = tmp_path / "job.py"
    job.write_text(JOB)
    run = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEPWATCH_")}
    env.update({"PYTHONPATH": os.path.join(ROOT, "src"), "OMP_NUM_THREADS": "1", "STEPWATCH_DIR": str(run),
                "STEPWATCH_WATCHDOG": "off", "STEPWATCH_CAPTURE": "off", "STEPWATCH_GPU_TELEMETRY": "0"})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(job),
           str(LOOP_S), str(tmp_path)]
    r = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return run


def _read(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def test_fsdp2_fast_loop_records_keep_up_and_carry_the_global_norm(tmp_path):
    run = _run_job(tmp_path)
    for rank in (0, 1):
        out = json.loads((tmp_path / f"out.rank{rank}.json").read_text())
        steps, gt, checks = out["steps"], out["gt"], out["checks"]
        assert steps > 60, out  # a fast loop: many steps per 0.25 s pass (one per pass could not keep up)
        # Mid-run: the file holds every step that ended more than about a pass ago.
        assert len([c for c in checks if c["t"] >= 3.0]) >= 1, checks
        worst = max(c["lag_s"] for c in checks)
        assert worst <= LAG_BOUND_S, f"rank {rank}: records file {worst:.1f} s behind the loop: {checks}"
        recs = _read(run / f"steps.rank{rank}.jsonl")
        assert [r["step"] for r in recs] == list(range(steps))
        nulls = [r["step"] for r in recs if r["grad_norm"] is None]
        assert not nulls, f"rank {rank}: {len(nulls)} of {steps} records without a grad norm (first {nulls[:5]})"
        bad = [(r["step"], r["grad_norm"], want) for r, want in zip(recs, gt)
               if not math.isclose(r["grad_norm"], want, rel_tol=1e-5)]
        assert not bad, f"rank {rank}: {len(bad)} records with a wrong norm, e.g. {bad[:3]}"
        fpath = run / f"findings.rank{rank}.jsonl"
        findings = _read(fpath) if fpath.exists() else []
        assert not [f for f in findings if f["kind"] == "internal_error"], findings
    manifest = json.loads((run / "run.json").read_text())
    assert not manifest.get("exporter_drops"), manifest.get("exporter_drops")


# ---------------------------------------------------------------- two pipelines on one HashStore

MS = 1_000_000


def _ctx(rank):
    return RunContext(rank=rank, local_rank=rank, world_size=2, host="h", run_id="r", run_dir="/nonexistent")


def _raw(step, local, *, nonfinite=False):
    """A step whose probe saw sharded grads: ``local`` is (sum of squares of this rank's shards,
    norm of the replicated grads)."""
    vals = torch.tensor([float("nan") if nonfinite else local[0], local[1]])
    pend = PendingGradNorm(vals, sharded=True, optimizer_id=1)
    return RawStep(step, 0, 10 * MS, 0, 3 * MS, 4 * MS, 2 * MS, 0, 0, {}, {}, False, None, {"grad_norm": [pend]}, False)


class _Rank:
    def __init__(self, store, rank, **kw):
        self.out = InMemoryExporter()
        self.p = Pipeline(_ctx(rank), sinks=lambda: [ExporterSpec("records", lambda: self.out, inline=True)])
        self.p.add_enricher(GradNormEnricher(StoreNormExchange(store, rank, 2, **kw)))

    def feed(self, steps, value):
        for s in steps:
            self.p.enqueue(_raw(s, value(s)))

    def norms(self):
        return [(r.step, r.grad_norm) for r in self.out.records]


def _sq(rank):
    return lambda s: ((1.0 + s % 7) * (rank + 1), 0.5)


def _want(s):
    return math.sqrt(_sq(0)(s)[0] + _sq(1)(s)[0] + 0.25)


def test_every_ready_record_is_published_and_released_in_a_pass_or_two():
    """200 records on each rank, two passes each (alternating, as two ranks' threads run): every
    record out, each with the global norm. At one record per pass this took 200 passes."""
    store = torch.distributed.HashStore()
    r0, r1 = _Rank(store, 0), _Rank(store, 1)
    r0.feed(range(200), _sq(0))
    r1.feed(range(200), _sq(1))
    for _ in range(2):
        r0.p.run_pass()
        r1.p.run_pass()
    r0.p.run_pass()
    for r in (r0, r1):
        got = r.norms()
        assert [s for s, _ in got] == list(range(200))
        assert all(n is not None and math.isclose(n, _want(s), rel_tol=1e-6) for s, n in got), got[:5]
    # the next records, while none waits: the same
    r0.feed(range(200, 260), _sq(0))
    r1.feed(range(200, 260), _sq(1))
    for _ in range(2):
        r1.p.run_pass()
        r0.p.run_pass()
    r1.p.run_pass()
    for r in (r0, r1):
        assert [s for s, _ in r.norms()] == list(range(260))
        assert all(math.isclose(n, _want(s), rel_tol=1e-6) for s, n in r.norms())


def test_more_records_than_the_store_slots_wait_their_turn_and_none_is_lost():
    """The store keeps ``slots`` steps per rank: a rank publishes no further ahead of its oldest
    unresolved step than that (a slot is reused only once its step is read), so a burst far
    longer than the ring still comes out whole and right, over a few passes."""
    store = torch.distributed.HashStore()
    r0, r1 = _Rank(store, 0, slots=16), _Rank(store, 1, slots=16)
    r0.feed(range(100), _sq(0))
    r1.feed(range(100), _sq(1))
    for _ in range(30):
        r0.p.run_pass()
        r1.p.run_pass()
        if len(r0.out.records) == len(r1.out.records) == 100:
            break
    for r in (r0, r1):
        got = r.norms()
        assert [s for s, _ in got] == list(range(100))
        assert all(n is not None and math.isclose(n, _want(s), rel_tol=1e-6) for s, n in got), got[:5]


def test_a_peer_that_never_answers_costs_its_records_the_hold_bound_only(monkeypatch):
    """Rank 1 never publishes: rank 0's records leave once held longer than ``_MAX_HOLD_S`` (made
    short here), in order, with ``grad_norm`` null (unknown, never the partial value)."""
    monkeypatch.setattr(pipeline_mod, "_MAX_HOLD_S", 0.3)
    store = torch.distributed.HashStore()
    r0 = _Rank(store, 0)
    r0.feed(range(5), _sq(0))
    r0.p.run_pass()
    r0.p.run_pass()
    assert r0.out.records == []
    time.sleep(0.35)
    r0.p.run_pass()
    assert r0.norms() == [(s, None) for s in range(5)]


def test_a_non_finite_shard_on_one_rank_reaches_the_other_at_once():
    """Rank 0's grads are NaN at step 3: rank 0 says NaN without waiting, and still publishes, so
    rank 1 gets the (NaN) global norm in the next pass instead of waiting 30 s, and step 4 after
    it is not held either."""
    store = torch.distributed.HashStore()
    r0, r1 = _Rank(store, 0), _Rank(store, 1)
    for s in range(6):
        r0.p.enqueue(_raw(s, _sq(0)(s), nonfinite=s == 3))
        r1.p.enqueue(_raw(s, _sq(1)(s)))
    for _ in range(2):
        r0.p.run_pass()
        r1.p.run_pass()
    r0.p.run_pass()
    for r in (r0, r1):
        got = dict(r.norms())
        assert sorted(got) == list(range(6))
        assert math.isnan(got[3])
        assert all(math.isclose(got[s], _want(s), rel_tol=1e-6) for s in (0, 1, 2, 4, 5))


def test_the_last_records_before_shutdown_get_their_norm():
    """Both ranks shut down right after their last steps (no pass between): the final pass
    publishes them and waits, bounded, for the other rank; nothing is left null."""
    store = torch.distributed.HashStore()
    r0, r1 = _Rank(store, 0), _Rank(store, 1)
    r0.feed(range(30), _sq(0))
    r1.feed(range(30), _sq(1))
    t = threading.Thread(target=r1.p.shutdown, args=(3.0,))
    t.start()
    r0.p.shutdown(3.0)
    t.join(5)
    for r in (r0, r1):
        got = r.norms()
        assert [s for s, _ in got] == list(range(30))
        assert all(n is not None and math.isclose(n, _want(s), rel_tol=1e-6) for s, n in got), got


def test_rank0_gone_before_combining_the_last_steps_rank1_combines_them_at_shutdown():
    """Rank 0 published its values and exited before its pipeline combined them (no global norm
    in the store): rank 1's final pass waits its bounded while, then combines every rank's values
    itself rather than leave its last records null."""
    store = torch.distributed.HashStore()
    ex0 = StoreNormExchange(store, 0, 2)
    for s in range(10):
        ex0.publish(s, _sq(0)(s))
    r1 = _Rank(store, 1)
    r1.feed(range(10), _sq(1))
    t0 = time.monotonic()
    r1.p.shutdown(3.0)
    assert time.monotonic() - t0 < 2.0
    got = r1.norms()
    assert [s for s, _ in got] == list(range(10))
    assert all(n is not None and math.isclose(n, _want(s), rel_tol=1e-6) for s, n in got), got


class _GoneStore:
    """A store whose host process has exited: every call raises as TCPStore's client does."""

    def __getattr__(self, name):
        def call(*a, **k):
            raise torch.distributed.DistNetworkError("Broken pipe")

        return call


def test_a_store_that_fails_ends_the_exchange_quietly(caplog):
    """The store's host gone (a job whose rank 0 hosted it and exited first): records leave with
    grad_norm null, at once, one warning, and no internal error (the enricher is not disabled:
    plain norms would still be filled)."""
    r1 = _Rank(_GoneStore(), 1)
    r1.feed(range(5), _sq(1))
    with caplog.at_level("WARNING"):
        r1.p.run_pass()
        r1.p.run_pass()
    assert r1.norms() == [(s, None) for s in range(5)]
    assert not r1.p.failures.counts and not [f for f in r1.out.findings if f.kind == "internal_error"]
    assert len([r for r in caplog.records if "grad-norm exchange" in r.getMessage()]) == 1

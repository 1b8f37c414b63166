#!/usr/bin/env python3
"""GPU check of a whole stepwatch session on a real CUDA device; called by scripts/gpu_check.sh.

    python scripts/gpu_check_session.py [--json out.json]

A small token model trains for 30 steps on cuda:0 with stepwatch on (the native extension built
from the current sources), with no host-device sync anywhere in the loop. Checks:

1. no sync: steps 5-24 run under ``torch.cuda.set_sync_debug_mode("error")``, so any sync made
   by stepwatch's hooks on the training thread raises inside them, which stepwatch records as an
   internal error: there must be none;
2. device clock: records from the second on say ``clock: "device"`` with forward, backward and
   optimizer times from device events, and the phase identity holds;
3. the values read back off the training thread without a sync are right: ``grad_norm`` equals
   ``torch.nn.utils.get_total_norm`` of the same grads (the probe's own computation in steps
   without clipping, the reused clip norm in steps with it), ``scalars.loss`` the logged CUDA loss,
   ``tokens`` the attention mask's sum (from step 1: step 0's forward runs before the root
   modules are found, as without a DataLoader anywhere);
4. the run manifest names the native CUDA timing backend;
5. memory, read at every step end (``memory_every=1``) with no sync (check 1 covers steps 5-24):
   each record's ``mem_allocated_bytes`` equals ``torch.cuda.memory_allocated()`` read by the loop
   at the same point, reserved >= peak >= allocated, and the host RSS is known;
6. OOM forensics on a real CUDA OOM: a forward that asks for more than the device has raises
   ``torch.OutOfMemoryError`` unchanged, and ``oom-1/`` holds report.json (the requested size parsed
   from the allocator's message), memory_stats.json, memory_summary.txt and a memory_snapshot.pickle
   with an allocation trace (``memory_history="on"``);
7. measured, not checked: one memory read's cost on the training thread, and the allocation
   history's cost per step (the same loop with and without ``_record_memory_history``).

Exit status: 0 all checks passed, 1 a check failed, 2 could not run (no GPU, no compiler).
``--cpu`` runs the same loop on the CPU without the device-only checks (1, 2, 4, 6, 7; 5 checks the host RSS only): a rehearsal of
this script where there is no GPU, so a device lease is not spent on the script's own bugs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))

STEPS = 30
SYNC_CHECKED = range(5, 25)  # steps run under set_sync_debug_mode("error")
CLIP_FROM = 15  # steps from here on clip (the probe reuses clip_grad_norm_'s norm)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="stepwatch session GPU check")
    ap.add_argument("--json", help="also write the observations here")
    ap.add_argument("--cpu", action="store_true", help="rehearse on the CPU (device-only checks skipped)")
    args = ap.parse_args(argv)

    import torch
    import torch.nn as nn

    gpu = not args.cpu
    dev = "cuda" if gpu else "cpu"
    if gpu and not torch.cuda.is_available():
        print("gpu_check_session: SKIP: torch.cuda.is_available() is False")
        return 2
    from stepwatch.cuda_ext import _testing

    try:
        _testing.install_native(_testing.build_native(tempfile.mkdtemp(prefix="sw-native-")))
    except RuntimeError as exc:
        print(f"gpu_check_session: cannot build the extension here: {exc}")
        return 2
    import stepwatch

    if gpu:
        torch.cuda.set_device(0)
    torch.manual_seed(0)
    vocab, seq, batch, width = 512, 64, 8, 256
    model = nn.Sequential(nn.Embedding(vocab, width), nn.Linear(width, width), nn.GELU(),
                          nn.Linear(width, vocab)).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = []
    for i in range(STEPS):  # on the device up front: the loop itself must not sync
        ids = torch.randint(0, vocab, (batch, seq), device=dev)
        mask = torch.ones(batch, seq, dtype=torch.long, device=dev)
        mask[:, seq - 1 - i % 7:] = 0  # some padding, a different amount each step
        batches.append({"input_ids": ids, "attention_mask": mask})

    class TokenModel(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, attention_mask):
            logits = self.inner(input_ids)
            loss = nn.functional.cross_entropy(logits.flatten(0, 1), input_ids.flatten(), reduction="none")
            return (loss * attention_mask.flatten()).sum() / attention_mask.sum()

    lm = TokenModel(model)

    class Greedy(nn.Module):
        """Asks for more than the device has (check 6); made before training so it is a hooked root."""

        def forward(self, x):
            free, total = torch.cuda.mem_get_info()
            return torch.empty(total + (1 << 30), dtype=torch.uint8, device=x.device)

    greedy = Greedy()
    greedy_in = torch.zeros(1, device=dev)  # allocated before the loop: check 5 compares every step
    run = tempfile.mkdtemp(prefix="sw-run-")
    mem = stepwatch.InMemoryExporter()
    stepwatch.init(dir=run, console="off", watchdog="off", capture="off", gpu_telemetry=False,
                   exporters=[mem], flush_interval_s=0.05, memory_every=1,
                   memory_history="on" if gpu else "off")
    losses, norms, allocated = [], [], []
    for step, b in enumerate(batches):
        if gpu and step == SYNC_CHECKED.start:
            torch.cuda.set_sync_debug_mode("error")
        if gpu and step == SYNC_CHECKED.stop:
            torch.cuda.set_sync_debug_mode("default")
        loss = lm(**b)
        loss.backward()
        params = [p for p in model.parameters() if p.grad is not None]
        if step >= CLIP_FROM:
            norms.append(torch.nn.utils.clip_grad_norm_(params, 1.0))
        else:
            norms.append(torch.nn.utils.get_total_norm([p.grad for p in params]))
        opt.step()
        opt.zero_grad()
        stepwatch.log(loss=loss.detach())
        losses.append(loss.detach())
        # what stepwatch reads at this step's end (the next forward): nothing allocates in between
        allocated.append(torch.cuda.memory_allocated() if gpu else None)
    if gpu:
        torch.cuda.set_sync_debug_mode("default")
    oom_seen = None
    if gpu:
        try:
            greedy(greedy_in)
        except torch.OutOfMemoryError as e:
            oom_seen = e
    stepwatch.shutdown()
    if gpu:
        torch.cuda.synchronize()

    recs = {r.step: r for r in mem.records}
    findings = [f for f in mem.findings if f.kind == "internal_error"]
    failures: list[str] = []
    if findings:
        failures.append(f"internal errors (a sync raises inside stepwatch's hooks): {[f.summary for f in findings]}")
    if sorted(recs) != list(range(STEPS)):
        failures.append(f"records for steps {sorted(recs)}, expected 0..{STEPS - 1}")
    rows = []
    for step in range(STEPS):
        r = recs.get(step)
        if r is None:
            continue
        want_norm = float(norms[step])
        want_loss = float(losses[step])
        want_tokens = int(batches[step]["attention_mask"].sum())
        row = {"step": step, "clock": r.clock, "forward_s": r.forward_s, "backward_s": r.backward_s,
               "optimizer_s": r.optimizer_s, "step_s": r.step_s, "grad_norm": r.grad_norm, "want_norm": want_norm,
               "loss": r.scalars.get("loss"), "want_loss": want_loss, "tokens": r.tokens, "want_tokens": want_tokens}
        rows.append(row)
        if gpu and step >= 1 and r.clock != "device":
            failures.append(f"step {step}: clock {r.clock!r}, expected 'device'")
        if gpu and step >= 1 and not (r.forward_s > 0 and r.backward_s > 0 and r.optimizer_s > 0):
            failures.append(f"step {step}: device phases {r.forward_s}, {r.backward_s}, {r.optimizer_s}")
        parts = r.data_wait_s + r.forward_s + r.backward_s + r.optimizer_s + r.other_s
        if not math.isclose(parts, r.step_s, rel_tol=1e-6, abs_tol=1e-9):
            failures.append(f"step {step}: phases add to {parts}, step_s {r.step_s}")
        if r.grad_norm is None or not math.isclose(r.grad_norm, want_norm, rel_tol=1e-4):
            failures.append(f"step {step}: grad_norm {r.grad_norm}, torch says {want_norm}")
        if r.scalars.get("loss") is None or not math.isclose(r.scalars["loss"], want_loss, rel_tol=1e-6):
            failures.append(f"step {step}: logged loss {r.scalars.get('loss')}, the tensor held {want_loss}")
        # step 0's forward runs before the root modules are found (no DataLoader here: README)
        if step >= 1 and r.tokens != want_tokens:
            failures.append(f"step {step}: tokens {r.tokens}, mask sum {want_tokens}")
        if gpu and r.mem_allocated_bytes != allocated[step]:
            failures.append(f"step {step}: mem_allocated_bytes {r.mem_allocated_bytes}, torch says {allocated[step]}")
        if gpu and not (r.mem_reserved_bytes or 0) >= (r.mem_peak_bytes or 0) >= (r.mem_allocated_bytes or 1) > 0:
            failures.append(f"step {step}: reserved {r.mem_reserved_bytes} >= peak {r.mem_peak_bytes} >= "
                            f"allocated {r.mem_allocated_bytes} > 0 does not hold")
        if not r.host_rss_bytes:
            failures.append(f"step {step}: host_rss_bytes {r.host_rss_bytes}")
        row.update(mem_allocated=r.mem_allocated_bytes, mem_peak=r.mem_peak_bytes, host_rss=r.host_rss_bytes)
    if gpu:
        failures += _check_oom(run, oom_seen)
        _measure_memory_costs(torch, lm, batches)
    with open(os.path.join(run, "run.json"), encoding="utf-8") as f:
        backend = json.load(f).get("features", {}).get("timing_backend")
    if gpu and backend != "native cuda":
        failures.append(f"run.json timing_backend {backend!r}, expected 'native cuda'")
    for row in rows[:3] + rows[-2:]:
        print("  ", {k: (round(v, 6) if isinstance(v, float) else v) for k, v in row.items()})
    print(f"timing backend: {backend}; records: {len(recs)}; internal errors: {len(findings)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "backend": backend, "failures": failures}, f, indent=2, default=str)
    print("gpu_check_session: " + ("PASS" if not failures else "FAIL:\n  " + "\n  ".join(failures[:20])))
    return 0 if not failures else 1


def _check_oom(run: str, exc) -> list[str]:
    import pickle

    if exc is None:
        return ["no torch.OutOfMemoryError from a forward asking for more than the device has"]
    out = []
    d = os.path.join(run, "oom-1")
    for name in ("report.json", "memory_stats.json", "memory_summary.txt", "memory_snapshot.pickle"):
        if not os.path.exists(os.path.join(d, name)):
            out.append(f"oom-1/{name} missing")
    if out:
        return out
    with open(os.path.join(d, "report.json"), encoding="utf-8") as f:
        rep = json.load(f)
    from stepwatch.memory.oom import requested_bytes

    if rep["phase"] != "forward" or rep["requested_bytes"] != requested_bytes(str(exc)) or not rep["requested_bytes"]:
        out.append(f"oom-1/report.json: phase {rep['phase']}, requested {rep['requested_bytes']} ({str(exc)[:120]})")
    with open(os.path.join(d, "memory_snapshot.pickle"), "rb") as f:
        snap = pickle.load(f)
    if not any(snap.get("device_traces") or []):
        out.append("memory_snapshot.pickle has no allocation trace (history was on)")
    print(f"oom-1: {sorted(os.listdir(d))}; requested {rep['requested_bytes']}")
    return out


def _measure_memory_costs(torch, lm, batches) -> None:
    import time

    from stepwatch.memory.probe import MemoryProbe

    p = MemoryProbe(every=1)
    p.take()
    t = time.perf_counter_ns()
    for _ in range(1000):
        p.take()
    print(f"memory read (rss + allocator stats + peak reset): {(time.perf_counter_ns() - t) / 1000 / 1e3:.1f} us")

    def block(n: int = 30) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for b in batches[:n]:
            lm(**b).backward()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / n

    torch.cuda.memory._record_memory_history(enabled=None)
    off = [block() for _ in range(3)]
    torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="python", max_entries=20000)
    on = [block() for _ in range(3)]
    torch.cuda.memory._record_memory_history(enabled=None)
    print(f"allocation history: {min(off) * 1e3:.3f} ms/step off, {min(on) * 1e3:.3f} ms/step on "
          f"({min(on) / min(off):.2f}x)")


if __name__ == "__main__":
    sys.exit(main())

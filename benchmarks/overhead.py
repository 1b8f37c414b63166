"""stepwatch's cost on the training thread, per feature, measured side by side in one run.

    python benchmarks/overhead.py [--blocks 10] [--steps 120] [--sizes 0.5,2,20] [--crossings 40]

Three tables, all from one process (four with ``--crossings``), the training thread pinned to one
CPU and stepwatch's threads to the others (``--cpu``):

1. In the loop (the figure a user sees). The same CPU training loop (DataLoader -> model -> loss
   module -> backward -> AdamW) runs in >= 10 interleaved blocks: stepwatch off, then each
   variant below, every block, for three step sizes (~0.5, ~2, ~20 ms). Each variant's figure is
   the training thread's own CPU time per step (``time.thread_time``: immune to other processes on
   the machine; the background thread's GIL hand-offs still show) minus the mean of the two off
   blocks run just before and just after it (a drift of the machine's speed across the three
   blocks cancels; a reference a whole round earlier did not), as the median over rounds with its
   inter-quartile range. Variants are cumulative (each
   adds one feature to the previous) and alone (the foundation plus that one feature). A
   ``floor`` row is stepwatch off with the loop computing ``vector_norm(stack(_foreach_norm))``
   itself: the grad-norm floor as the loop pays it (the loop target is 40 us + that). An
   ``off again`` row is stepwatch off against its two off neighbours, the same way: the machine's own
   spread, the resolution of every other row (a figure inside it is not resolved). Then the
   cyclic GC's collections on the training thread per 1000 steps and the time spent in them.
2. Hot, in isolation, the training thread alone: the pipeline's thread is paused while these
   are timed (a record per few microseconds would keep it busy all the time, and its GIL
   hand-offs would be counted here and again in table 3; table 1 measures the two together).
   The foundation's hook sequence of one step against an empty loop; a root
   forward with and without FLOPs/tokens counting; the grad-norm probe against its floor
   (``vector_norm(stack(_foreach_norm(grads)))`` and bare ``_foreach_norm``, timed in this run);
   a whole tiny step with all defaults against 20 us + the floor in that step.
3. The background thread's cost per record, with a realistic queue (the default size, drained as
   in a job, not tens of thousands of records held for the cyclic GC to walk).
4. ``--crossings BLOCKS``: what multiplies the hot cost in the loop. The ~0.5 ms loop with the
   foundation on, and with each of its hook crossings taken out of the running session (the
   DataLoader fetch, the backward, the root calls, the loop's ``stepwatch.log``; all four),
   interleaved: each crossing's in-loop cost is the difference.

The budget (issue 16): hot foundation <= 10 us; all defaults <= 20 us + the grad-norm floor; the
probe within 1.2x of its floor; FLOPs/tokens <= 2 us per root forward; background <= 10 us per
record; in the ~0.5 ms loop all defaults <= 40 us + the grad-norm floor. Each line says whether
its target is met, as measured.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import stepwatch  # noqa: E402

import gc  # noqa: E402
import logging  # noqa: E402
import threading  # noqa: E402

logging.disable(logging.WARNING)  # "no peak TFLOP/s known" once per block, "GPU telemetry off"

SIZES = {"0.5": ("~0.5 ms", 8, 4), "2": ("~2 ms", 256, 64), "20": ("~20 ms", 768, 192)}
FLOOR = "floor (off, loop norms)"  # stepwatch off; the loop computes vector_norm(stack(_foreach_norm))
# Stepwatch off again, against the off blocks on either side: what the machine alone moves a
# difference by. A figure inside this row's spread is not resolved by this run.
OFF_AGAIN = "off again (noise)"
NO_GRAD_NORM = 1_000_000  # grad_norm_every: probe once, then never (FLOPs/tokens without grad-norm); the config maximum

# The foundation: step/phase timing, the records file, the detectors; nothing optional.
FOUNDATION = dict(training_metrics=False, comm=False, gpu_telemetry=False, nvtx=False, memory=False,
                  watchdog="off", capture="off", otel=False)
# Each optional feature as the settings it adds on top of the foundation.
FEATURES = [
    ("nvtx", dict(nvtx=True)),
    ("flops+tokens", dict(training_metrics=True, grad_norm_every=NO_GRAD_NORM)),
    ("grad-norm", dict(training_metrics=True, grad_norm_every=1)),
    ("comm", dict(comm=True)),
    ("gpu telemetry", dict(gpu_telemetry=True)),
    ("memory", dict(memory=True)),  # read every 10 steps (STEPWATCH_MEMORY_EVERY), its default
]


def variants() -> list[tuple[str, dict]]:
    out = [("foundation", dict(FOUNDATION))]
    acc = dict(FOUNDATION)
    for name, extra in FEATURES:
        acc = {**acc, **extra}
        out.append((f"+ {name}", dict(acc)))
    for name, extra in FEATURES:
        if name == "grad-norm":  # grad-norm alone still needs training_metrics: same as cumulative
            extra = dict(training_metrics=True, grad_norm_every=1)
        out.append((f"{name} alone", {**FOUNDATION, **extra}))
    return out


def train_step(model, lossf, opt, params, x, y, norm: bool = False):
    """One step of the benchmark's loop; ``norm``: the loop computes the grad-norm floor itself."""
    loss = lossf(model(x), y)
    loss.backward()
    if norm:
        torch.linalg.vector_norm(torch.stack(torch._foreach_norm([p.grad for p in params], 2.0)), 2.0)
    opt.step()
    opt.zero_grad()
    stepwatch.log(loss=loss)
    return loss


def make_loop(width: int, batch: int, steps: int):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, width))
    lossf = nn.MSELoss()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rows = batch * 4
    data = TensorDataset(torch.randn(rows, width), torch.randn(rows, width))
    order = [i % rows for i in range(batch * steps)]  # many steps over a small dataset

    params = list(model.parameters())

    def run_block(norm: bool = False) -> float:
        """The training thread's CPU time per step, in seconds (after 5 warm-up steps).
        ``norm``: the loop computes the grad-norm floor itself (stepwatch off): what the floor
        costs in the loop, beside its hot cost."""
        cpu0, n = 0, 0
        for i, (x, y) in enumerate(DataLoader(data, batch_size=batch, sampler=order)):
            if i == 5:  # the block's first steps include discovery and warm-up
                others_elsewhere()
                cpu0 = time.thread_time_ns()
                GC.start()
            train_step(model, lossf, opt, params, x, y, norm)
            n = i
        t = (time.thread_time_ns() - cpu0) / 1e9 / (n - 4)
        GC.stop(n - 4)
        return t

    return run_block, model


class _GcCount:
    """Cyclic GC collections on the training thread during a block, per generation (gc.callbacks),
    and their time: whether stepwatch's allocations make the collector run more often."""

    def __init__(self) -> None:
        self.on = False
        self.n = [0, 0, 0]
        self.ns = 0
        self._t0 = 0
        self.last: tuple[list[float], float] = ([0.0, 0.0, 0.0], 0.0)
        self.tid = threading.get_ident()
        gc.callbacks.append(self._cb)

    def _cb(self, phase: str, info: dict) -> None:
        if not self.on or threading.get_ident() != self.tid:
            return
        if phase == "start":
            self._t0 = time.perf_counter_ns()
        else:
            self.n[info["generation"]] += 1
            self.ns += time.perf_counter_ns() - self._t0

    def start(self) -> None:
        self.n, self.ns, self.on = [0, 0, 0], 0, True

    def stop(self, steps: int) -> None:
        self.on = False
        self.last = ([1000 * c / steps for c in self.n], self.ns / 1e3 / steps)


GC = _GcCount()
ROUNDS = 5  # interleaved rounds of the hot comparisons
LOOP_IQR: dict[str, float] = {}
NOISE_IQR: dict[str, float] = {}


def _q(xs: list[float]) -> tuple[float, float]:
    """(median, inter-quartile range)."""
    if len(xs) < 4:
        return statistics.median(xs), float("nan")
    q = statistics.quantiles(xs, n=4)
    return statistics.median(xs), q[2] - q[0]


def in_the_loop(blocks: int, steps: int, sizes: list[str], run_dir: str) -> dict[str, dict[str, float]]:
    vs = variants()
    print("1. In the loop: training-thread CPU us added per step (median over blocks [IQR]); off = us per step")
    head = f"{'variant':>22}" + "".join(f" {SIZES[s][0]:>20}" for s in sizes)
    print(head)
    table: dict[str, dict[str, tuple[float, float]]] = {name: {} for name, _ in vs}
    offs: dict[str, tuple[float, float]] = {}
    gc_table: dict[str, dict[str, tuple[list[float], float]]] = {}
    for s in sizes:
        _, width, batch = SIZES[s]
        run_block, _ = make_loop(width, batch, steps)
        run_block()  # warm torch up
        added: dict[str, list[float]] = {name: [] for name, _ in vs}
        added[FLOOR] = []
        added[OFF_AGAIN] = []
        gcs: dict[str, list[tuple[list[float], float]]] = {name: [] for name, _ in vs}
        gcs["off"] = []
        off_all = []
        for i in range(blocks):  # interleaved: each round runs every variant, each between two off blocks
            before = run_block()
            off_all.append(before)
            gcs["off"].append(GC.last)
            for name, cfg in [(FLOOR, None), (OFF_AGAIN, None)] + vs:
                if name == FLOOR:
                    on = run_block(norm=True)
                elif name == OFF_AGAIN:
                    on = run_block()
                else:
                    stepwatch.init(dir=os.path.join(run_dir, f"{s}-{i}-{name.replace(' ', '_')}"), console="off", **cfg)
                    on = run_block()
                    gcs[name].append(GC.last)
                    stepwatch.shutdown()
                after = run_block()
                # against the mean of the off blocks on either side: the machine drifts by up to
                # 1.8x within seconds (benchmarks/results/cpu-2026-12-05-s27/noise.txt); a reference
                # a block away on each side cancels a linear drift, one 15 blocks earlier does not
                added[name].append(on - (before + after) / 2)
                before = after
        offs[s] = _q([x * 1e6 for x in off_all])
        for name in added:
            table.setdefault(name, {})[s] = _q([x * 1e6 for x in added[name]])
        gc_table[s] = {
            name: ([statistics.median(g[0][k] for g in v) for k in range(3)], statistics.median(g[1] for g in v))
            for name, v in gcs.items()
        }
    print(f"{'off (us/step)':>22}" + "".join(f" {offs[s][0]:10.1f} [{offs[s][1]:6.1f}]" for s in sizes))
    for name in [OFF_AGAIN, FLOOR] + [n for n, _ in vs]:
        print(f"{name:>22}" + "".join(f" {table[name][s][0]:10.1f} [{table[name][s][1]:6.1f}]" for s in sizes))
    print("\n   cyclic GC on the training thread: collections per 1000 steps (gen0/gen1/gen2), us per step in them")
    for s in sizes:
        for name in ("off", "foundation", f"+ {FEATURES[-1][0]}"):
            n, us = gc_table[s][name]
            print(f"{SIZES[s][0]:>9} {name:>18}   {n[0]:6.1f} /{n[1]:5.1f} /{n[2]:5.1f}   {us:6.2f} us/step")
    for s in sizes:
        LOOP_IQR[s] = table[f"+ {FEATURES[-1][0]}"][s][1]
        NOISE_IQR[s] = table[OFF_AGAIN][s][1]
    return {name: {s: table[name][s][0] for s in sizes} for name in table}


# The foundation's hook crossings in the loop that can be taken out one at a time without
# changing where a step ends (the optimizer's hooks stay): each as the code that takes it out of
# a running session (its wrapper's original put back, the root calls unwrapped, the loop's
# stepwatch.log skipped). The session's shutdown still restores everything it patched.
def _without_data(session, model) -> None:
    it = torch.utils.data.dataloader._BaseDataLoaderIter
    it.__next__ = it.__next__.__wrapped__


def _without_backward(session, model) -> None:
    torch.autograd.backward = torch.autograd.backward.__wrapped__


def _without_roots(session, model) -> None:
    for m in session.hub._inst._hooked:
        m.__dict__.pop("_compiled_call_impl", None)


class _NoLog:
    @staticmethod
    def log(**scalars) -> None:
        return None


CROSSINGS = [("DataLoader fetch", (_without_data,)), ("backward", (_without_backward,)),
             ("root calls (model, loss)", (_without_roots,)), ("stepwatch.log", ("nolog",)),
             ("all four", (_without_data, _without_backward, _without_roots, "nolog"))]


def crossings(blocks: int, steps: int, run_dir: str) -> None:
    """Table 4 (``--crossings``): what multiplies the hot cost in the loop. The ~0.5 ms loop with
    the foundation on, and with each of its hook crossings taken out, interleaved: a crossing's
    in-loop cost is the difference. Hot, the whole hook sequence of a step is a few us (table 2);
    in the loop each crossing costs about that on its own, whatever little it does: the loop's
    own work (torch, the DataLoader) has evicted stepwatch's code and data from the caches by the
    time the next hook runs."""
    global stepwatch
    print(f"\n4. The foundation's hook crossings in the ~0.5 ms loop ({blocks} interleaved blocks of {steps} steps):"
          " training-thread us a step each costs, as the foundation less the loop without it")
    _, width, batch = SIZES["0.5"]
    run_block, model = make_loop(width, batch, steps)
    run_block()
    names = ["foundation"] + [n for n, _ in CROSSINGS]
    added: dict[str, list[float]] = {n: [] for n in names}
    real = stepwatch
    for i in range(blocks):
        before = run_block()
        for name in names:
            s = real.init(dir=os.path.join(run_dir, f"x-{i}-{names.index(name)}"), console="off", **FOUNDATION)
            run_block()  # roots found, FLOP-free warm-up: every wrapper in place
            for cut in dict(CROSSINGS).get(name, ()):
                if cut == "nolog":
                    stepwatch = _NoLog  # train_step's global
                else:
                    cut(s, model)
            try:
                on = run_block()
            finally:
                stepwatch = real
                real.shutdown()
            after = run_block()
            added[name].append(on - (before + after) / 2)  # between two off blocks, as table 1
            before = after
    found, found_iqr = _q([x * 1e6 for x in added["foundation"]])
    print(f"  {'foundation, all crossings':>28} {found:7.1f} us [IQR {found_iqr:5.1f}]")
    for name, _ in CROSSINGS:
        without, iqr = _q([x * 1e6 for x in added[name]])
        print(f"  {'less ' + name:>28} {without:7.1f} us [IQR {iqr:5.1f}]   = {found - without:5.1f} us in the loop")


def _timed(fn, n: int, reps: int = 5) -> float:
    """Best-of-reps training-thread CPU ns per call."""
    best = float("inf")
    for _ in range(reps):
        t = time.thread_time_ns()
        for _ in range(n):
            fn()
        best = min(best, (time.thread_time_ns() - t) / n)
    return best


def hook_sequence(tr):
    """What the hooks call on the training thread in one step of the loop above: a fetch, two root
    forwards (model, loss module), a backward, an optimizer step and a log()."""
    loss = torch.ones(())

    def one_step() -> None:
        t0 = tr.data_begin()
        tr.data_end(t0)
        tr.forward_begin(True)
        tr.forward_end()
        tr.forward_begin(True)  # the loss module
        tr.forward_end()
        tr.backward_begin()
        tr.backward_end()
        tr.optimizer_begin()
        tr.optimizer_end()
        stepwatch.log(loss=loss)

    return one_step


def _paused(session, fn):
    """``fn`` with the session's pipeline thread stopped: records wait in its queue, emptied
    every 2048 (in the timed call, and in the baseline's, so the two cancel out)."""
    session.pipeline.stop_thread()
    q = session.pipeline._queue

    def call() -> None:
        fn()
        if len(q) > 2048:
            q.clear()

    return call


def hot(run_dir: str, n: int) -> dict[str, float]:
    out: dict[str, float] = {}
    print(f"\n2. Hot, in isolation (training-thread CPU time, best of {ROUNDS} interleaved rounds; pipeline thread paused)")
    # Foundation: the hook sequence of one step.
    s = stepwatch.init(dir=os.path.join(run_dir, "hot-foundation"), console="off", **FOUNDATION)
    one_step = hook_sequence(s.tracker)
    for _ in range(2000):
        one_step()
    q = s.pipeline._queue
    paused = _paused(s, one_step)
    base = cost = float("inf")
    for _ in range(ROUNDS):  # interleaved rounds, the best of each
        base = min(base, _timed(lambda: len(q) > 2048, n, reps=1))
        cost = min(cost, _timed(paused, n, reps=1))
    stepwatch.shutdown()
    out["foundation"] = (cost - base) / 1e3
    print(f"  foundation hook sequence per step     {out['foundation']:8.2f} us   (target <= 10)"
          f"   {'met' if out['foundation'] <= 10 else 'NOT met'}")

    # A root forward: plain, then under stepwatch without and with FLOPs/tokens counting.
    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    x = torch.randn(4, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)

    def warm_step() -> None:  # roots are found at the first backward; the FLOP replay runs once
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()

    def fwd() -> None:
        model(x)

    # Interleaved rounds, the best of each variant over them: a drift in the machine's speed
    # (other processes, the clock) would otherwise land in the difference of two timings.
    best: dict[str, float] = collections.defaultdict(lambda: float("inf"))
    for r in range(ROUNDS):
        best["plain"] = min(best["plain"], _timed(fwd, n, reps=1))
        for label, cfg in (("no counting", FOUNDATION), ("flops+tokens", {**FOUNDATION, **FEATURES[1][1]})):
            sess = stepwatch.init(dir=os.path.join(run_dir, f"hot-fwd-{label.replace(' ', '_')}-{r}"), console="off",
                                  **cfg)
            for _ in range(3):
                warm_step()
            end = sess.tracker.end_step

            def fwd_step() -> None:  # one root forward per step: the step's counts are handed over
                model(x)
                end()

            best[label] = min(best[label], _timed(_paused(sess, fwd_step), n, reps=1))
            # What the feature itself adds per root forward, timed alone (the difference of two
            # whole-forward timings above moves by 10-20 us between sessions here): the forward
            # observers as the root call runs them, and the step's hand-over. The same calls on
            # the foundation (no observer, no collector) are the harness's own cost, taken off.
            inst, tr = sess.instrumentation, sess.tracker
            takes = [c.take for c in tr.collectors]
            args, kwargs = (x,), {}

            def own() -> None:
                tr.work_begins()
                inst._observe_forward(model, args, kwargs)
                for take in takes:
                    take()

            best[f"own {label}"] = min(best[f"own {label}"], _timed(own, n, reps=1))
            stepwatch.shutdown()
    per_fwd = {label: best[label] - best["plain"] for label in ("no counting", "flops+tokens")}
    out["flops_tokens_per_forward"] = (per_fwd["flops+tokens"] - per_fwd["no counting"]) / 1e3
    print(f"  root forward + step end (foundation)  {per_fwd['no counting'] / 1e3:8.2f} us per forward")
    print(f"  FLOPs/tokens on top, per root forward {out['flops_tokens_per_forward']:8.2f} us   (target <= 2)"
          f"   {'met' if out['flops_tokens_per_forward'] <= 2 else 'NOT met'}")
    own = (best["own flops+tokens"] - best["own no counting"]) / 1e3
    out["flops_tokens_own"] = own
    print(f"  FLOPs/tokens, its own calls alone     {own:8.2f} us per root forward (observers + step hand-over,"
          f" less the same calls with none)   {'met' if own <= 2 else 'NOT met'}")

    # The grad-norm probe against its floor, on the ~2 ms model's gradients.
    _, width, batch = SIZES["2"]
    torch.manual_seed(0)
    m2 = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, width))
    m2(torch.randn(batch, width)).sum().backward()
    grads = [p.grad for p in m2.parameters()]
    s = stepwatch.init(dir=os.path.join(run_dir, "hot-gradnorm"), console="off",
                       **{**FOUNDATION, **FEATURES[2][1]})
    opt2 = torch.optim.SGD(m2.parameters(), lr=0.0)
    probe = _find_grad_norm(s)  # the collector: what the optimizer pre-hook calls
    bare = floor = cost = float("inf")
    for _ in range(ROUNDS):  # interleaved rounds, the best of each (see above)
        bare = min(bare, _timed(lambda: torch._foreach_norm(grads, 2.0), n // 4, reps=1))
        floor = min(floor, _timed(lambda: torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0)), 2.0),
                                  n // 4, reps=1))
        if probe is not None:
            cost = min(cost, _timed(lambda: probe.on_optimizer_step(opt2), n // 4, reps=1))
            probe.take()  # the round's pending norms, as the step's end takes them
    if probe is None:
        print("  grad-norm probe: not found on this session (skipped)")
    else:
        out["grad_norm_ratio"] = cost / floor
        print(f"  bare _foreach_norm                    {bare / 1e3:8.2f} us")
        print(f"  floor vector_norm(stack(_foreach_norm)) {floor / 1e3:6.2f} us")
        print(f"  stepwatch's probe (the pre-hook's call) {cost / 1e3:8.2f} us   = {cost / floor:.2f}x the floor"
              f" (target <= 1.2x)   {'met' if cost / floor <= 1.2 else 'NOT met'}")
    out["grad_norm_floor_us"] = floor / 1e3
    stepwatch.shutdown()
    memory_read_cost(n)
    all_defaults_hot(run_dir, n)
    return out


def tiny_step_parts():
    """The whole tiny step's model, loss module, optimizer, parameters and batch (a Linear, an
    MSELoss, SGD; ``instructions.py --tiny`` counts the same step)."""
    torch.manual_seed(0)
    model, lossf = nn.Linear(8, 8), nn.MSELoss()
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    return model, lossf, opt, list(model.parameters()), x, y


def all_defaults_hot(run_dir: str, n: int) -> None:
    """A whole tiny step (model and loss forward, backward, SGD step, log) timed hot, best of 5
    blocks, with stepwatch off, off plus the loop's own grad-norm floor, and all defaults on:
    all defaults' added cost against 20 us + that floor's."""
    model, lossf, opt, params, x, y = tiny_step_parts()
    loss_box = [None]

    def step(norm: bool = False) -> None:
        loss_box[0] = train_step(model, lossf, opt, params, x, y, norm)

    m = max(n // 10, 200)
    name, cfg = variants()[len(FEATURES)]  # "+ memory": every feature, cumulative
    best: dict[str, float] = collections.defaultdict(lambda: float("inf"))
    each: dict[str, list[int]] = collections.defaultdict(list)
    for r in range(ROUNDS):  # interleaved rounds, the best of each (see hot())
        best["off"] = min(best["off"], _timed(step, m, reps=1))
        best["floor"] = min(best["floor"], _timed(lambda: step(True), m, reps=1))
        sess = stepwatch.init(dir=os.path.join(run_dir, f"hot-all-{r}"), console="off", **cfg)
        for _ in range(20):
            step()
        best["on"] = min(best["on"], _timed(_paused(sess, step), m, reps=1))
        each["on"] += _per_step(_paused(sess, step), m)
        stepwatch.shutdown()
        each["off"] += _per_step(step, m)
        each["floor"] += _per_step(lambda: step(True), m)
    off = best["off"]
    floor = best["floor"] - off
    on = best["on"] - off
    print(f"  all defaults, a whole tiny step       {on / 1e3:8.2f} us added; target <= 20 us + the floor in "
          f"this step ({floor / 1e3:.2f} us) = {20 + floor / 1e3:.2f} us   {'met' if on <= 20e3 + floor else 'NOT met'}")
    # The same three timed step by step (a block's mean takes in the machine's slow spells, which
    # last a few ms on this shared VM and hit any block): each one's per-step quantiles.
    qs = {k: statistics.quantiles(v, n=20) for k, v in each.items()}
    for label, i in (("10th percentile", 1), ("lower quartile", 4), ("median", 9)):
        d_on, d_floor = (qs["on"][i] - qs["off"][i]) / 1e3, (qs["floor"][i] - qs["off"][i]) / 1e3
        print(f"    per step, {label:<16} {d_on:8.2f} us added; floor {d_floor:5.2f} us   "
              f"{'met' if d_on <= 20 + d_floor else 'NOT met'} ({ROUNDS} x {m} steps each)")


def _per_step(fn, n: int) -> list[int]:
    """Training-thread CPU ns of each of ``n`` calls (the clock's own cost is in every variant's)."""
    out = []
    clock = time.thread_time_ns
    for _ in range(n):
        t = clock()
        fn()
        out.append(clock() - t)
    return out


def memory_read_cost(n: int = 20000) -> None:
    """The memory collector's read alone, hot: what one costs, and per step at the default
    interval (on CPU one pread of /proc/self/statm; on a GPU one call of the allocator's
    statistics too: scripts/gpu_check_session.py prints that cost)."""
    from stepwatch.memory.probe import MemoryProbe

    for every in (1, 10):
        take = MemoryProbe(every=every).take
        print(f"  memory collector, read every {every:>2} steps  {_timed(take, n) / 1e3:8.2f} us per step")


def _find_grad_norm(session):
    """The session's grad-norm collector (where the training-metrics feature keeps it)."""
    from stepwatch.metrics.grads import GradNormCollector

    seen = set()
    stack = [session]
    while stack:
        o = stack.pop()
        if id(o) in seen:
            continue
        seen.add(id(o))
        if isinstance(o, GradNormCollector):
            return o
        for v in (list(vars(o).values()) if hasattr(o, "__dict__") else []):
            if isinstance(v, (list, tuple)):
                stack.extend(v)
            elif hasattr(v, "__dict__") and type(v).__module__.startswith("stepwatch"):
                stack.append(v)
    return None


def background(run_dir: str) -> float:
    """One background pass over a realistic queue (the default size) of records, per record."""
    s = stepwatch.init(dir=os.path.join(run_dir, "bg"), console="off", **{**FOUNDATION, "training_metrics": True})
    one_step = hook_sequence(s.tracker)
    s.pipeline.stop_thread()
    s.pipeline.run_pass()
    per = []
    m = 500  # about what a 2 s flush interval holds at 250 steps/s
    for _ in range(5):
        for _ in range(m):
            one_step()
        t = time.thread_time_ns()
        s.pipeline.run_pass()
        per.append((time.thread_time_ns() - t) / m / 1e3)
    stepwatch.shutdown()
    bg = statistics.median(per)
    print(f"\n3. Background thread per record (build, enrich, detect, write; queue of {m}): {bg:.2f} us"
          f"   (target <= 10)   {'met' if bg <= 10 else 'NOT met'}")
    return bg


PINNED: dict[str, object] = {"main": None, "others": None}  # the training thread's CPU; the rest


def others_elsewhere() -> None:
    """stepwatch's threads (the pipeline's, its exporters', telemetry's) on the CPUs the training
    thread does not use, as in a job with more cores than training threads: pinned with it, a
    background pass ran on the training thread's core, and its cache effects were counted as
    the training thread's. Each block's start (threads start lazily): a few system calls."""
    others = PINNED["others"]
    if not others:
        return
    me = threading.get_native_id()
    for tid in os.listdir("/proc/self/task"):
        if int(tid) != me:
            try:
                os.sched_setaffinity(int(tid), others)  # type: ignore[arg-type]
            except OSError:
                pass  # a thread that just ended


def pin(cpu: int | None, p: argparse.ArgumentParser) -> None:
    """Run the training thread on one CPU, and stepwatch's threads on the others
    (:func:`others_elsewhere`). Unpinned, the training thread moves between this VM's two vCPUs,
    whose speed differs by up to 1.8x for seconds at a time, and stepwatch's own thread changes
    where the scheduler puts it: a block with stepwatch on then ran on the other vCPU, faster or
    slower, more often than one with it off (benchmarks/results/cpu-2026-12-06-s28/pinning.txt).
    The background's own cost is table 3's."""
    allowed = sorted(os.sched_getaffinity(0))
    if cpu == -1:
        print(f"not pinned (CPUs {allowed})")
        return
    if cpu is None:
        cpu = allowed[-1]
    elif cpu not in allowed:
        p.error(f"--cpu: {cpu} is not among the CPUs this process may use {allowed} (or -1: not pinned)")
    os.sched_setaffinity(0, {cpu})
    PINNED["main"], PINNED["others"] = cpu, set(allowed) - {cpu}
    print(f"training thread pinned to CPU {cpu}, stepwatch's threads to {sorted(PINNED['others']) or 'the same'} "
          f"(--cpu -1: not pinned)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=10)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--sizes", default="0.5,2,20", help="comma-separated: 0.5, 2, 20 (ms per step)")
    p.add_argument("--hot-n", type=int, default=20000)
    p.add_argument("--cpu", type=int, default=None, metavar="N",
                   help="run the whole process on CPU N (default: the highest this process may use; "
                        "-1: not pinned)")
    p.add_argument("--crossings", type=int, default=0, metavar="BLOCKS",
                   help="also table 4: the foundation's hook crossings in the ~0.5 ms loop, over BLOCKS blocks (40 is readable)")
    args = p.parse_args()
    sizes = [s for s in args.sizes.split(",") if s]
    bad = [s for s in sizes if s not in SIZES]
    if bad:
        p.error(f"--sizes: {bad} not among {list(SIZES)}")
    torch.set_num_threads(1)
    pin(args.cpu, p)
    with tempfile.TemporaryDirectory() as d:
        loop = in_the_loop(args.blocks, args.steps, sizes, d)
        h = hot(d, args.hot_n)
        background(d)
        if args.crossings:
            crossings(args.crossings, max(args.steps, 240), d)
    for s in sizes:
        all_defaults = loop[f"+ {FEATURES[-1][0]}"][s]
        floor = loop[FLOOR][s]
        verdict = ("met" if all_defaults <= 40 + floor else "NOT met") if s == "0.5" else "(target set for ~0.5 ms)"
        print(f"In the {SIZES[s][0]} loop, all defaults add {all_defaults:.1f} us per step "
              f"[IQR {LOOP_IQR[s]:.1f}]; target <= 40 us + the grad-norm floor in the same loop "
              f"({floor:.1f} us) = {40 + floor:.1f} us: {verdict}")
        if s == "0.5" and NOISE_IQR[s] > 40:
            print(f"  (as measured; the loop off against itself spreads IQR {NOISE_IQR[s]:.1f} us in this run, "
                  f"wider than the 40 us target: the difference is not resolved on this machine; "
                  f"benchmarks/instructions.py counts it)")


if __name__ == "__main__":
    main()

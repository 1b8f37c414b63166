"""Memory: the leak detector on a real CPU loop, the detectors' rules, the CUDA numbers from a
memory_stats dictionary, host readers, OOM forensics' parsing.

CUDA is not on this machine: the CUDA parts run against a nested memory_stats dictionary with the
caching allocator's key set (tests/fixtures/memory/memory_stats_nested.json, built to the layout of
c10/cuda/CUDACachingAllocator's DeviceStats, not dumped from a device) through a stand-in for
``torch.cuda`` -- only CUDA is mocked; the GPU check script reads the real one.
"""

from __future__ import annotations

import copy
import json
import math
import os
import random
import subprocess
import sys
import threading
import time

import pytest

from stepwatch.memory.detect import (FragmentationDetector, MemoryGrowthDetector, NearLimitDetector, MiB,
                                     growth_of)
from stepwatch.memory.host import HostLimit, StatmReader, parent_pid, smaps_rollup
from stepwatch.memory.oom import is_oom, requested_bytes
from stepwatch.memory.probe import MemoryProbe, cuda_numbers
from stepwatch.record import StepRecord

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "memory", "memory_stats_nested.json")
G = 1 << 30


def _loop(stepwatch, start, steps, leak, every=10):
    import ctypes

    import torch

    # Give back the heap an earlier test freed (its leak's 150 MiB): reused by this one's leak,
    # it would keep RSS flat while the leak grows. (glibc: returns free pages to the system.)
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    start(memory_every=every, training_metrics=False, comm=False, gpu_telemetry=False)
    torch.manual_seed(0)
    m = torch.nn.Linear(32, 32)
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    x = torch.randn(8, 32)
    kept = []
    for _ in range(steps):
        m(x).sum().backward()
        opt.step()
        opt.zero_grad()
        if leak:
            kept.append(torch.ones(65536))  # 256 KiB with every page written
    stepwatch.shutdown()
    return kept


def test_a_256_kib_per_step_leak_is_named_within_600_steps(sw):
    stepwatch, mem, start = sw
    _loop(stepwatch, start, 600, leak=True)
    growth = [f for f in mem.findings if f.kind == "memory_growth"]
    assert growth, [f.kind for f in mem.findings]
    f = growth[0]
    assert f.step <= 600 and f.data["series"] == "host"
    assert f.data["growth_mib_per_step"] == pytest.approx(0.25, rel=0.3)
    assert f.data["limit_bytes"] and f.data["limit_step"] > f.step
    assert "MiB per step" in f.summary and "memray" in f.action and "memory_snapshot" not in f.action
    rss = [r.host_rss_bytes for r in mem.records if r.host_rss_bytes is not None]
    assert len(rss) >= 55  # read every 10th step


def test_a_leak_read_every_30_steps_is_named_too(sw):
    """STEPWATCH_MEMORY_EVERY=30 with the default 200-step window: 7 reads a window, fewer than the
    8 a window is judged on, so a leak was never named. The window is at least 8 reads now."""
    stepwatch, mem, start = sw
    _loop(stepwatch, start, 600, leak=True, every=30)
    growth = [f for f in mem.findings if f.kind == "memory_growth"]
    assert growth and growth[0].data["series"] == "host", [f.kind for f in mem.findings]
    assert growth[0].data["growth_mib_per_step"] == pytest.approx(0.25, rel=0.3)


def test_the_same_loop_without_the_leak_gets_no_growth_finding(sw):
    stepwatch, mem, start = sw
    _loop(stepwatch, start, 600, leak=False)
    assert not [f for f in mem.findings if f.kind == "memory_growth"]
    assert len(mem.records) == 600


def _series(values, start=0):
    return [(start + i, int(v)) for i, v in enumerate(values)]


def _Greedy(allocate):
    """A model whose forward, asked for a batch too big, runs ``allocate`` (which fails)."""
    import torch

    class Greedy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 1)

        def forward(self, x, too_big):
            if too_big:
                allocate()
            return self.lin(x)

    return Greedy()


def _raise_memory_error():
    raise MemoryError()


def test_each_oom_a_loop_catches_and_drops_is_written_down(sw, tmp_path):
    """A loop that catches a MemoryError in the forward, drops it and goes on (a batch too large,
    skipped): only the first was written down. The next MemoryError was made at the freed one's
    address, and OOMs were told apart by id. Each is now one oom-<n>/, counted in the finding's
    episode."""
    import torch

    stepwatch, mem, start = sw

    start()
    m = _Greedy(_raise_memory_error)
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    for i in range(13):
        try:
            m(torch.ones(2, 4), i in (4, 8, 12)).sum().backward()
        except MemoryError:
            continue  # dropped: nothing keeps it
        opt.step()
        opt.zero_grad()
    stepwatch.shutdown()
    ooms = [f for f in mem.findings if f.kind == "oom"]
    assert ooms and ooms[-1].data["episode"]["count"] == 3, ooms  # one episode of 3 (the rate limit's)
    assert {f"oom-{k}" for k in (1, 2, 3)} <= set(os.listdir(tmp_path / "run"))


class _Rows:
    def __len__(self):
        return 64

    def __getitem__(self, i):
        import torch

        return torch.full((4,), float(i))


def test_forkserver_dataloader_workers_are_read(sw):
    """``multiprocessing_context="forkserver"`` (Python 3.14's default on Linux): the workers'
    parent is the forkserver this process started, not this process, and they were skipped as
    "gone or a reused pid": workers_uss/pss and dataloader_workers null on every record."""
    import time

    import torch
    from torch.utils.data import DataLoader

    stepwatch, mem, start = sw
    start(memory_every=1)
    m = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    loader = DataLoader(_Rows(), batch_size=2, num_workers=2, multiprocessing_context="forkserver",
                        persistent_workers=True)
    deadline = time.monotonic() + 20
    while not any(r.dataloader_workers for r in mem.records) and time.monotonic() < deadline:
        for x in loader:
            m(x).sum().backward()
            opt.step()
            opt.zero_grad()
            time.sleep(0.02)  # the workers are read once a second, off the training thread
    stepwatch.shutdown()
    got = [r for r in mem.records if r.dataloader_workers]
    assert got and got[-1].dataloader_workers == 2 and got[-1].workers_uss_bytes > 0, mem.records[-1]


def test_plateau_after_warm_up_jump_and_noise_are_not_growth():
    rnd = random.Random(1)
    base = 2 * G
    # warm-up that saturates (optimizer state, allocator cache), then flat with noise
    warm = [base + 300 * MiB * (1 - math.exp(-i / 40)) + rnd.gauss(0, 2 * MiB) for i in range(400)]
    det = MemoryGrowthDetector(200, 16 * MiB)
    out = []
    for i, v in enumerate(warm):
        out += det.observe(StepRecord(step=i, rank=0, time=float(i), step_s=0.01, host_rss_bytes=int(v)))
    assert not out
    # a one-off jump
    jump = [base + (200 * MiB if i > 100 else 0) + rnd.gauss(0, MiB) for i in range(200)]
    assert growth_of(_series(jump), 16 * MiB) is None
    # a leak, noisy
    leak = [base + i * 0.25 * MiB + rnd.gauss(0, 2 * MiB) for i in range(200)]
    rate = growth_of(_series(leak), 16 * MiB)
    assert rate is not None and rate / MiB == pytest.approx(0.25, rel=0.1)
    # too small a rise over the window
    slow = [base + i * 0.01 * MiB for i in range(200)]
    assert growth_of(_series(slow), 16 * MiB) is None


def test_growth_names_the_step_the_device_limit_is_reached():
    det = MemoryGrowthDetector(200, 16 * MiB, headroom=lambda s: (80 * G, 10 * G, "device total"))
    found = []
    for i in range(300):
        r = StepRecord(step=i, rank=0, time=float(i), step_s=0.01, mem_allocated_bytes=G + i * MiB)
        found += det.observe(r)
    f = found[0]
    assert f.data["series"] == "device" and f.data["growth_mib_per_step"] == pytest.approx(1.0)
    assert f.data["limit_step"] == f.step + 10 * 1024


def test_the_growth_action_says_what_to_do_about_the_memory_that_grew():
    """A CPU job's RSS growth was pointed at the CUDA memory_snapshot.pickle (no CUDA there)."""
    def grow(field):
        det = MemoryGrowthDetector(200, 16 * MiB)
        found = []
        for i in range(300):
            found += det.observe(StepRecord(step=i, rank=0, time=float(i), step_s=0.01, **{field: G + i * MiB}))
        return found[0]

    device, host, workers = grow("mem_allocated_bytes"), grow("host_rss_bytes"), grow("workers_pss_bytes")
    assert (device.data["series"], host.data["series"], workers.data["series"]) == ("device", "host", "workers")
    assert "memory_snapshot.pickle" in device.action and "memory_viz" in device.action
    for f in (host, workers):
        assert "memory_snapshot" not in f.action and "CUDA" not in f.action, f.action
    assert "memray" in host.action and "tracemalloc" in host.action and ".detach()" in host.action
    assert "numpy" in workers.action and "memray" in workers.action


class FakeCuda:
    """Stands in for torch.cuda (mocked: no CUDA here); serves the fixture's statistics."""

    def __init__(self, stats):
        self.stats = stats
        self.resets = 0
        self.reads = 0

    def is_initialized(self):
        return True

    def current_device(self):
        return 0

    def memory_stats_as_nested_dict(self, device):
        self.reads += 1
        return copy.deepcopy(self.stats)

    def reset_peak_memory_stats(self, device):
        self.resets += 1


def test_cuda_numbers_from_a_nested_memory_stats_dict():
    stats = json.load(open(FIXTURE))
    assert cuda_numbers(stats) == (3 * G // 2, 6 * G, 2 * G, 3, 0)


@pytest.mark.parametrize("core", ["python", "c"])
def test_probe_reads_every_n_steps_and_resets_the_peak_unless_told_not_to(core):
    """``core``: the probe's own ``take`` (the reference), or the collector the tracker is given,
    its countdown in C (``_speedups.Every``) where that was built."""
    from stepwatch.memory import probe as probe_mod

    if core == "c" and probe_mod._Every is None:
        pytest.skip("stepwatch._speedups is not built here")
    stats = json.load(open(FIXTURE))
    cuda = FakeCuda(stats)
    p = MemoryProbe(every=5, cuda=cuda)
    col = p if core == "python" else p.collector()
    assert col.name == "memory" and (core == "python" or type(col).__name__ == "Every")
    got = [col.take() for _ in range(11)]
    assert [g is not None for g in got] == [True, False, False, False, False, True, False, False, False, False, True]
    rss, c = got[0]
    assert rss and rss > 10 * MiB and c == (3 * G // 2, 6 * G, 2 * G, 3, 0)
    assert cuda.reads == 3 and cuda.resets == 3
    keep = FakeCuda(stats)
    p = MemoryProbe(every=1, cuda=keep, reset_peak=False)
    p.take()
    assert keep.resets == 0


def test_fragmentation_from_retries_and_from_reserved_far_above_the_peak():
    det = FragmentationDetector(10)
    out = []
    for i in range(10):
        out += det.observe(StepRecord(step=i, rank=0, time=0.0, step_s=0.1, mem_reserved_bytes=6 * G,
                                      mem_allocated_bytes=G, mem_fragmentation_bytes=G // 10,
                                      mem_alloc_retries=1 if i == 4 else 0))
    assert out and out[0].kind == "memory_fragmentation" and out[0].data["alloc_retries"] == 1
    assert "expandable_segments:True" in out[0].action
    det = FragmentationDetector(10)
    out = []
    for i in range(10):
        out += det.observe(StepRecord(step=i, rank=0, time=0.0, step_s=0.1, mem_reserved_bytes=6 * G,
                                      mem_allocated_bytes=G, mem_fragmentation_bytes=4 * G, mem_alloc_retries=0))
    assert out and out[0].data["gap_bytes"] == 4 * G
    det = FragmentationDetector(10)
    healthy = [StepRecord(step=i, rank=0, time=0.0, step_s=0.1, mem_reserved_bytes=6 * G, mem_allocated_bytes=G,
                          mem_fragmentation_bytes=G // 2, mem_alloc_retries=0) for i in range(10)]
    assert not sum((det.observe(r) for r in healthy), [])


def test_near_limit_device_free_below_5000_mib_and_host_above_90_percent():
    det = NearLimitDetector(5)
    out = []
    for i in range(5):
        out += det.observe(StepRecord(step=i, rank=0, time=0.0, step_s=0.1, mem_device_free_bytes=4000 * MiB))
    assert out and "4000 MiB" in out[0].summary and "micro-batch" in out[0].action
    det = NearLimitDetector(5)
    ok = sum((det.observe(StepRecord(step=i, rank=0, time=0.0, step_s=0.1, mem_device_free_bytes=6000 * MiB))
              for i in range(5)), [])
    assert not ok
    det = NearLimitDetector(5, host=lambda: (95 * G, 100 * G, "cgroup"))
    out = sum((det.observe(StepRecord(step=i, rank=0, time=0.0, step_s=0.1)) for i in range(5)), [])
    assert out and out[0].data["host_limit_kind"] == "cgroup" and "persistent_workers" in out[0].action


def test_requested_size_parsed_from_cuda_and_cpu_messages():
    cuda_msg = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.15 GiB of "
                "which 1.2 GiB is free.")
    assert requested_bytes(cuda_msg) == 2 * G
    assert requested_bytes("Tried to allocate 20.00 MiB (GPU 0; 15.78 GiB total capacity)") == 20 * MiB
    cpu = "[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: not enough memory: you tried to allocate 8000000000000 bytes."
    assert requested_bytes(cpu) == 8000000000000
    assert requested_bytes("") is None
    import torch

    assert is_oom(torch.OutOfMemoryError("x")) and is_oom(MemoryError()) and not is_oom(RuntimeError("x"))


def test_torchs_cpu_allocator_and_a_dataloader_workers_oom_are_ooms():
    """On CPU torch's allocator raises a plain RuntimeError ("DefaultCPUAllocator: can't allocate
    memory"), and a DataLoader worker's MemoryError (numpy's "Unable to allocate", whose type
    torch cannot rebuild) reaches the trainer as a RuntimeError "Caught MemoryError in DataLoader
    worker process 0". Neither was recorded. Both are real exceptions here, not made up."""
    import numpy as np
    import torch
    from torch.utils.data import DataLoader

    class Huge:
        def __init__(self, make):
            self.make = make

        def __len__(self):
            return 4

        def __getitem__(self, i):
            return self.make()

    caught = []
    for make in (lambda: torch.empty(1 << 50), lambda: np.empty(1 << 50)):
        try:
            make()
        except Exception as e:  # noqa: BLE001
            caught.append(e)
        try:
            next(iter(DataLoader(Huge(make), num_workers=1)))
        except Exception as e:  # noqa: BLE001
            caught.append(e)
    assert len(caught) == 4 and type(caught[0]) is RuntimeError and type(caught[1]) is RuntimeError, caught
    assert all(is_oom(e) for e in caught), [(type(e), str(e)[:80]) for e in caught]
    assert requested_bytes(str(caught[0])) == 4 << 50  # float32: 4 bytes an element
    assert requested_bytes(str(caught[2])) == 8 << 50  # numpy's float64: "Unable to allocate 8.00 PiB"
    assert not is_oom(RuntimeError("Caught ValueError in DataLoader worker process 0."))
    assert not is_oom(RuntimeError("shape mismatch: can't allocate memory for nothing"))


def test_a_dataloader_worker_killed_by_sigkill_is_an_oom():
    """The kernel's OOM killer ends a DataLoader worker (a leak in the workers under a memory
    limit): the trainer, still alive, gets "DataLoader worker (pid N) is killed by signal: Killed."
    and no OOM record was written. A real worker, killed here with SIGKILL as the OOM killer does;
    another signal, or a worker that exits on its own, is no OOM."""
    import signal as sig

    import torch
    from torch.utils.data import DataLoader

    class Slow:
        def __len__(self):
            return 100

        def __getitem__(self, i):
            time.sleep(0.2)
            return torch.zeros(1)

    def fate(signum):
        it = iter(DataLoader(Slow(), num_workers=1))
        try:
            next(it)
            os.kill(it._workers[0].pid, signum)
            for _ in range(100):
                next(it)
        except Exception as e:  # noqa: BLE001
            return e
        finally:
            del it
        return None

    def said(e):  # the loader's own words: the SIGCHLD handler's, or "exited unexpectedly" from them
        return " / ".join(str(x) for x in (e, e.__cause__) if x is not None)

    killed = fate(sig.SIGKILL)
    assert isinstance(killed, RuntimeError) and "is killed by signal: Killed" in said(killed), said(killed)
    assert is_oom(killed)
    terminated = fate(sig.SIGTERM)
    assert isinstance(terminated, RuntimeError) and "Killed" not in said(terminated), said(terminated)
    assert not is_oom(terminated)


def test_a_cpu_oom_in_the_forward_is_written_down_with_a_cpu_action(sw, tmp_path):
    """A real CPU allocation failure in the forward: an oom finding with its phase, step and the
    requested size, and an action for a CPU job: no CUDA file or setting it does not have."""
    import torch

    stepwatch, mem, start = sw

    start()
    m = _Greedy(lambda: torch.empty(1 << 50))
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    with pytest.raises(RuntimeError, match="DefaultCPUAllocator"):
        for i in range(5):
            m(torch.ones(2, 4), i == 3).sum().backward()
            opt.step()
            opt.zero_grad()
    stepwatch.shutdown()
    ooms = [f for f in mem.findings if f.kind == "oom"]
    assert len(ooms) == 1, [f.kind for f in mem.findings]
    f = ooms[0]
    assert f.step == 3 and f.data["phase"] == "forward" and f.data["requested_bytes"] == 4 << 50, f
    report = json.loads((tmp_path / "run" / "oom-1" / "report.json").read_text())
    assert report["files"] == ["records.jsonl", "report.json"]
    for word in ("memory_summary", "memory_snapshot", "PYTORCH_CUDA_ALLOC_CONF"):
        assert word not in f.action and word not in f.diagnosis, (word, f.action, f.diagnosis)
    assert "report.json" in f.action and "records.jsonl" in f.action and "memray" in f.action, f.action


def test_a_leak_whose_rss_pauses_is_named_once_in_twenty_windows():
    """RSS of a steady leak pauses for a while when malloc reuses freed memory: a check that saw no
    growth there reset the repeat limit, and the same leak was named again 300 steps later (the
    docs: at most every 20 windows, 4,000 steps). Only a series that stopped rising is judged anew."""
    det = MemoryGrowthDetector(200, 16 * MiB)
    found, v = [], 2 * G
    for i in range(3000):
        if i % 160 < 110:  # rises 0.4 MiB a step for 110 steps, then 50 flat ones
            v += int(0.4 * MiB)
        found += det.observe(StepRecord(step=i, rank=0, time=float(i), step_s=0.01, host_rss_bytes=v))
    assert len(found) == 1, [f.step for f in found]


def test_a_leak_that_stopped_and_came_back_is_named_again():
    """The other side: a series flat for a whole window has stopped; a leak after it is news."""
    det = MemoryGrowthDetector(200, 16 * MiB)
    found, v = [], 2 * G
    for i in range(1500):
        if i < 400 or i >= 900:
            v += int(0.4 * MiB)
        found += det.observe(StepRecord(step=i, rank=0, time=float(i), step_s=0.01, host_rss_bytes=v))
    assert len(found) == 2 and found[0].step < 400 and found[1].step > 900, [f.step for f in found]


def test_a_cpu_jobs_peak_never_falls(sw):
    """On CPU ``mem_peak_bytes`` is the process's high-water mark: it never falls from one record to
    the next. It did, by up to 0.4 MiB, in a steady loop: a record's RSS read (every 10th step)
    came in above the cached ``ru_maxrss``, and the next ``ru_maxrss`` read replaced it."""
    import torch

    stepwatch, mem, start = sw
    s = start(training_metrics=False, comm=False, gpu_telemetry=False)
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024),
                            torch.nn.ReLU(), torch.nn.Linear(1024, 10))
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    x, y = torch.randn(16, 256), torch.randint(0, 10, (16,))
    for i in range(300):
        torch.nn.functional.cross_entropy(m(x), y).backward()
        opt.step()
        opt.zero_grad()
    # The background passes catch up first (the last step's record waits for shutdown): on a busy
    # machine a pass still running at shutdown's 1.5 s bound loses its records (counted), and this
    # test is about the peaks, not that bound (tests/unit/test_faults_shutdown.py).
    end = time.monotonic() + 60
    while len(mem.records) < 299 and time.monotonic() < end:
        time.sleep(0.02)
    stepwatch.shutdown()
    # The records file, written by the final pass itself: an exporter on its own thread gets what
    # it takes within shutdown's bound (on a busy machine, 159 of 300 here; the rest counted).
    with open(os.path.join(s.ctx.run_dir, "steps.rank0.jsonl")) as f:
        peaks = [json.loads(line)["mem_peak_bytes"] for line in f if line.strip()]
    assert all(p is not None for p in peaks) and len(peaks) == 300
    falls = [(i, a - b) for i, (a, b) in enumerate(zip(peaks, peaks[1:])) if b < a]
    assert not falls, falls[:5]


LAUNCHED_TRAINER = r"""
import json, sys, stepwatch, torch
stepwatch.init(dir=sys.argv[1], console="off", training_metrics=False, comm=False, gpu_telemetry=False)
m = torch.nn.Linear(8, 8)
opt = torch.optim.SGD(m.parameters(), lr=0.1)
for _ in range(12):
    m(torch.randn(4, 8)).sum().backward(); opt.step(); opt.zero_grad()
stepwatch.shutdown()
with open("/proc/self/status") as f:
    print(next(int(x.split()[1]) * 1024 for x in f if x.startswith("VmHWM:")))
"""

LAUNCHER = r"""
import subprocess, sys
held = bytearray(768 << 20)  # a sweep driver, a notebook: it held much more than its trainer will
for i in range(0, len(held), 4096):
    held[i] = 1
out = subprocess.run([sys.executable, "-c", sys.argv[1], sys.argv[2]], check=True, capture_output=True, text=True)
print(out.stdout.strip().splitlines()[-1])
"""


def test_a_cpu_jobs_peak_is_its_own_not_its_launchers(tmp_path):
    """A trainer started by ``subprocess`` from a process that held much memory: on CPU its
    ``mem_peak_bytes`` (and the report's "peak memory") was the launcher's high-water mark
    (``getrusage``'s ``ru_maxrss`` carries the parent's over ``vfork`` and ``exec``): 1.01 GiB for a
    312 MiB trainer. The trainer's own ``VmHWM`` now."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEPWATCH_")}
    env["PYTHONPATH"] = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "src")
    r = subprocess.run([sys.executable, "-c", LAUNCHER, LAUNCHED_TRAINER, str(tmp_path / "run")], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    own = int(r.stdout.strip().splitlines()[-1])
    with open(tmp_path / "run" / "steps.rank0.jsonl") as f:
        peaks = [json.loads(line)["mem_peak_bytes"] for line in f if line.strip()]
    assert len(peaks) == 12 and all(p is not None for p in peaks)
    assert max(peaks) <= own < 700 << 20, (max(peaks) >> 20, own >> 20)


def test_host_readers_current_rss_and_own_smaps():
    import torch

    # In a fresh process: in this one, threads left by earlier tests free memory meanwhile.
    code = (
        "import torch; from stepwatch.memory.host import StatmReader; torch.ones(1 << 22).add_(1); "
        "r = StatmReader(); b = r(); "
        "blob = torch.ones(64 << 18); print(r() - b)"
    )
    # One intra-op thread, and torch warmed up first: the first large fill of a fresh process
    # starts the thread pool (stacks, malloc arenas), real memory but not the 64 MiB measured.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))), "src")}
    rise = int(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                              check=True, timeout=120).stdout.strip())
    assert rise == pytest.approx(64 * MiB, rel=0.1)  # 64 MiB written
    blob = torch.ones(1 << 18)
    uss, pss, rss = smaps_rollup(os.getpid())
    assert 0 < uss <= pss <= rss
    assert parent_pid(os.getpid()) == os.getppid()
    del blob


def test_cgroup_limit_v2_tightest_up_the_tree_and_v1(tmp_path):
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text("MemTotal:       1000000 kB\nMemAvailable:    400000 kB\n")
    cg = tmp_path / "cg"
    job = cg / "slurm" / "job1"
    job.mkdir(parents=True)
    (cg / "memory.max").write_text("max\n")
    (cg / "slurm" / "memory.max").write_text(f"{8 * G}\n")
    (job / "memory.max").write_text(f"{16 * G}\n")
    (job / "memory.current").write_text(f"{5 * G}\n")
    (job / "memory.stat").write_text(f"anon 100\ninactive_file {G}\n")
    (proc / "self" / "cgroup").write_text("0::/slurm/job1\n")
    # The limit that binds is the parent's: so is the use that counts against it (every job under
    # that parent's). It was read from the job's own cgroup: a parent at 95% of its limit was
    # said to be at 10%, and memory_near_limit never came.
    (cg / "slurm" / "memory.current").write_text(f"{7 * G}\n")
    (cg / "slurm" / "memory.stat").write_text(f"anon 100\ninactive_file {G // 2}\n")
    lim = HostLimit(proc=str(proc), cgroup_root=str(cg))
    assert (lim.limit, lim.kind, lim.used()) == (8 * G, "cgroup", 7 * G - G // 2)
    # the job's own limit the tighter one: its own use
    (job / "memory.max").write_text(f"{6 * G}\n")
    lim = HostLimit(proc=str(proc), cgroup_root=str(cg))
    assert (lim.limit, lim.kind, lim.used()) == (6 * G, "cgroup", 4 * G)
    # no cgroup limit: physical RAM, used = total - available
    (proc / "self" / "cgroup").write_text("0::/\n")
    (cg / "slurm" / "memory.max").write_text("max\n")
    (job / "memory.max").write_text("max\n")
    lim = HostLimit(proc=str(proc), cgroup_root=str(cg))
    assert (lim.limit, lim.kind, lim.used()) == (1000000 * 1024, "physical RAM", 600000 * 1024)
    # v1
    v1 = tmp_path / "v1"
    (v1 / "memory" / "docker" / "abc").mkdir(parents=True)
    d = v1 / "memory" / "docker" / "abc"
    (d / "memory.limit_in_bytes").write_text(f"{2 * G}\n")
    (d / "memory.usage_in_bytes").write_text(f"{G}\n")
    (d / "memory.stat").write_text(f"total_inactive_file {G // 4}\n")
    (proc / "self" / "cgroup").write_text("12:memory:/docker/abc\n")
    lim = HostLimit(proc=str(proc), cgroup_root=str(v1))
    assert (lim.limit, lim.kind, lim.used()) == (2 * G, "cgroup", 3 * G // 4)


def test_a_v2_cgroup_path_the_mount_does_not_hold_reads_the_mount_for_both(tmp_path):
    """/proc/self/cgroup names a path the cgroup mount does not have (a namespace, a container
    runtime's view): the limit was the mount's, the usage the whole machine's /proc/meminfo
    (477% of a cgroup half used: memory_near_limit on wrong numbers). Both from the mount now;
    a usage that cannot be read is unknown, never the machine's against the cgroup's limit."""
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text("MemTotal:       20000000 kB\nMemAvailable:   10000000 kB\n")
    (proc / "self" / "cgroup").write_text("0::/process_api/fe4d\n")
    cg = tmp_path / "cg"
    (cg / "process_api" / "0d1c").mkdir(parents=True)
    (cg / "memory.max").write_text(f"{2 * G}\n")
    (cg / "memory.current").write_text(f"{G}\n")
    (cg / "memory.stat").write_text("inactive_file 0\n")
    lim = HostLimit(proc=str(proc), cgroup_root=str(cg))
    assert (lim.limit, lim.kind, lim.used()) == (2 * G, "cgroup", G)
    (cg / "memory.current").unlink()
    assert lim.used() is None


def test_bad_memory_settings_name_the_variable():
    from stepwatch.config import Config, ConfigError

    with pytest.raises(ConfigError, match="STEPWATCH_MEMORY_EVERY.*integer >= 1"):
        Config.from_env({"STEPWATCH_MEMORY_EVERY": "0"})
    with pytest.raises(ConfigError, match="STEPWATCH_MEMORY_HISTORY.*auto, on, off"):
        Config.from_env({"STEPWATCH_MEMORY_HISTORY": "sometimes"})


class FakeMemoryModule:
    def __init__(self):
        self.calls = []
        self.threads = []

    def _record_memory_history(self, **kw):
        self.calls.append(kw)
        self.threads.append(threading.get_ident())


def test_session_fills_cuda_fields_counts_retries_per_read_and_arms_the_history_on_growth(sw):
    """A real session and loop on CPU; only torch.cuda is a stand-in serving the fixture's stats."""
    import torch

    stepwatch, mem, start = sw
    s = start(memory_every=1, training_metrics=False, comm=False, gpu_telemetry=False)
    feat = next(f for f in s.features_started if f.name == "memory")
    cuda = FakeCuda(json.load(open(FIXTURE)))
    cuda.mem_get_info = lambda dev: (3000 * MiB, 80 * G)
    cuda.memory = FakeMemoryModule()
    probe = MemoryProbe(every=1, cuda=cuda)
    at = [i for i, c in enumerate(s.tracker.collectors) if c.name == "memory"]
    assert len(at) == 1
    s.tracker.collectors[at[0]] = probe.collector()
    feat.probe = probe
    m = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for i in range(60):
        if i == 30:
            cuda.stats["num_alloc_retries"] = 5
        m(torch.randn(2, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
        if i == 10:
            import time

            time.sleep(1.2)  # a background sample of the device's free memory
    deadline = time.monotonic() + 20
    while not cuda.memory.calls and time.monotonic() < deadline:  # steps go on until the history is on
        m(torch.randn(2, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
        time.sleep(0.01)
    assert cuda.memory.calls, "the history was not switched on while the job ran"
    stepwatch.shutdown()
    recs = mem.records
    assert all(r.mem_allocated_bytes == 3 * G // 2 and r.mem_reserved_bytes == 6 * G for r in recs)
    assert all(r.mem_peak_bytes == 2 * G and r.mem_fragmentation_bytes == 4 * G for r in recs)
    assert sum(r.mem_alloc_retries for r in recs) == 2 and recs[0].mem_alloc_retries == 0
    assert any(r.mem_device_free_bytes == 3000 * MiB for r in recs)
    kinds = {f.kind for f in mem.findings}
    assert {"memory_fragmentation", "memory_near_limit"} <= kinds, kinds
    # near-limit fired: the bounded allocation history was switched on, and off at shutdown
    assert cuda.memory.calls[0] == dict(enabled="all", context="all", stacks="python", max_entries=20000)
    assert cuda.memory.calls[-1] == dict(enabled=None)
    # both on the training thread: torch 2.11 keeps the history's RecordFunction callbacks per
    # thread, and one switched off on another thread than it was switched on logs "Requested
    # callback is not found" (seen on an H200, benchmarks/results/h200-2026-12-04/callback.log)
    assert cuda.memory.threads == [threading.get_ident()] * len(cuda.memory.calls)
    assert not [f for f in mem.findings if f.kind == "internal_error"]


def test_report_draws_host_memory_per_step(sw, tmp_path):
    import torch

    stepwatch, mem, start = sw
    start(memory_every=2, training_metrics=False, comm=False, gpu_telemetry=False)
    m = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for _ in range(40):
        m(torch.randn(2, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
    stepwatch.shutdown()
    from stepwatch.cli import main

    assert main(["report", str(tmp_path / "run")]) == 0
    html = (tmp_path / "run" / "report.html").read_text()
    i = html.index("Host memory (rank 0)")
    assert "<svg" in html[i:i + 400] and "trainer RSS" in html[i:]
    assert "Device memory" not in html  # no CUDA here: no device chart
    recs = [json.loads(ln) for ln in (tmp_path / "run" / "steps.rank0.jsonl").read_text().splitlines()]
    assert [r["host_rss_bytes"] is not None for r in recs[:4]] == [True, False, True, False]


def test_a_failing_allocator_read_is_reported_once_and_leaves_the_host_numbers():
    class Broken(FakeCuda):
        def memory_stats_as_nested_dict(self, device):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    errors = []
    p = MemoryProbe(every=1, cuda=Broken({}), on_error=lambda where, e: errors.append(where))
    got = [p.take() for _ in range(3)]
    assert [g[1] for g in got] == [None, None, None] and all(g[0] for g in got)
    assert errors == ["memory.cuda"]


def test_memory_metrics_reach_otel_and_prometheus_names():
    """Records -> the OTel exporter (the SDK's in-memory reader): gauges keep the last read (a
    record without a read exports nothing for them), counters add retries and OOMs."""
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from stepwatch.context import RunContext
    from stepwatch.exporters.base import Batch
    from stepwatch.exporters.otel import OTelExporter

    reader = InMemoryMetricReader()
    e = OTelExporter(RunContext(rank=0, local_rank=0, world_size=1, run_id="t", run_dir="/tmp", host="h", pid=1),
                     readers=[reader], environ={})
    try:
        e.export(Batch(records=[
            StepRecord(step=0, rank=0, time=1.0, step_s=0.1, mem_allocated_bytes=G, mem_reserved_bytes=2 * G,
                       mem_fragmentation_bytes=G // 2, mem_alloc_retries=2, mem_ooms=0, host_rss_bytes=3 * G,
                       workers_uss_bytes=MiB, workers_pss_bytes=5 * MiB, mem_device_free_bytes=4 * G),
            StepRecord(step=1, rank=0, time=1.1, step_s=0.1),  # no read this step
            StepRecord(step=2, rank=0, time=1.2, step_s=0.1, mem_allocated_bytes=G + 1, mem_alloc_retries=3,
                       mem_ooms=1, host_rss_bytes=3 * G + 1),
        ]))
        got = {}
        for rm in reader.get_metrics_data().resource_metrics:
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    got[m.name] = getattr(m.data.data_points[0], "value", None)
    finally:
        e.shutdown()
    assert got["training_memory_allocated_bytes"] == G + 1
    assert got["training_memory_reserved_bytes"] == 2 * G
    assert got["training_memory_fragmentation_bytes"] == G // 2
    assert got["training_host_rss_bytes"] == 3 * G + 1
    assert got["training_dataloader_workers_uss_bytes"] == MiB
    assert got["training_dataloader_workers_pss_bytes"] == 5 * MiB
    assert got["training_memory_device_free_bytes"] == 4 * G
    assert got["training_memory_alloc_retries_total"] == 5 and got["training_memory_ooms_total"] == 1

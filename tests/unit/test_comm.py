"""stepwatch.comm: interval arithmetic, the enricher, findings, the bench math, the DDP hook
patching (real DDP over a one-rank gloo group) and the config fields."""

import math
import os
import socket
import time

import pytest

from stepwatch.comm.bench import parse_size, row, sizes
from stepwatch.comm.findings import LowBusbwDetector, OverlapDetector, baseline, verdict
from stepwatch.comm.overlap import CommEnricher, bus_factor, compute_intervals, length, minus, union
from stepwatch.comm.spans import ALL_GATHER, ALLREDUCE, CommCollector, Span
from stepwatch.config import Config, ConfigError
from stepwatch.record import StepRecord

MS = 1_000_000  # ns


def span(op, t0, t1, nbytes=None, world=2):
    s = Span(op, nbytes, world, 0, "h")
    s.t0, s.t1 = t0, t1
    return s


def rec(step=0, step_s=0.1, **kw):
    return StepRecord(step=step, rank=0, time=0.0, step_s=step_s, **kw)


# -- interval arithmetic ----------------------------------------------------------------------


def test_union_merges_overlapping_and_touching_intervals():
    assert union([(5, 7), (0, 2), (1, 3), (3, 4), (9, 9)]) == [(0, 4), (5, 7)]
    assert length(union([(0, 2), (1, 3)])) == 3


def test_minus_is_the_part_outside():
    assert minus([(0, 10)], [(2, 4), (6, 8)]) == 6
    assert minus([(0, 10)], []) == 10
    assert minus([(0, 2), (1, 5)], [(0, 10)]) == 0
    assert minus([(0, 4), (6, 10)], [(3, 7)]) == 6


def test_compute_interval_is_cut_at_the_last_bucket_issued():
    # backward 0..100 ms returns only after DDP waited; the last bucket was issued at 60 ms.
    assert compute_intervals([(0, 100)], [10.0, 60.0, 150.0]) == [(0.0, 60.0)]
    assert compute_intervals([(0, 100)], []) == [(0.0, 100.0)]


# -- enricher --------------------------------------------------------------------------------


def test_enricher_fills_comm_fields_with_the_hta_definition():
    e = CommEnricher()
    # backward 0-100 ms, buckets issued at 20 and 80 ms; the last bucket runs until 120 ms.
    spans = [span(ALLREDUCE, 20 * MS, 50 * MS, 1_000_000), span(ALLREDUCE, 80 * MS, 120 * MS, 1_000_000)]
    r = rec()
    assert e.enrich(r, {"comm": {"spans": spans}, "backward_spans": [(0, 130 * MS)]}, force=False)
    assert r.comm_s == pytest.approx(0.070)
    assert r.allreduce_s == pytest.approx(0.070)
    assert r.comm_exposed_s == pytest.approx(0.040)  # 80-120 ms lies after the compute end (80 ms)
    assert r.overlap == pytest.approx(1 - 0.040 / 0.070)
    assert r.algbw_gbps == pytest.approx(2e6 / 0.070 / 1e9)
    assert r.busbw_gbps == pytest.approx(r.algbw_gbps * 2 * (2 - 1) / 2)


class _DeviceEvent:
    """Stands in for a recorded torch.cuda.Event (no GPU here): a time on the device clock, in ms."""

    def __init__(self, ms):
        self.ms = ms


def test_device_spans_are_timed_on_the_device_clock_and_host_only_spans_left_out(monkeypatch):
    """A CUDA job with a CPU-side collective beside DDP's (e.g. a gloo object gather): the two
    clocks share no axis, so the device-timed spans are the step's comm. The events are read
    through cuda_ext (right device, relaxed capture mode), faked here at that boundary."""
    import stepwatch.comm.overlap as overlap
    import stepwatch.comm.spans as spans_mod

    seen_devices = []
    monkeypatch.setattr(spans_mod, "event_done", lambda ev, device: seen_devices.append(device) or True)
    monkeypatch.setattr(overlap, "event_elapsed_s", lambda a, b, device: (b.ms - a.ms) * 1e-3)
    fwd_end = _DeviceEvent(0.0)  # backward compute starts at the forward's end on the device
    gpu = span(ALLREDUCE, 0, 0, 4_000_000)
    gpu.ev0, gpu.ev1, gpu.device = _DeviceEvent(30.0), _DeviceEvent(50.0), 3
    cpu = span(ALL_GATHER, 5 * MS, 9 * MS, 100)  # host clock only
    r = rec()
    assert CommEnricher().enrich(r, {"comm": {"spans": [gpu, cpu], "fwd_end_ev": fwd_end}}, force=False)
    assert set(seen_devices) == {3}  # queried on the device its events were recorded on
    assert r.comm_s == pytest.approx(0.020) and r.allreduce_s == pytest.approx(0.020)
    # the last (only) bucket was issued at 30 ms: compute ends there, so 30-50 ms is all exposed
    assert r.comm_exposed_s == pytest.approx(0.020) and r.overlap == pytest.approx(0.0)


def test_one_bucket_after_backward_has_zero_overlap():
    e = CommEnricher()
    r = rec()
    e.enrich(r, {"comm": {"spans": [span(ALLREDUCE, 90 * MS, 140 * MS)]}, "backward_spans": [(0, 141 * MS)]}, force=False)
    assert r.overlap == 0.0 and r.comm_exposed_s == pytest.approx(0.050)
    assert r.busbw_gbps is None  # no bytes known (a user hook): no bandwidth, not a made-up one


def test_enricher_waits_for_open_spans_and_gives_up_when_forced():
    e = CommEnricher()
    open_span = span(ALLREDUCE, 10 * MS, None)
    extras = {"comm": {"spans": [span(ALLREDUCE, 0, 5 * MS), open_span]}, "backward_spans": [(0, 20 * MS)]}
    r = rec()
    assert e.enrich(r, extras, force=False) is False
    assert e.enrich(r, extras, force=True) is True
    assert r.comm_s == pytest.approx(0.005)


def test_fsdp_spans_count_in_comm_but_leave_exposure_unknown():
    e = CommEnricher()
    r = rec()
    spans = [span(ALL_GATHER, 0, 10 * MS, 4_000_000, world=4), span(ALLREDUCE, 20 * MS, 30 * MS)]
    e.enrich(r, {"comm": {"spans": spans}, "backward_spans": [(0, 40 * MS)]}, force=False)
    assert r.comm_s == pytest.approx(0.020)
    assert r.comm_exposed_s is None and r.overlap is None
    assert r.busbw_gbps == pytest.approx(4e6 * 3 / 4 / 0.010 / 1e9)  # (n-1)/n for all-gather


def test_comm_wait_uses_the_fastest_rank_as_transfer_floor():
    e = CommEnricher(window=10)
    e.global_floor_s = 0.004  # the last rank to arrive needed 4 ms
    r = rec()
    # (The backward returns after DDP waited for its bucket: 0-31 ms, not 0-5 ms, which the span
    # cannot outlast.)
    e.enrich(r, {"comm": {"spans": [span(ALLREDUCE, 0, 30 * MS)]}, "backward_spans": [(0, 31 * MS)]}, force=False)
    assert r.comm_wait_s == pytest.approx(0.026)
    e2 = CommEnricher()  # no exchange verdict yet: unknown, not guessed
    r2 = rec()
    e2.enrich(r2, {"comm": {"spans": [span(ALLREDUCE, 0, 30 * MS)]}, "backward_spans": [(0, 31 * MS)]}, force=False)
    assert r2.allreduce_s == pytest.approx(0.030) and r2.comm_wait_s is None


def test_collector_take_swaps_and_reports_progress():
    calls = []

    class Board:
        def coll_enter(self, op, group, seq, nbytes):
            calls.append(("enter", op, group, seq, nbytes))

        def coll_exit(self, seq, group):
            calls.append(("exit", seq, group))

    c = CommCollector(progress_getter=lambda: Board())
    s = c.begin(ALLREDUCE, 64, 2, "h")
    c.end(s)
    assert calls == [("enter", "allreduce", "default", 1, 64), ("exit", 1, "default")]
    assert c.take()["spans"] == [s] and c.take() is None
    # A board without the methods is skipped silently.
    c2 = CommCollector(progress_getter=lambda: object())
    c2.end(c2.begin(ALLREDUCE, 1, 2, "h"))


# -- findings --------------------------------------------------------------------------------


def test_overlap_detector_names_the_fix():
    d = OverlapDetector(window=4, threshold=0.8)
    out = []
    for i in range(4):
        out += d.observe(rec(i, step_s=0.1, overlap=0.1, comm_exposed_s=0.03, comm_wait_s=0.0))
    assert len(out) == 1 and out[0].kind == "allreduce_not_overlapped"
    assert "gradient_as_bucket_view=True" in out[0].action
    d2 = OverlapDetector(window=4, threshold=0.8)
    assert not [f for i in range(4) for f in d2.observe(rec(i, overlap=0.95, comm_exposed_s=0.001, comm_wait_s=0.0))]


def test_overlap_detector_waits_for_the_straggler_exchange_two_windows_at_most():
    """Before the exchange's first verdict the time waiting for peers is unknown (comm_wait_s
    null): a window then is not judged; a job whose ranks never get one (no c10d store) is judged
    from its third window on, as before."""
    d = OverlapDetector(window=4, threshold=0.8)
    got = [[f for i in range(w * 4, w * 4 + 4) for f in d.observe(rec(i, overlap=0.1, comm_exposed_s=0.03))]
           for w in range(3)]
    assert [len(g) for g in got] == [0, 0, 1]


def test_overlap_detector_leaves_out_the_exposed_time_spent_waiting_for_a_slower_peer():
    """A rank whose peer's DataLoader adds 30 ms a step: 31 ms exposed, 30.6 of them waiting
    for that peer (comm_wait_s). It read "overlapped 0% ... -> Enable gradient_as_bucket_view",
    which cannot help; the slow rank's data_loading finding names the cause."""
    d = OverlapDetector(window=4, threshold=0.8)
    out = [f for i in range(4) for f in d.observe(rec(i, step_s=0.034, overlap=0.0, comm_exposed_s=0.031,
                                                       comm_wait_s=0.0306))]
    assert out == []
    # What is left after the wait still counts, and the summary says how much was waiting.
    d = OverlapDetector(window=4, threshold=0.8)
    (f,) = [f for i in range(4) for f in d.observe(rec(i, step_s=0.1, overlap=0.1, comm_exposed_s=0.04,
                                                         comm_wait_s=0.01))]
    assert ("30.0 ms exposed per step (30% of step time; another 10.0 ms waiting for other ranks, which no "
            "bucket setting changes)") in f.summary
    assert f.data["waiting_s"] == 0.01


def test_baselines_follow_the_reference():
    nv = baseline("NVIDIA H100 80GB HBM3", 8, 1)
    ib = baseline("NVIDIA H100 80GB HBM3", 64, 8)
    assert (nv["256MB"], nv["1GB"], nv["alert"]) == (160.0, 180.0, 140.0)
    assert (ib["256MB"], ib["1GB"], ib["alert"]) == (40.0, 45.0, 35.0)
    assert baseline("NVIDIA A100", 8, 1) is None and baseline(None, 8, 1) is None
    # no NVSwitch on these: not judged against the SXM numbers
    assert baseline("NVIDIA H100 PCIe", 8, 1) is None and baseline("NVIDIA H100 NVL", 2, 1) is None
    assert verdict(170.0, 256 * 2**20, nv) == "ok"
    assert verdict(170.0, 2**30, nv) == "low"
    assert verdict(120.0, 2**30, nv) == "alert"
    assert verdict(10.0, 8 * 2**20, nv) == "n/a"  # below 16 MiB: latency-bound, not judged


def test_smaller_messages_are_judged_against_the_baseline_scaled_by_size():
    """busbw(s) = B * s / (s + s_half) through the sheet's 256 MB and 1 GB points (nccl-tests'
    curve shape); both baselines give the same half-bandwidth size."""
    from stepwatch.comm.findings import MIN_JUDGED_BYTES, _curve, expected

    nv, ib = baseline("NVIDIA H100 80GB HBM3", 8, 1), baseline("NVIDIA H100 80GB HBM3", 64, 8)
    big, half = _curve(nv)
    assert big * 256 * 2**20 / (256 * 2**20 + half) == pytest.approx(160.0)
    assert big * 2**30 / (2**30 + half) == pytest.approx(180.0)
    assert half == pytest.approx(_curve(ib)[1]) and half / 2**20 == pytest.approx(44.5, abs=0.1)
    healthy, alert = expected(25 * 2**20, nv)  # DDP's default bucket
    assert healthy == pytest.approx(67.5, abs=0.2) and alert == pytest.approx(healthy * 140 / 160)
    assert expected(256 * 2**20, nv) == (160.0, 140.0) and expected(2**30, nv) == (180.0, 140.0)
    assert expected(MIN_JUDGED_BYTES - 1, nv) is None and expected(2**30, None) is None
    assert verdict(70.0, 25 * 2**20, nv) == "ok"
    assert verdict(62.0, 25 * 2**20, nv) == "low"
    assert verdict(10.0, 25 * 2**20, nv) == "alert"
    # The scaled numbers keep rising with size, up to the sheet's 256 MB number.
    pts = [expected(s * 2**20, nv)[0] for s in (16, 32, 64, 128, 255)]
    assert pts == sorted(pts) and pts[-1] < 160.0


def test_low_busbw_detector_judges_the_best_spans_once_per_episode():
    d = LowBusbwDetector(baseline("H100", 8, 1), spans=20)
    assert "H100" not in (d.why_not or "") and d.why_not
    bucket = span(ALLREDUCE, 0, 1, 25 * 2**20, world=8)  # healthy >= 67.5 GB/s, alert < 59
    # 18 slow spans (peers late), 2 at full speed: the 90th percentile is healthy.
    for i in range(20):
        d.note(rec(i), bucket, 1.0, 80.0 if i in (3, 11) else 20.0)
    assert d.observe(rec(20)) == [] and d.why_not is None and d.judged == 1
    for i in range(20):  # every span under the alert line: critical
        d.note(rec(20 + i), bucket, 1.0, 30.0)
    out = d.observe(rec(40))
    assert len(out) == 1 and out[0].kind == "low_busbw" and out[0].severity == "critical"
    assert out[0].data["healthy_gbps"] == pytest.approx(67.5, abs=0.2) and "scaled by message size" in out[0].summary
    for i in range(40):  # still low: the same episode
        d.note(rec(40 + i), bucket, 1.0, 30.0)
    assert d.observe(rec(80)) == []
    for i in range(20):
        d.note(rec(80 + i), bucket, 1.0, 75.0)  # healthy: episode over
    for i in range(20):
        d.note(rec(100 + i), bucket, 1.0, 63.0)  # low, above the alert line: a warning
    out = d.observe(rec(120))
    assert len(out) == 1 and out[0].severity == "warning"
    # No judgement possible, said in words.
    small = LowBusbwDetector(baseline("H100", 8, 1))
    small.note(rec(1), span(ALLREDUCE, 0, 1, 2**20, world=8), 1.0, 1.75)
    assert small.observe(rec(1)) == [] and "below 16 MiB" in small.why_not
    none = LowBusbwDetector(None)
    none.note(rec(1), bucket, 1.0, 1.0)
    assert "no healthy busbw baseline" in none.why_not


def test_nccl_warnings_from_the_users_debug_file(tmp_path):
    """No NCCL here (gloo on CPU): the file is written by the test in the format NCCL writes
    (``host:pid:tid [dev] file:line NCCL WARN msg``); everything reading it is the real code."""
    from stepwatch.comm.nccl_log import MAX_DISTINCT, NcclLogWatch, debug_file_path

    assert debug_file_path({}) is None
    assert debug_file_path({"NCCL_DEBUG_FILE": str(tmp_path / "nccl.%h.%p.log")}, host="node7.cluster", pid=42) == \
        str(tmp_path / "nccl.node7.42.log")
    path = tmp_path / "nccl.log"
    t = [0.0]
    w = NcclLogWatch(str(path), rank=3, poll_s=1.0, clock=lambda: t[0])
    assert w.poll() == []  # NCCL has not opened it yet
    path.write_text("node7:4242:4250 [0] NCCL INFO Bootstrap : Using eth0:10.0.0.7<0>\n"
                    "node7:4242:4251 [0] misc/socket.cc:484 NCCL WARN socketStartConnect: Connect to 10.0.0.8<43519> "
                    "failed : Software caused connection abort\n"
                    "node7:4242:4251 [0] transport/net_ib.cc:1295 NCCL WA")
    t[0] = 1.0
    out = w.poll(step=17)
    assert [f.kind for f in out] == ["nccl_warning"]
    f = out[0]
    assert f.rank == 3 and f.step == 17 and "socketStartConnect" in f.summary and f.data["file"] == str(path)
    assert "NCCL_IB_HCA" in f.action
    with open(path, "a") as fh:  # the cut line is completed; the same warning again, other numbers
        fh.write("RN NET/IB : Got completion from peer 10.0.0.9<51234> with error 12\n"
                 "node7:4242:4251 [0] misc/socket.cc:484 NCCL WARN socketStartConnect: Connect to 10.0.0.9<40001> "
                 "failed : Software caused connection abort\n")
    t[0] = 1.5
    assert w.poll() == []  # polled at most every poll_s
    t[0] = 2.0
    out = w.poll()
    assert [f.data["message"][:6] for f in out] == ["NET/IB"]  # once per distinct message
    assert w.status()["warnings"] == 3
    with open(path, "a") as fh:
        for i in range(MAX_DISTINCT + 5):
            fh.write(f"h:1:2 [0] x.cc:1 NCCL WARN distinct message {'x' * (i + 1)}\n")
    t[0] = 3.0
    assert len(w.poll()) == MAX_DISTINCT - 2 and w.status()["unreported"] == 7


# -- bench math --------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 3, 8, 64])
def test_busbw_over_algbw_is_the_ring_factor(n):
    r = row(2**20, 4, "float32", 1e-3, n, None)
    assert r.bus_factor == 2 * (n - 1) / n
    assert r.busbw == r.algbw * r.bus_factor
    assert math.isclose(r.busbw / r.algbw, 2 * (n - 1) / n, rel_tol=1e-15)
    assert bus_factor(ALLREDUCE, n) == 2 * (n - 1) / n


def test_size_options_like_nccl_tests():
    assert parse_size("1M") == 2**20 and parse_size("1G") == 2**30 and parse_size("512") == 512
    assert sizes(2**20, 2**23, 2) == [2**20, 2**21, 2**22, 2**23]
    with pytest.raises(ValueError, match="-b/--minbytes"):
        parse_size("lots", "-b/--minbytes")
    with pytest.raises(ValueError, match="stepfactor"):
        sizes(1, 2, 1)


def test_bench_without_torchrun_says_how_to_run(monkeypatch, capsys):
    from stepwatch.cli import main

    monkeypatch.delenv("RANK", raising=False)
    assert main(["bench-comm", "-b", "1K", "-e", "4K"]) == 2
    assert "torchrun" in capsys.readouterr().err


# -- config ----------------------------------------------------------------------------------


def test_config_fields_parse_and_name_the_variable():
    c = Config.from_env({"STEPWATCH_COMM": "0", "STEPWATCH_STRAGGLER_MARGIN": "0.5", "STEPWATCH_STRAGGLER_EVERY": "10"})
    assert (c.comm, c.straggler_margin, c.straggler_every, c.straggler_windows, c.overlap_threshold) == (
        False, 0.5, 10, 3, 0.8)
    with pytest.raises(ConfigError, match="STEPWATCH_STRAGGLER_WINDOWS"):
        Config.from_env({"STEPWATCH_STRAGGLER_WINDOWS": "0"})
    with pytest.raises(ConfigError, match="STEPWATCH_OVERLAP_THRESHOLD"):
        Config.from_env({"STEPWATCH_OVERLAP_THRESHOLD": "1.5"})


# -- DDP hook patching over a real one-rank gloo group -----------------------------------------


@pytest.fixture
def ddp_hooks():
    from stepwatch.comm.hooks import DDPCommHooks

    errors = []
    col = CommCollector()
    h = DDPCommHooks(col, lambda where, e: errors.append((where, e)))
    h.install()
    try:
        yield h, col, errors
    finally:
        h.uninstall()


def _ddp(**kw):
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    return DDP(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)), **kw)


def test_own_hook_is_registered_at_first_forward_and_times_every_bucket(one_rank_group, ddp_hooks):
    import torch

    h, col, errors = ddp_hooks
    m = _ddp(bucket_cap_mb=0.0001)
    for _ in range(2):
        m(torch.ones(4, 8)).sum().backward()
    got = col.take()["spans"]
    # A span ends in the future's done-callback, which the thread completing the future may run
    # just after backward() has returned (the enricher waits for it the same way).
    deadline = time.monotonic() + 5
    while not all(s.done() for s in got) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(got) >= 2 and all(s.done() and s.op == "allreduce" for s in got)
    assert all(s.nbytes is not None and s.t1 >= s.t0 for s in got)
    assert m.__dict__["_stepwatch_comm"].shim_slot is not None and not errors


def test_user_hook_registered_after_wrapping_runs_and_its_result_is_used(one_rank_group, ddp_hooks):
    import torch

    h, col, errors = ddp_hooks
    m = _ddp()
    calls = []

    def zero_hook(state, bucket):
        calls.append(state)
        fut = torch.futures.Future()
        fut.set_result(torch.zeros_like(bucket.buffer()))
        return fut

    m.register_comm_hook("mine", zero_hook)
    m(torch.ones(4, 8)).sum().backward()
    assert calls == ["mine"]
    assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in m.parameters())  # their result was used
    assert len(col.take()["spans"]) == 1
    assert m._get_ddp_logging_data().get("comm_hook") == "test_user_hook_registered_after_wrapping_runs_and_its_result_is_used.<locals>.zero_hook"


def test_user_hook_after_the_first_forward_replaces_stepwatch_inner_hook(one_rank_group, ddp_hooks):
    import torch

    h, col, errors = ddp_hooks
    m = _ddp()
    m(torch.ones(4, 8)).sum().backward()  # stepwatch's own hook goes in at this forward
    col.take()
    calls = []

    def noop(state, bucket):
        calls.append(1)
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    m.register_comm_hook(None, noop)  # DDP alone would refuse a second hook; the user's must win
    m(torch.ones(4, 8)).sum().backward()
    assert calls == [1] and len(col.take()["spans"]) == 1 and not errors


def test_builtin_hook_passes_through_and_is_reported_unmeasured(one_rank_group, ddp_hooks, caplog):
    import torch
    import torch.distributed as dist

    h, col, errors = ddp_hooks
    m = _ddp()
    m._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
    m(torch.ones(4, 8)).sum().backward()
    assert col.take() is None
    assert h.unmeasured and "builtin" in h.unmeasured[0]


def test_uninstall_restores_ddp():
    from torch.nn.parallel import DistributedDataParallel as DDP

    from stepwatch.comm.hooks import DDPCommHooks

    before = (DDP.register_comm_hook, DDP._register_builtin_comm_hook, DDP._pre_forward)
    h = DDPCommHooks(CommCollector(), lambda *a: None)
    h.install()
    assert DDP._pre_forward is not before[2]
    h.uninstall()
    assert (DDP.register_comm_hook, DDP._register_builtin_comm_hook, DDP._pre_forward) == before


def test_builtin_hook_after_the_first_forward_runs_its_python_equivalent(one_rank_group, ddp_hooks):
    import torch
    import torch.distributed as dist

    h, col, errors = ddp_hooks
    m = _ddp()
    m(torch.ones(4, 8)).sum().backward()
    col.take()
    m._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)  # DDP alone would raise here
    m(torch.ones(4, 8)).sum().backward()
    spans = col.take()["spans"]
    assert [s.hook for s in spans] == ["fp16_compress_hook"] and not errors


def test_timeline_of_one_step_is_written_per_rank_and_rendered(tmp_path):
    from stepwatch.comm.timeline import TimelineWriter, load, render

    e = CommEnricher(timeline=TimelineWriter(str(tmp_path), every=5))
    spans = [span(ALLREDUCE, 20 * MS, 50 * MS, 1000), span(ALLREDUCE, 80 * MS, 120 * MS, 1000)]
    for step in range(5):
        r = rec(step)
        r.rank = 3
        e.enrich(r, {"comm": {"spans": spans}, "backward_spans": [(10 * MS, 130 * MS)]}, force=False)
    snaps = load(str(tmp_path))
    assert [s["step"] for s in snaps] == [4] and snaps[0]["rank"] == 3
    assert snaps[0]["compute_ms"] == [[0.0, 70.0]]  # backward from 10 ms, compute ends at the last issue (80 ms)
    text = render(snaps, width=11)
    row = text.splitlines()[1]
    assert row.endswith("|=###===!!!!|"), text  # 0-110 ms in 11 columns of 10 ms


def test_collector_is_bounded_when_steps_stop_ending(monkeypatch):
    from stepwatch.comm import spans as sp

    monkeypatch.setattr(sp, "MAX_SPANS", 8)
    c = CommCollector()
    for _ in range(20):
        c.end(c.begin(ALLREDUCE, 1, 2, "h"))
    assert len(c.take()["spans"]) == 8 and c.dropped == 12


def test_hook_registered_before_stepwatch_started_is_left_alone(one_rank_group):
    import torch
    import torch.distributed as dist

    from stepwatch.comm.hooks import DDPCommHooks

    m = _ddp()
    m._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)  # before install
    col = CommCollector()
    errors = []
    h = DDPCommHooks(col, lambda where, e: errors.append(e))
    h.install()
    try:
        m(torch.ones(4, 8)).sum().backward()  # no second registration attempt, no error
    finally:
        h.uninstall()
    assert not errors and col.take() is None and "before stepwatch started" in h.unmeasured[0]


def test_a_second_user_hook_is_refused_as_ddp_refuses_it(one_rank_group, ddp_hooks):
    import torch

    h, col, errors = ddp_hooks
    m = _ddp()
    m(torch.ones(4, 8)).sum().backward()

    def noop(state, bucket):
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    m.register_comm_hook(None, noop)
    with pytest.raises(RuntimeError, match="only be called once"):
        m.register_comm_hook(None, noop)


def test_session_wires_comm_and_shutdown_restores_ddp(sw, one_rank_group):
    """Through the public API: records carry the comm fields; shutdown undoes the patches."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    stepwatch, mem, start = sw
    orig = DDP.__dict__["_pre_forward"]
    session = start()
    assert DDP.__dict__["_pre_forward"] is not orig
    # No collective yet: the comm collector is not among the tracker's (no call a step for it).
    assert [c for c in session.tracker.collectors if c.name == "comm"] == []
    m = _ddp()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for _ in range(4):
        m(torch.ones(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
    assert len([c for c in session.tracker.collectors if c.name == "comm"]) == 1  # joined at the first one
    stepwatch.shutdown()
    assert DDP.__dict__["_pre_forward"] is orig
    recs = mem.records
    assert len(recs) >= 3
    for r in recs[1:]:
        assert r.comm_s > 0 and r.allreduce_s > 0 and r.overlap is not None and 0 <= r.overlap <= 1
        assert r.busbw_gbps == 0.0  # one rank: nothing crosses a wire, 2(n-1)/n = 0


def _sgd_steps(m, n, x):
    """``n`` training steps of ``m`` on ``x`` with SGD."""
    import torch

    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for _ in range(n):
        m(x).sum().backward()
        opt.step()
        opt.zero_grad()


def test_a_job_without_collectives_has_no_comm_collector(sw):
    """One process, no process group: the comm feature is on, but its collector never joins the
    step tracker's, so no step calls it; the records' comm fields stay empty."""
    import torch

    stepwatch, mem, start = sw
    session = start()
    _sgd_steps(torch.nn.Linear(8, 1), 3, torch.ones(4, 8))
    names = [c.name for c in session.tracker.collectors]
    stepwatch.shutdown()
    assert "comm" not in names and session.hub is not None
    assert len(mem.records) == 3 and all(r.comm_s is None for r in mem.records)


def test_comm_off_patches_nothing(sw):
    from torch.nn.parallel import DistributedDataParallel as DDP

    stepwatch, mem, start = sw
    orig = DDP.__dict__["_pre_forward"]
    start(comm=False)
    assert DDP.__dict__["_pre_forward"] is orig


def test_collectives_are_numbered_per_process_group():
    """The hang verdict compares a group's sequence numbers across ranks; a rank that also talks
    on other groups (pipeline or tensor parallel) must not shift the numbers of this one."""
    col = CommCollector()
    dp1 = col.begin(ALLREDUCE, 8, 2, "h", group="dp")
    col.begin(ALL_GATHER, 8, 2, "h", group="tp")
    col.begin(ALL_GATHER, 8, 2, "h", group="tp")
    dp2 = col.begin(ALLREDUCE, 8, 2, "h", group="dp")
    assert (dp1.seq, dp2.seq) == (1, 2)


def test_session_surfaces_nccl_warnings_and_never_sets_the_variable(sw, monkeypatch, tmp_path):
    """A real session and training loop; the NCCL debug file is written by the test (no NCCL on
    this CPU machine) where the user's NCCL_DEBUG_FILE points."""
    import torch

    stepwatch, mem, start = sw
    monkeypatch.delenv("NCCL_DEBUG_FILE", raising=False)
    monkeypatch.delenv("NCCL_DEBUG", raising=False)
    start()
    stepwatch.shutdown()
    assert "NCCL_DEBUG_FILE" not in os.environ and "NCCL_DEBUG" not in os.environ  # never set for the user
    log = tmp_path / f"nccl.{socket.gethostname().split('.')[0]}.{os.getpid()}.log"
    log.write_text("n:1:2 [0] transport/net_ib.cc:1295 NCCL WARN NET/IB : Got completion with error 12, opcode 1\n")
    monkeypatch.setenv("NCCL_DEBUG_FILE", str(tmp_path / "nccl.%h.%p.log"))
    mem.findings.clear()
    start(dir=str(tmp_path / "run2"))
    _sgd_steps(torch.nn.Linear(8, 8), 5, torch.randn(4, 8))
    stepwatch.shutdown()
    assert os.environ["NCCL_DEBUG_FILE"] == str(tmp_path / "nccl.%h.%p.log")
    got = [f for f in mem.findings if f.kind == "nccl_warning"]
    assert len(got) == 1 and "Got completion with error" in got[0].summary and got[0].data["file"] == str(log)


def test_take_of_a_step_without_collectives_allocates_nothing():
    """A step with no collective (a single-process job, or the steps between them) hands over None
    and keeps the same list: take() runs every step, and a fresh list each time was an object a
    step for the cyclic GC to count."""
    c = CommCollector()
    buf = c._buf
    assert c.take() is None and c.take() is None and c._buf is buf
    span = c.begin(ALLREDUCE, 64, 2, "test")
    got = c.take()
    assert got == {"spans": [span], "fwd_end_ev": None} and c._buf is not buf and c._buf == []
    assert c.take() is None


def test_a_ddp_bucket_span_is_cut_at_the_end_of_the_backward_that_waited_for_it():
    # gloo's completion callback ran 30 ms after the backward returned (it waits for the GIL);
    # DDP had waited for the bucket before the backward (0-50 ms) returned.
    e = CommEnricher()
    r = rec()
    e.enrich(r, {"comm": {"spans": [span(ALLREDUCE, 40 * MS, 80 * MS, 1_000_000)]}, "backward_spans": [(0, 50 * MS)]},
             force=False)
    assert r.comm_s == pytest.approx(0.010) and r.allreduce_s == pytest.approx(0.010)
    assert r.algbw_gbps == pytest.approx(1e6 / 0.010 / 1e9)
    # An optimizer step inside the backward splits it: the cut is the last segment's end.
    r = rec()
    e.enrich(r, {"comm": {"spans": [span(ALLREDUCE, 20 * MS, 90 * MS)]},
                 "backward_spans": [(0, 30 * MS), (40 * MS, 60 * MS)]}, force=False)
    assert r.comm_s == pytest.approx(0.040)


def test_spans_the_backward_did_not_wait_for_are_not_cut():
    e = CommEnricher()
    # Issued after the backward (a joined rank's shadow AllReduce), or not DDP's (FSDP's
    # reduce-scatter, waited for later): their ends stand.
    r = rec()
    spans = [span(ALLREDUCE, 60 * MS, 80 * MS), span(ALL_GATHER, 10 * MS, 70 * MS)]
    e.enrich(r, {"comm": {"spans": spans}, "backward_spans": [(0, 50 * MS)]}, force=False)
    assert r.comm_s == pytest.approx(0.070) and r.allreduce_s == pytest.approx(0.020)
    # No backward seen: nothing to cut at.
    r = rec()
    e.enrich(r, {"comm": {"spans": [span(ALLREDUCE, 40 * MS, 80 * MS)]}}, force=False)
    assert r.comm_s == pytest.approx(0.040)

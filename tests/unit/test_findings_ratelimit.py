"""Every finding kind is rate-limited in one place (analysis/ratelimit.py): a persistent
condition is one finding per episode with a count, repeated at most every N windows."""

import pytest
import torch
import torch.nn as nn

from stepwatch.analysis.kinds import make_finding
from stepwatch.analysis.ratelimit import FindingLimiter


def _f(kind, step, **data):
    return make_finding(kind, rank=0, step=step, summary=f"{kind} at {step}", data=data)


def test_persistent_condition_is_one_episode_with_repeats_and_a_closing_count():
    lim = FindingLimiter(window=10, repeat_windows=5)
    out = []
    for s in range(200):
        out += lim.filter([_f("nonfinite_grads", s)], now=s)
    out += lim.flush()
    steps = [f.step for f in out]
    assert steps == [0, 50, 100, 150, 199]  # opening, a repeat every 5 windows, the closing one
    assert out[0].data["episode"]["count"] == 1
    assert out[1].data["episode"] == {"count": 51, "first": 0, "last": 50, "held_back": 49, "final": False, "unit": "step"}
    assert out[-1].data["episode"]["final"] and out[-1].data["episode"]["count"] == 200
    assert "episode over: 200 in all over steps 0-199" in out[-1].summary
    assert lim.suppressed == 200 - 4


def test_quiet_for_a_window_ends_the_episode_and_a_new_one_reports_at_once():
    lim = FindingLimiter(window=10, repeat_windows=5)
    got = []
    for s in range(100):
        bad = s < 5 or 40 <= s < 42
        got += lim.filter([_f("grad_norm_spike", s)] if bad else [], now=s)
    kinds = [(f.step, f.data["episode"]["final"], f.data["episode"]["count"]) for f in got]
    # Episode 1 (steps 0-4) opens at 0 and closes once quiet for a window; episode 2 opens at 40.
    assert kinds == [(0, False, 1), (4, True, 5), (40, False, 1), (41, True, 2)]


def test_a_much_worse_finding_inside_an_episode_is_told_at_once_and_the_worst_closes_it():
    """A 9 ms blip opened a step_time_spike episode at step 54 and a 51.8 ms burst came at
    steps 100-103, within the window: the burst was held back, and the closing line was built
    from the episode's last finding (step 103), so step 100 was never shown. A finding at
    least ESCALATE times the episode's worst told (``data["magnitude"]``) is told at once; the
    closing one is the worst held back; a finding without a magnitude is limited as before."""
    lim = FindingLimiter(window=50, repeat_windows=20)
    out = lim.filter([_f("step_time_spike", 54, magnitude=1.8)], now=54)
    out += lim.filter([_f("step_time_spike", 60, magnitude=2.5)], now=60)  # worse, not twice: held
    out += lim.filter([_f("step_time_spike", 100, magnitude=10.4)], now=100)  # >= 2 x 1.8, the worst told: at once
    out += lim.filter([_f("step_time_spike", s, magnitude=m) for s, m in ((101, 9.0), (102, 12.0), (103, 3.0))],
                      now=103)
    out += lim.flush()
    assert [f.step for f in out] == [54, 100, 102]
    assert "[worse than before: 3 over steps 54-100, 1 held back since the last report]" in out[1].summary
    assert out[2].data["episode"]["final"] and "episode over: 6 in all over steps 54-103" in out[2].summary
    assert out[2].data["magnitude"] == 12.0  # the worst held back (12.0 < 2 x 10.4: not told at once)
    # Without a magnitude, or with one that is not a positive number: as before, the last closes.
    lim = FindingLimiter(window=50, repeat_windows=20)
    got = lim.filter([_f("data_loading", 1), _f("data_loading", 2, magnitude=float("nan")),
                      _f("data_loading", 3, magnitude=True), _f("data_loading", 4)], now=4) + lim.flush()
    assert [f.step for f in got] == [1, 4]


def test_the_spike_findings_say_how_bad():
    from stepwatch.analysis.detectors import spike_finding
    from stepwatch.metrics.grads import GradNormSpikeDetector
    from stepwatch.record import StepRecord

    rec = StepRecord(step=7, rank=0, time=0.0, step_s=0.05, data_wait_s=0.0, forward_s=0.02, backward_s=0.02,
                     optimizer_s=0.01, other_s=0.0)
    f = spike_finding(rec, median_s=0.01, mad_s=0.001, limit_s=0.02, collective_median_s=None)
    assert f.data["magnitude"] == pytest.approx(5.0)
    det = GradNormSpikeDetector(1e9, 5.0, 20)
    for s in range(20):
        assert det._finite(s, 1.0, 0, None) is None
    assert det._finite(20, 50.0, 0, None).data["magnitude"] == pytest.approx(50.0)


def test_groups_are_by_kind_rank_and_subject():
    lim = FindingLimiter(window=10, repeat_windows=5)
    a = lim.filter([_f("straggler", 1, subject="ranks 1"), _f("straggler", 1, subject="ranks 2"),
                    _f("data_loading", 1), make_finding("data_loading", rank=1, step=1, summary="x")], now=1)
    assert len(a) == 4
    assert lim.filter([_f("straggler", 2, subject="ranks 1")], now=2) == []


def test_bad_arguments_name_themselves():
    with pytest.raises(ValueError, match="window"):
        FindingLimiter(window=0)
    with pytest.raises(ValueError, match="repeat_windows"):
        FindingLimiter(window=5, repeat_windows=0)


def test_nan_gradients_on_every_step_do_not_flood(sw, capfd):
    """The issue's reproduction: NaN grads on every step gave one finding and one stderr line
    per step. Now: a handful, the last one carrying the episode's count."""
    stepwatch, mem, start = sw
    start(window=10, finding_repeat_windows=5, console="on", grad_norm_every=1)
    p = nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([p], lr=0.0)
    n = 300
    for i in range(n):
        (p * float("nan")).sum().backward()
        opt.step()
        opt.zero_grad()
    stepwatch.shutdown()
    nan = [f for f in mem.findings if f.kind == "nonfinite_grads"]
    assert len(mem.records) == n
    assert 2 <= len(nan) <= n // 50 + 2, [f.step for f in nan]
    assert nan[-1].data["episode"]["final"] and nan[-1].data["episode"]["count"] == n
    err = capfd.readouterr().err
    assert err.count("nonfinite_grads") <= n // 50 + 2


def test_alternating_grad_norm_is_one_spike_episode(sw):
    stepwatch, mem, start = sw
    start(window=10, finding_repeat_windows=5, grad_norm_every=1)
    p = nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([p], lr=0.0)
    for i in range(300):
        (p * (100.0 if i % 2 else 0.01)).sum().backward()  # norm 200 / 0.02 alternately
        opt.step()
        opt.zero_grad()
    stepwatch.shutdown()
    spikes = [f for f in mem.findings if f.kind == "grad_norm_spike"]
    assert 1 <= len(spikes) <= 300 // 50 + 2, len(spikes)
    assert spikes[-1].data["episode"]["count"] >= 140


def test_seconds_positions_for_serve_vllm():
    lim = FindingLimiter(window=300.0, repeat_windows=20, position=lambda f: f.time, unit="s")
    out = []
    for t in range(0, 3 * 3600, 2):  # a TTFT breach every 2 s scrape for 3 hours
        f = make_finding("ttft_slo", rank=0, step=None, summary="p99 high", when=1e9 + t)
        out += lim.filter([f], now=1e9 + t)
    out += lim.flush()
    # The opening, one repeat after 20 windows (6000 s), and the closing count.
    assert [f.time - 1e9 for f in out] == [0, 6000, 3 * 3600 - 2]
    assert out[-1].data["episode"]["count"] == 3 * 3600 // 2 and "over 10798 s" in out[-1].summary


def test_four_bad_data_loading_windows_are_counted_four():
    """The windowed detectors (data_loading, allreduce_not_overlapped, memory_near_limit,
    memory_fragmentation) held back the bad windows after the first themselves, so the rate limit
    had nothing to count: four bad windows read as one, with no closing count. Every bad window is
    a finding now, and the episode's closing line says how many."""
    from stepwatch.analysis.detectors import DataLoadingDetector
    from stepwatch.record import StepRecord

    det = DataLoadingDetector(window=10, threshold_ms=10)
    lim = FindingLimiter(window=10, repeat_windows=20)
    out = []
    for s in range(60):
        rec = StepRecord(step=s, rank=0, time=float(s), step_s=0.05, data_wait_s=0.03 if s < 40 else 0.001)
        out += lim.filter(det.observe(rec), now=s)
    out += lim.flush()
    assert [(f.step, f.data["episode"]["final"]) for f in out] == [(9, False), (39, True)]
    assert out[-1].data["episode"]["count"] == 4
    assert "[episode over: 4 in all over steps 9-39]" in out[-1].summary, out[-1].summary

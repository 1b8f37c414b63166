"""A detector's ``observe_many(records)`` (one call a background pass) gives the findings that
``observe`` a record at a time gives, whatever the passes' sizes; the pipeline calls it where a
detector has one and keeps the findings in the order per-record calls made them."""

import random

import pytest

from stepwatch.analysis.detectors import DataLoadingDetector
from stepwatch.comm.findings import OverlapDetector
from stepwatch.memory.detect import FragmentationDetector, NearLimitDetector
from stepwatch.metrics.grads import GradNormSpikeDetector
from stepwatch.metrics.lowmfu import LowMfuDetector
from stepwatch.metrics.peaks import MfuDropDetector
from stepwatch.record import StepRecord


def records(seed: int, n: int = 3000) -> list[StepRecord]:
    """Steps whose data wait, grad norm, MFU, overlap and memory wander in and out of every
    detector's bad range (spikes, NaN norms, missing MFU, long waits)."""
    rng = random.Random(seed)
    out = []
    bad = False
    t = 1.7e9
    for i in range(n):
        if rng.random() < 0.02:
            bad = not bad
        step_s = rng.uniform(0.01, 0.05)
        t += step_s
        r = StepRecord(step=i, rank=0, time=t, step_s=step_s, data_wait_s=(0.03 if bad else 0.001) * rng.random())
        r.grad_norm = rng.choice([None, float("nan"), float("inf")]) if rng.random() < 0.05 else (
            rng.uniform(50, 100) if bad and rng.random() < 0.3 else rng.uniform(0.5, 1.5))
        r.mfu = None if rng.random() < 0.2 else (rng.uniform(0.05, 0.2) if bad else rng.uniform(0.45, 0.6))
        r.overlap = None if rng.random() < 0.1 else (0.1 if bad else 0.9)
        r.comm_exposed_s = step_s * (0.5 if bad else 0.01)
        r.mem_reserved_bytes = 2 * 2**30
        r.mem_allocated_bytes = (1 if bad else 1.9) * 2**30
        r.mem_fragmentation_bytes = r.mem_reserved_bytes - r.mem_allocated_bytes
        r.mem_device_free_bytes = (0.01 if bad else 20) * 2**30
        out.append(r)
    return out


DETECTORS = {
    "data_loading": lambda: DataLoadingDetector(window=50, threshold_ms=10),
    "grad_norm_spike": lambda: GradNormSpikeDetector(20.0, 10.0, 50),
    "mfu_drop": lambda: MfuDropDetector(points=5.0, window_s=5.0),
    "low_mfu": lambda: LowMfuDetector(0.4, 100),
    "overlap": lambda: OverlapDetector(window=40, threshold=0.5),
    "fragmentation": lambda: FragmentationDetector(window=30),
    "near_limit": lambda: NearLimitDetector(window=30),
}


def per_record(det, recs):
    return [f.to_dict() for r in recs for f in det.observe(r)]


def in_passes(det, recs, rng):
    out, i = [], 0
    while i < len(recs):
        n = rng.choice([1, 2, 7, 49, 50, 51, 100, 500])
        out += [f.to_dict() for f in det.observe_many(recs[i : i + n])]
        i += n
    return out


@pytest.mark.parametrize("name", list(DETECTORS))
def test_observe_many_finds_what_observe_finds(name):
    for seed in range(3):
        recs = records(seed)
        want = per_record(DETECTORS[name](), recs)
        got = in_passes(DETECTORS[name](), recs, random.Random(seed))
        assert got == want
        if seed == 0:
            assert want, f"{name}: the records never trip it; the comparison would prove nothing"


def test_a_window_of_zero_closes_at_every_record_as_observe_does():
    recs = records(4, 200)
    det = DataLoadingDetector(window=0, threshold_ms=10)
    want = per_record(det, recs)
    assert [f.to_dict() for f in DataLoadingDetector(window=0, threshold_ms=10).observe_many(recs)] == want and want


def test_the_pipeline_keeps_per_record_order_and_isolates_a_failing_detector(tmp_path):
    """Three detectors, two with observe_many: the pass's findings come out in step order, each
    step's in the detectors' order, as one call per record and detector made them. A detector
    whose observe_many raises is reported once per pass and costs no other detector a finding;
    one without observe_many that raises on one record loses that record only."""
    from stepwatch._pipeline import Pipeline
    from stepwatch.analysis.kinds import make_finding
    from stepwatch.context import RunContext

    class Every:  # observe only: a finding at each multiple of k; raises at step 13
        def __init__(self, k):
            self.k = k

        def observe(self, rec):
            if rec.step == 13:
                raise RuntimeError("boom")
            return [make_finding("data_loading", rank=0, step=rec.step, summary=f"every {self.k}")] if rec.step % self.k == 0 else []

    class Many(Every):
        def observe_many(self, recs):
            return [f for r in recs if r.step != 13 for f in self.observe(r)]

    class Broken:
        def observe_many(self, recs):
            raise ValueError("broken")

        def observe(self, rec):
            raise AssertionError("observe_many is called instead")

    ctx = RunContext(rank=0, local_rank=0, world_size=1, host="h", run_id="r", run_dir=str(tmp_path))
    p = Pipeline(ctx)
    for d in (Many(3), Broken(), Every(2), Many(5)):
        p.add_detector(d)
    recs = [StepRecord(step=i, rank=0, time=1.0 + i, step_s=0.1) for i in range(30)]
    got = [(f.step, f.summary) for f in p._detect(recs)]
    want = []
    for r in recs:
        for k in (3, 2, 5):
            if r.step != 13 and r.step % k == 0:
                want.append((r.step, f"every {k}"))
    assert got == want
    assert p.failures.counts == {"detector.Broken": 1, "detector.Every": 1}

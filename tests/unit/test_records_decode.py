"""RawStep.to_record and StepRecord.to_dict, built for speed (positionally, with attrgetter),
give what the plain keyword/getattr versions give, field for field and type for type; so does
record.py's ``c_to_record`` (RawStep.to_record in C, stepwatch._speedups, what the pipeline
calls first) wherever it does not leave the step to the method."""

import math
import random

import pytest

from stepwatch import record as record_mod
from stepwatch.record import FINDING_FIELDS, STEP_FIELDS, Finding, RawStep, StepRecord

try:
    from stepwatch import _speedups  # noqa: F401
except ImportError:
    _speedups = None
needs_c = pytest.mark.skipif(_speedups is None, reason="stepwatch._speedups is not built here")


@needs_c
def test_the_c_build_is_bound_where_the_extension_is_built():
    """bind_records found every RawStep and StepRecord field a plain slot (the names in
    _cobjects.h's RAWSTEP_SLOTS among them): a renamed slot would leave every record to the method."""
    assert record_mod.c_to_record is not None


def c_or_method(raw, *args):
    """What the pipeline does: C first, the method for what C leaves to it."""
    rec = record_mod.c_to_record(raw, *args)
    return ("c", rec) if rec is not None else ("method", raw.to_record(*args))


def keyword_to_record(raw, rank, wall_ref, perf_ref_ns, scalar):
    """RawStep.to_record as it was written first: keyword arguments, every dict walked."""
    s = 1e9
    other = max(raw.step_ns - raw.data_ns - raw.forward_ns - raw.backward_ns - raw.optimizer_ns, 0)
    ckpt_s = raw.checkpoint_ns / s
    rec = StepRecord(
        step=raw.step, rank=rank, time=(math.floor(wall_ref * 1e6) + (raw.t_end_ns - perf_ref_ns) // 1000) / 1e6,
        step_s=raw.step_ns / s,
        data_wait_s=raw.data_ns / s, forward_s=raw.forward_ns / s, backward_s=raw.backward_ns / s,
        optimizer_s=raw.optimizer_ns / s, other_s=other / s, eval_s=raw.eval_ns / s, checkpoint_s=ckpt_s,
        phases={k: v / s for k, v in (raw.phases or {}).items()}, scalars={k: scalar(k, v) for k, v in raw.scalars.items()},
        skipped=raw.skipped, mem_peak_bytes=raw.mem_peak_bytes, tail=bool(raw.tail),
    )
    if ckpt_s:
        nbytes = raw.extras.get("checkpoint_bytes")
        rec.checkpoint_bytes = nbytes
        rec.checkpoint_gbps = nbytes / ckpt_s / 1e9 if nbytes else None
    return rec


def test_durations_are_the_nearest_float_to_the_measured_nanoseconds():
    """``ns / 1e9``: the record's seconds have the nanoseconds' own digits (``ns * 1e-9`` is one
    ulp off for about 40% of values: 0.0008977290000000001 instead of 0.000897729)."""
    raw = RawStep(7, 10**12, 3_000_000_000, 897729, 4000001, 1, 12345678, 0, 0, {"fwd": 897729}, {}, False, None, {})
    rec = raw.to_record(0, 1.7e9, 10**12, scalar)
    assert [repr(x) for x in (rec.step_s, rec.data_wait_s, rec.forward_s, rec.backward_s, rec.optimizer_s)] == [
        "3.0", "0.000897729", "0.004000001", "1e-09", "0.012345678"]
    assert repr(rec.phases["fwd"]) == "0.000897729" and repr(rec.other_s) == "2.982756591"


def same(a, b):
    """Equal and of the same type, NaN equal to NaN, -0.0 told from 0.0 (what the records file shows)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return repr(a) == repr(b)
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    return a == b


def scalar(name, v):
    """The pipeline's contract: a float as it is; anything else converted (here: tagged)."""
    return v if type(v) is float else ("converted", name, repr(v))


def test_to_record_matches_the_keyword_version_on_random_steps():
    rng = random.Random(3)
    ns = lambda: rng.choice([0, 1, rng.randint(0, 10**9), rng.randint(0, 10**13)])  # noqa: E731
    for _ in range(3000):
        phases = {f"p{i}": ns() for i in range(rng.choice([0, 0, 1, 3]))} or rng.choice([None, {}])  # None: no phase ran
        scalars = {k: rng.choice([rng.random(), 1.0, float("nan"), 2, True, None, "x", 10**400, -0.0])
                   for k in rng.sample(["loss", "lr", "é", "acc"], rng.choice([0, 1, 2, 4]))}
        ckpt = rng.choice([0, 0, ns()])
        extras = {"checkpoint_bytes": rng.choice([None, 0, 2_000_000_000])} if rng.random() < 0.5 else {}
        raw = RawStep(rng.randint(0, 10**6), ns(), ns(), ns(), ns(), ns(), ns(), ns(), ckpt, phases, scalars,
                      rng.random() < 0.1, rng.choice([None, 123]), extras, rng.choice([False, True, 0, 1, None]))
        args = (rng.randint(0, 7), 1.7e9 + rng.random(), rng.randint(0, 10**13), scalar)
        got, want = raw.to_record(*args), keyword_to_record(raw, *args)
        for f in STEP_FIELDS:
            assert same(getattr(got, f), getattr(want, f)), (f, getattr(got, f), getattr(want, f))
        assert got.phases is not raw.phases and got.scalars is not raw.scalars  # the record's own dicts


@needs_c
def test_the_c_build_matches_the_keyword_version_on_random_steps():
    """Every step C builds is the keyword version's record, field for field and type for type;
    C leaves to the method only the steps with a checkpoint (and, here, a float phase); ``scalar``
    is called once per value that is not a float, in order, by whichever builds the record."""
    rng = random.Random(5)
    ns = lambda: rng.choice([0, 1, rng.randint(0, 10**9), rng.randint(0, 10**13)])  # noqa: E731
    by = {"c": 0, "method": 0}
    for _ in range(4000):
        phases = {f"p{i}": ns() for i in range(rng.choice([0, 0, 1, 3]))} or rng.choice([None, {}])  # None: no phase ran
        if phases and rng.random() < 0.05:
            phases["f"] = 2.5  # not an int: the method's division
        scalars = {k: rng.choice([rng.random(), 1.0, float("nan"), 2, True, None, "x", 10**400, -0.0])
                   for k in rng.sample(["loss", "lr", "é", "acc"], rng.choice([0, 1, 2, 4]))}
        ckpt = rng.choice([0, 0, 0, ns()])
        extras = {"checkpoint_bytes": rng.choice([None, 0, 2_000_000_000])} if rng.random() < 0.5 else {}
        raw = RawStep(rng.randint(0, 10**6), ns(), ns(), ns(), ns(), ns(), ns(), ns(), ckpt, phases, scalars,
                      rng.random() < 0.1, rng.choice([None, 123]), extras, rng.choice([False, True, 0, 1, None]))
        calls = []

        def counted(name, v):
            calls.append(name)
            return scalar(name, v)

        args = (rng.randint(0, 7), 1.7e9 + rng.random(), rng.randint(0, 10**13))
        path, got = c_or_method(raw, *args, counted)
        want = keyword_to_record(raw, *args, scalar)
        by[path] += 1
        assert type(got) is StepRecord
        for f in STEP_FIELDS:
            assert same(getattr(got, f), getattr(want, f)), (path, f, getattr(got, f), getattr(want, f))
        assert got.phases is not raw.phases and got.scalars is not raw.scalars
        assert calls == [k for k, v in scalars.items() if type(v) is not float]
        assert path == "method" if (ckpt or "f" in (phases or {})) else path == "c"
    assert by["c"] > 2500 and by["method"] > 300


@needs_c
def test_the_c_build_leaves_the_unusual_to_the_method_and_raises_what_scalar_raises():
    c = record_mod.c_to_record

    def raw(**kw):
        fields = dict(step=1, t_end_ns=10**12, step_ns=5000, data_ns=1000, forward_ns=1000, backward_ns=1000,
                      optimizer_ns=1000, eval_ns=0, checkpoint_ns=0, phases={}, scalars={"loss": 0.5}, skipped=False,
                      mem_peak_bytes=None, extras={})
        fields.update(kw)
        return RawStep(**fields)

    args = (0, 1.7e9, 10**12, scalar)
    assert c(raw(), *args) is not None
    # No user phase ran: the tracker hands over None (no dict a step), which both build as {}.
    assert c(raw(phases=None), *args) == raw(phases=None).to_record(*args) and c(raw(phases=None), *args).phases == {}
    for odd in (dict(step_ns=5000.0), dict(t_end_ns=2**70), dict(data_ns=True), dict(phases=[]),
                dict(scalars=[]), dict(checkpoint_ns=5)):
        assert c(raw(**odd), *args) is None, odd  # the method then builds it (or raises as it always did)

    class Sub(RawStep):
        __slots__ = ()

    sub = Sub(*[getattr(raw(), n) for n in RawStep.__slots__])
    assert c(sub, *args) is None
    assert c(raw(), 0, 17, 10**12, scalar) is None  # wall_ref not a float
    unset = RawStep.__new__(RawStep)
    assert c(unset, *args) is None

    def boom(name, v):
        raise ValueError(f"cannot convert {name}")

    with pytest.raises(ValueError, match="cannot convert lr"):
        c(raw(scalars={"loss": 0.5, "lr": 3}), 0, 1.7e9, 10**12, boom)
    rec = c(raw(tail=1, step_ns=10, data_ns=100), *args)
    assert rec.tail is True and rec.other_s == 0.0 and rec.clock == "host" and rec.gpu is None


def test_to_dict_is_every_field_in_order():
    rec = StepRecord(step=1, rank=2, time=3.0, step_s=0.5, scalars={"loss": math.pi}, gpu={"util": 1}, tail=True)
    d = rec.to_dict()
    assert list(d) == list(STEP_FIELDS) and all(d[f] is getattr(rec, f) for f in STEP_FIELDS)
    f = Finding(1.0, 2, 0, "data_loading", "warning", "s", "d", "a", {"x": 1})
    fd = f.to_dict()
    assert list(fd) == list(FINDING_FIELDS) and all(fd[k] is getattr(f, k) for k in FINDING_FIELDS)
    assert StepRecord.from_dict(d) == rec and Finding.from_dict(fd) == f

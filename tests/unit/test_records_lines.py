"""The records file's step lines (exporters/records.py ``step_line``): a template per shape of
record, byte-identical to ``dumps(rec.to_dict())`` (and to json.dumps with the records file's
settings) for every record: edge values, unusual types, and a few thousand random records. Every
test runs twice: with the template filled in C (stepwatch._speedups, as installed) and with the
pure-Python template alone (as where the extension could not be built)."""

import enum
import json
import math
import random

import pytest

from stepwatch.exporters import records as records_mod
from stepwatch.exporters.records import _clean, dumps, step_line
from stepwatch.record import STEP_FIELDS, RawStep, StepRecord

NAN, INF = float("nan"), float("inf")


@pytest.fixture(autouse=True, params=["c", "python"])
def fresh_shapes(request, monkeypatch):
    """Each test starts with no templates (the cache is bounded: a full one sends lines to dumps),
    with the C filler or without it."""
    monkeypatch.setattr(records_mod, "_SHAPES", {})
    monkeypatch.setattr(records_mod, "_last", None)
    if request.param == "python":
        monkeypatch.setattr(records_mod, "_fill", None)
    elif records_mod._fill is None:
        pytest.skip("stepwatch._speedups is not built here (no C compiler at install)")
    return request.param


def reference(rec):
    """What the records file wrote for a record before step_line: json.dumps of the record's
    fields in order, non-finite floats as strings. ("ok", line) or ("raises", type, message)."""
    d = {name: getattr(rec, name) for name in STEP_FIELDS}
    try:
        try:
            return ("ok", json.dumps(d, separators=(",", ":"), allow_nan=False, default=str))
        except ValueError:
            return ("ok", json.dumps(_clean(d), separators=(",", ":"), default=str))
    except Exception as e:  # noqa: BLE001 - the same failure is expected of step_line
        return ("raises", type(e), str(e))


def outcome(fn, rec):
    try:
        return ("ok", fn(rec))
    except Exception as e:  # noqa: BLE001
        return ("raises", type(e), str(e))


def check(rec):
    got = outcome(step_line, rec)
    assert got == outcome(lambda r: dumps(r.to_dict()), rec)
    assert got == reference(rec)
    return got


class Color(enum.IntEnum):
    RED = 1


class MyFloat(float):
    def __repr__(self):
        return "MyFloat!"


class MyInt(int):
    def __repr__(self):
        return "MyInt!"


class MyStr(str):
    pass


class Opaque:
    def __str__(self):
        return 'opaque "thing" é'

    def __repr__(self):  # a test id without an address: the same in every collecting process
        return "Opaque()"


def base(**kw):
    d = dict(step=7, rank=1, time=1.7e9 + 0.123456789, step_s=3.0400000000000004e-4, data_wait_s=7.185400000000001e-05,
             forward_s=4.2580000000000006e-06, scalars={"loss": 0.25})
    d.update(kw)
    return StepRecord(**d)


EDGE_FLOATS = [0.0, -0.0, 1e-300, 1e300, 5e-324, 1.7976931348623157e308, 0.1, -2.5, NAN, INF, -INF]
EDGE_VALUES = EDGE_FLOATS + [
    None, 0, -1, 2**64 + 1, -(2**70), 10**100, True, False, "", "host", 'q"uote\\back\nnl\t', "é ü 😀 \u2028",
    "%s %r %% %(x)s", "50%% off", {}, {"a": 1.0}, {"n": NAN}, {"in": {"deep": [1, INF, {"x": -INF}]}}, [1, 2.5, None],
    (1, "t"), Color.RED, MyFloat(1.5), MyInt(3), MyStr("sub"), Opaque(), {"é\"%": {"k\n": [True, None]}},
    {1: "int key", 2.5: "float key", True: "bool key", None: "none key"}, range(3),
]


@pytest.mark.parametrize("field", STEP_FIELDS)
def test_every_field_with_every_edge_value(field):
    for v in EDGE_VALUES:
        rec = base()
        setattr(rec, field, v)
        check(rec)


@pytest.mark.parametrize("v", EDGE_VALUES, ids=repr)
def test_edge_values_inside_the_dict_fields(v):
    for field in ("phases", "scalars", "gpu"):
        check(base(**{field: {"x": v, "é\"%s": v, "ok": 1.0}}))
        check(base(**{field: {"nested": {"v": v}, "list": [v, v]}}))


def test_non_finite_floats_are_strings_as_before():
    ok, line = check(base(grad_norm=NAN, mfu=INF, hfu=-INF, scalars={"loss": NAN}, gpu={"t": [INF]}))
    assert ok == "ok"
    d = json.loads(line)
    assert (d["grad_norm"], d["mfu"], d["hfu"], d["scalars"]["loss"], d["gpu"]["t"]) == ("nan", "inf", "-inf", "nan", ["inf"])
    # a line after a non-finite one is written by the fast path again, and is right
    check(base())
    # finite floats whose sum overflows take the general path, and are still right
    check(base(step_s=1.7e308, time=1.7e308))


def test_what_json_cannot_write_fails_as_before():
    assert check(base(scalars={(1, 2): 1.0}))[0] == "raises"  # keys must be str, int, float, bool or None
    assert check(base(tokens=10**5000))[0] == "raises"  # past int's str-digits limit
    circular = {}
    circular["self"] = circular
    assert check(base(gpu=circular))[0] == "raises"
    check(base())  # and the next line is right


def test_a_subclass_keeps_its_own_to_dict():
    class Custom(StepRecord):
        __slots__ = ()

        def to_dict(self):
            return {"custom": True}

    assert step_line(Custom(step=1, rank=0, time=1.0, step_s=0.1)) == '{"custom":true}'


def test_many_shapes_past_the_cache_bound_stay_right():
    for i in range(3 * records_mod._MAX_SHAPES):
        check(base(clock=f"clock-{i}", mfu_dtype=random.choice([None, "bf16", "fp32"]), skipped=bool(i % 2)))
    assert len(records_mod._SHAPES) == records_mod._MAX_SHAPES


def random_value(rng, depth=0):
    r = rng.random()
    if r < 0.25:
        return None
    if r < 0.55:
        return rng.choice([rng.uniform(-1e6, 1e6), rng.random() * 1e-6, rng.randint(1, 10**9) * 1e-9, rng.choice(EDGE_FLOATS)])
    if r < 0.7:
        return rng.choice([rng.randint(-(2**80), 2**80), rng.randint(0, 1000), 0])
    if r < 0.78:
        return rng.choice([True, False])
    if r < 0.86:
        return rng.choice(["host", "device", "bf16", "", 'a"b', "é😀", "%d%%", "%%", "\x00\x1f"])
    if r < 0.97 and depth < 2:
        keys = ["loss", "lr", "é", 'q"', "%s", "a\nb", "😀", "x" * 30]
        return {rng.choice(keys): random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))}
    if depth < 2:
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return rng.choice([Color.RED, MyFloat(2.0), MyInt(5), MyStr("s"), Opaque(), (1, 2)])


def test_thousands_of_random_records():
    rng = random.Random(16)
    for i in range(4000):
        if i % 32 == 0:
            records_mod._SHAPES.clear()  # most records here have a shape of their own
        raw = RawStep(rng.randint(0, 10**6), rng.randint(0, 10**15), *[rng.randint(0, 10**8) for _ in range(7)],
                      {"p": rng.randint(0, 10**7)} if rng.random() < 0.3 else {},
                      {"loss": rng.random()} if rng.random() < 0.8 else {}, rng.random() < 0.1, None, {},
                      rng.random() < 0.05)
        rec = raw.to_record(rng.randint(0, 7), 1.7e9 + rng.random(), rng.randint(0, 10**15), lambda k, v: v)
        for field in rng.sample(STEP_FIELDS, rng.randint(0, 12)):  # a few fields anything at all
            setattr(rec, field, random_value(rng))
        check(rec)


def test_realistic_records_take_the_template(monkeypatch):
    """The common record (no NaN, plain types) is written by its template, never by dumps."""
    recs = [base(), base(phases={"fwd": 1e-3}, mfu=0.41, mfu_dtype="bf16", tokens=4096, gpu={"util": 97.0}),
            base(skipped=True, tail=True, clock="device", scalars={}, grad_norm=1.25)]
    want = [reference(r)[1] for r in recs]

    def no_dumps(d):
        raise AssertionError("dumps called")

    monkeypatch.setattr(records_mod, "dumps", no_dumps)
    assert [step_line(r) for r in recs] == want
    assert [step_line(r) for r in recs] == want  # from the cached templates
    assert len(records_mod._SHAPES) == 3


@pytest.mark.parametrize("fresh_shapes", ["c"], indirect=True)
def test_a_line_of_the_last_shape_is_filled_in_c(fresh_shapes, monkeypatch):
    """After the first line of a shape (the Python template, which makes it), the next records of
    that shape are written by _speedups.fill alone; a record of another shape is declined by it
    and written right by its own template."""
    first, same, other = base(), base(step=8, scalars={"loss": 0.5, "lr": 1e-3}), base(grad_norm=2.0)
    want = [reference(r)[1] for r in (first, same, other)]
    python_lines = []
    real_line = records_mod._StepTemplate.line

    def counted(self, vals):
        python_lines.append(vals[0])
        return real_line(self, vals)

    monkeypatch.setattr(records_mod._StepTemplate, "line", counted)
    monkeypatch.setattr(records_mod, "dumps", lambda d: pytest.fail("dumps called"))
    assert [step_line(r) for r in (first, same, same, other, other)] == [want[0], want[1], want[1], want[2], want[2]]
    assert python_lines == [7, 7]  # the first of each shape; step 8 twice and the second "other" in C


@pytest.mark.parametrize("fresh_shapes", ["c"], indirect=True)
def test_fill_declines_what_it_cannot_write_and_raises_nothing(fresh_shapes):
    fill = records_mod._fill
    rec = base()
    assert step_line(rec) == reference(rec)[1]
    t = records_mod._last
    vals = records_mod._VALUES(rec)
    enc = records_mod._enc
    assert fill(vals, t.spec, t.pieces, enc) == reference(rec)[1]
    assert fill(vals, t.spec, t.pieces[:-1], enc) is None  # pieces must be one longer than vals
    assert fill(vals[:-1], t.spec, t.pieces, enc) is None
    assert fill(list(vals), t.spec, t.pieces, enc) is None
    assert fill(vals, t.spec, t.pieces) is None
    if records_mod._FILL_READS_RECORD:  # the record itself, its slots read in place
        assert fill(rec, t.spec, t.pieces, enc) == reference(rec)[1]
        assert fill(StepRecord.__new__(StepRecord), t.spec, t.pieces, enc) is None  # unset slots

        class Sub(StepRecord):
            __slots__ = ()

        assert fill(Sub(**rec.to_dict()), t.spec, t.pieces, enc) is None  # only StepRecord itself

    def boom(v):
        raise RuntimeError("encoder failed")

    odd = list(vals)
    odd[STEP_FIELDS.index("scalars")] = {"é": 0.25}  # a key json escapes: this dict goes through enc
    odd = tuple(odd)
    assert fill(odd, t.spec, t.pieces, enc) == reference(base(scalars={"é": 0.25}))[1]
    assert fill(odd, t.spec, t.pieces, boom) is None  # enc's error is swallowed
    assert fill(odd, t.spec, t.pieces, lambda v: "é") is None  # not ASCII: not what json writes
    assert fill(vals, t.spec, (*t.pieces[:-1], "}é"), enc) is None
    nan = list(vals)
    nan[STEP_FIELDS.index("step_s")] = NAN
    assert fill(tuple(nan), t.spec, t.pieces, enc) is None  # json writes "nan": dumps does that
    big = list(vals)
    big[STEP_FIELDS.index("step")] = 2**70  # past long long: int's own repr
    assert fill(tuple(big), t.spec, t.pieces, enc) == reference(base(step=2**70))[1]
    huge = list(vals)
    huge[STEP_FIELDS.index("step")] = 10**5000  # int's repr raises past the digits limit
    assert fill(tuple(huge), t.spec, t.pieces, enc) is None
    long_line = base(scalars={f"k{i}": float(i) for i in range(2000)})  # past the 4 KB stack buffer
    assert step_line(long_line) == reference(long_line)[1]
    assert step_line(long_line) == reference(long_line)[1]


@pytest.mark.parametrize("fresh_shapes", ["c"], indirect=True)
def test_durations_are_laid_out_as_repr_writes_them(fresh_shapes):
    """fill writes a float that is k / 1e9 (a duration: record.py's ns / 1e9) from k's digits
    instead of through dtoa; that must be repr's text for every such float, and any other float
    must be left to dtoa (None)."""
    def ns_float_repr(d):
        return speedups.decimal_repr(d, 9)

    from stepwatch import _speedups as speedups
    rng = random.Random(9)
    ks = [1, 9, 10, 99, 100, 999, 1000, 12345, 10**5, 10**6, 897729, 10**8, 10**9, 10**9 + 1, 12 * 10**9,
          10**14, 10**15 - 1, 2**53 // 10**3, 123456789012345]
    ks += [rng.randint(1, 10**rng.randint(1, 15)) for _ in range(200_000)]
    ks += [rng.randint(1, 999) * 10**rng.randint(0, 12) for _ in range(20_000)]  # trailing zeros
    for k in ks:
        if k >= 10**15:
            continue
        d = k / 1e9
        assert ns_float_repr(d) == repr(d), (k, d)
    for d in (0.0, -0.0, -1e-9, 1e6, 1e15, 1.5e-10, 0.1 + 0.2, 1 / 3, 1796212208.3311696, 2.5e-10, 5e-324,
              float("nan"), float("inf")):
        got = ns_float_repr(d)
        assert got is None or got == repr(d), d
    for _ in range(100_000):  # random doubles: repr's text or left to dtoa, never anything else
        d = rng.uniform(0, 1e6) if rng.random() < 0.5 else rng.random() * 10**rng.randint(-9, 5)
        got = ns_float_repr(d)
        assert got is None or got == repr(d), d
    assert ns_float_repr(0.1 + 0.2) is None and ns_float_repr(1 / 3) is None


@pytest.mark.parametrize("fresh_shapes", ["c"], indirect=True)
def test_wall_times_are_laid_out_as_repr_writes_them(fresh_shapes):
    """A record's ``time`` is whole microseconds / 1e6 (record.py); fill writes it from those
    16 digits instead of through dtoa (a 17-digit repr cost about a microsecond a line). That
    must be repr's text for every wall time from 2001 to 2242 (2**33 s) and for small ones, and
    any other float must be left to dtoa (None)."""
    from stepwatch import _speedups as speedups
    rng = random.Random(11)
    ks = [10**15, 10**15 + 1, 2**33 * 10**6 - 1, 1796400555773568, 1796400555000000, 1796400555100000, 1, 10, 999999]
    ks += [rng.randint(10**15, 2**33 * 10**6 - 1) for _ in range(200_000)]
    ks += [rng.randint(1, 10**15 - 1) for _ in range(50_000)]
    ks += [rng.randint(10**9, 8 * 10**9) * 10**rng.randint(0, 6) // 10**6 * 10**6 for _ in range(20_000)]  # trailing zeros
    for k in ks:
        d = k / 1e6
        if d >= 2**33:
            continue
        assert speedups.decimal_repr(d, 6) == repr(d), (k, d)
    for d in (2.0**33, 9e9, 1e16, 1796212208.3311696, 0.1 + 0.2, -1.0, 0.0, float("nan"), float("inf")):
        got = speedups.decimal_repr(d, 6)
        assert got is None or got == repr(d), d
    for _ in range(100_000):  # random doubles: repr's text or left to dtoa, never anything else
        d = rng.uniform(1e9, 2**33) if rng.random() < 0.5 else rng.random() * 10**rng.randint(-6, 10)
        got = speedups.decimal_repr(d, 6)
        assert got is None or got == repr(d), d
    assert speedups.decimal_repr(1796212208.3311696, 6) is None  # 17 digits: dtoa's
    with pytest.raises(ValueError, match="p must be 9 or 6"):
        speedups.decimal_repr(1.0, 3)


@pytest.mark.parametrize("fresh_shapes", ["c"], indirect=True)
def test_plain_dicts_are_written_in_c_as_json_writes_them(fresh_shapes):
    """fill writes a scalars/phases/gpu dict itself when its keys are strs json writes as they are
    and its values exact finite floats, ints, bools or None (the common scalars dict); any other
    dict goes to json's encoder whole. Both must give json's bytes. The first test below fails
    when the encoder is called for a plain dict (the C path not taken)."""
    step_line(base(gpu={"util": 97.0}))  # the template of this shape: later lines of it are filled in C
    t = records_mod._last
    calls = []

    def enc(v):
        calls.append(v)
        return records_mod._enc(v)

    plain = [
        {"loss": 0.25}, {"lr": 1e-3, "loss": 2.5, "step": 7, "neg": -(2**62), "ok": True, "no": False, "none": None},
        {" ~!#$%&'()*+,-./09:;<=>?@AZ[]^_`az{|}": 0.0, "": -0.0, "tiny": 5e-324, "big": 1.7976931348623157e308},
        {"ns": 897729 / 1e9, "ms": 0.000123, "k": 1e-9, "x": 12.0, "y": 1e22, "z": -1.5e-7},
    ]
    for d in plain:
        for field in ("scalars", "phases", "gpu"):
            rec = base(**{"gpu": {"util": 97.0}, field: d})
            want = reference(rec)[1]
            vals = records_mod._VALUES(rec)
            assert fill_or_none(t, vals, enc) == want, d
    assert calls == []
    odd = [
        {"x": NAN}, {"x": INF}, {"q\"": 1.0}, {"b\\": 1.0}, {"nl\n": 1.0}, {"del\x7f": 1.0}, {"é": 1.0},
        {"x": 2**64 + 1}, {"x": MyFloat(1.5)}, {"x": MyInt(3)}, {"x": Color.RED}, {"x": [1.0]}, {"x": {"y": 1.0}},
        {1: 1.0}, {"ok": 1.0, "later odd": "str"},
    ]
    for d in odd:
        rec = base(scalars=d, gpu={"util": 97.0})
        calls.clear()
        vals = records_mod._VALUES(rec)
        got = fill_or_none(t, vals, enc)
        assert calls == [d], d  # the whole dict, once, to json's encoder
        ref = reference(rec)
        assert got is None or ("ok", got) == ref, d  # None: step_line takes its other path
        check(rec)


def fill_or_none(t, vals, enc):
    return records_mod._fill(vals, t.spec, t.pieces, enc)

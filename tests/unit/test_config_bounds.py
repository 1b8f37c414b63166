"""Config bounds: every number is bounded at parse time, and the message names the variable and
the valid range (values that passed before broke the job later: an OverflowError in a deque, a
step number past int64, seven false hangs in 17 s)."""

import dataclasses

import pytest

from stepwatch.config import Config, ConfigError, valid_values

NUMERIC = [f for f in dataclasses.fields(Config)
           if f.metadata.get("env") and any(t in str(f.type) for t in ("int", "float"))]


def test_every_numeric_variable_is_covered():
    assert len(NUMERIC) >= 25  # the test below really walks the whole table


@pytest.mark.parametrize("f", NUMERIC, ids=lambda f: f.metadata["env"])
@pytest.mark.parametrize("huge", ["1" * 40, "1e40"])
def test_a_huge_value_is_refused_naming_the_variable_and_the_range(f, huge):
    var = f.metadata["env"]
    with pytest.raises(ConfigError) as e:
        Config.from_env({var: huge})
    msg = str(e.value)
    assert var in msg and _upper(var) in msg, msg


def _upper(var):
    """The upper bound as the README's "Valid" column writes it."""
    v = valid_values(var)
    return (v.split("<=")[-1] if "<=" in v else v.split("..")[-1]).split(",")[0].strip()


@pytest.mark.parametrize("f", NUMERIC, ids=lambda f: f.metadata["env"])
def test_the_documented_upper_bound_itself_is_accepted(f):
    var = f.metadata["env"]
    hi = _upper(var).replace("_", "")
    got = Config.from_env({var: hi})
    assert float(getattr(got, f.name)) == float(hi)


@pytest.mark.parametrize("kwargs, words", [
    ({"window": 1e20}, ["window", "<= 100_000"]),
    ({"window": 10**20}, ["window", "<= 100_000"]),
    ({"step_offset": 2**63}, ["step_offset", "<= 9_007_199_254_740_992"]),
    ({"queue_size": float("inf")}, ["queue_size"]),
    ({"hang_timeout": 0.001}, ["hang_timeout", ">= 1"]),
    ({"flush_interval_s": 1e-9}, ["flush_interval_s", ">= 0.01"]),
])
def test_init_arguments_are_bounded_too(kwargs, words):
    with pytest.raises(ConfigError) as e:
        Config.from_env({}, **kwargs)
    for w in words:
        assert w in str(e.value), str(e.value)


def test_the_values_from_the_issue_fail_at_parse_time():
    for var, raw in (("STEPWATCH_WINDOW", "99999999999999999999"), ("STEPWATCH_STEP_OFFSET", str(2**63)),
                     ("STEPWATCH_HANG_TIMEOUT", "0.001")):
        with pytest.raises(ConfigError, match=var):
            Config.from_env({var: raw})
    assert Config.from_env({"STEPWATCH_HANG_TIMEOUT": "2.5"}).hang_timeout == 2.5


def test_a_misspelled_variable_is_named_with_the_setting_it_resembles(caplog):
    """``STEPWATCH_STEP_BOUNDRY=explicit`` was ignored without a word: the job ran with the
    default boundary. Now one line names it and the closest setting; stepwatch's own variables
    between its processes are no settings, and say nothing."""
    import logging

    from stepwatch.config import Config

    env = {"STEPWATCH_STEP_BOUNDRY": "explicit", "STEPWATCH_RUN_ACTIVE": "1", "STEPWATCH_DIR": "/tmp/x",
           "STEPWATCH_ZZZ_TEST_UNLIKELY": "1"}
    with caplog.at_level(logging.WARNING, logger="stepwatch"):
        cfg = Config.from_env(env)
    lines = [r.getMessage() for r in caplog.records]
    assert cfg.step_boundary == "auto"
    assert any("STEPWATCH_STEP_BOUNDRY is not a stepwatch setting" in m and "did you mean STEPWATCH_STEP_BOUNDARY?" in m
               for m in lines), lines
    assert any("STEPWATCH_ZZZ_TEST_UNLIKELY is not a stepwatch setting" in m for m in lines), lines
    assert not [m for m in lines if "STEPWATCH_RUN_ACTIVE" in m or "STEPWATCH_DIR" in m], lines


def test_exporters_must_be_exporter_instances_named_by_position(sw):
    """A class, a function or a string in ``exporters`` was accepted, then failed at the first
    export on the background thread with an internal-error traceback. Refused at init, naming the
    argument and the item; one exporter alone is a list of one."""
    import stepwatch

    stepwatch_mod, mem, start = sw

    class S(stepwatch.Exporter):
        def export(self, batch):
            pass

    for bad, says in [([S], "did you mean S()?"), ([print], "item 0"), ("x", "list of exporter instances"),
                      ([mem, object()], "item 1")]:
        with pytest.raises(stepwatch.ConfigError, match="exporters") as e:
            start(exporters=bad)
        assert says in str(e.value)
    start(exporters=mem)  # one exporter, not in a list
    stepwatch_mod.shutdown()


def test_an_on_off_setting_takes_a_bool_and_its_usual_spellings():
    """``init(console=False)`` was refused (only auto/on/off): the first thing a user tries."""
    assert Config.from_env({}, console=False).console == "off"
    assert Config.from_env({}, console=True).console == "on"
    assert Config.from_env({"STEPWATCH_CONSOLE": "0"}).console == "off"
    assert Config.from_env({"STEPWATCH_CONSOLE": "Yes"}).console == "on"
    with pytest.raises(ConfigError, match="STEPWATCH_CONSOLE='maybe'.*auto, on, off"):
        Config.from_env({"STEPWATCH_CONSOLE": "maybe"})


def test_a_console_rank_the_job_does_not_have_is_said(sw, caplog):
    """``STEPWATCH_CONSOLE_RANK`` at or above the world size: no console and no word about it."""
    import logging

    import torch

    stepwatch, _, start = sw
    logging.getLogger("stepwatch").addHandler(caplog.handler)
    try:
        start(console="on", console_rank=3)
        m = torch.nn.Linear(2, 1)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        m(torch.randn(2, 2)).sum().backward()
        opt.step()
        stepwatch.shutdown()
    finally:
        logging.getLogger("stepwatch").removeHandler(caplog.handler)
    said = [r.getMessage() for r in caplog.records if "CONSOLE_RANK" in r.getMessage()]
    assert len(said) == 1 and "1 rank(s)" in said[0], said


INTEGER = [f for f in dataclasses.fields(Config)
           if f.metadata.get("env") and "int" in str(f.type) and "float" not in str(f.type)]


@pytest.mark.parametrize("f", INTEGER, ids=lambda f: f.name)
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan"), 8.5, 8080.7, True, False, "8.5"],
                         ids=repr)
def test_an_integer_argument_that_is_no_integer_is_refused_naming_it(f, bad):
    """``init(prometheus_port=float('inf'))`` raised a bare OverflowError and ``8080.7`` became
    8080, where ``queue_size=16.5`` was refused: every integer setting is parsed the same way."""
    with pytest.raises(ConfigError) as e:
        Config.from_env({}, **{f.name: bad})
    assert f"{f.name}=" in str(e.value), str(e.value)


@pytest.mark.parametrize("f", INTEGER, ids=lambda f: f.name)
def test_an_integer_argument_given_as_a_whole_float_is_that_integer(f):
    v = f.default if f.default is not None else 8080
    got = getattr(Config.from_env({}, **{f.name: float(v)}), f.name)
    assert got == v and type(got) is int


ON_OFF = [f for f in dataclasses.fields(Config) if f.metadata.get("env")
          and (str(f.type) == "bool" or {"`on`", "`off`"} <= set(valid_values(f.metadata["env"]).split()))]


@pytest.mark.parametrize("f", ON_OFF, ids=lambda f: f.name)
def test_every_on_off_argument_takes_1_and_0_as_its_valid_column_says(f):
    """``init(memory=0)`` was refused ("expected True or False") while ``console=1`` was taken."""
    assert len(ON_OFF) >= 15
    assert getattr(Config.from_env({}, **{f.name: 1}), f.name) in (True, "on")
    assert getattr(Config.from_env({}, **{f.name: 0}), f.name) in (False, "off")
    for bad in (2, -1, 1.0, 0.0, 0.5):
        with pytest.raises(ConfigError) as e:
            Config.from_env({}, **{f.name: bad})
        assert f"{f.name}=" in str(e.value), str(e.value)


@pytest.mark.parametrize("value", ["np.float32(5.5)", "Fraction(11, 2)", "Decimal('5.5')"])
def test_a_number_with_a_fraction_is_refused_for_an_integer_setting_whatever_its_type(value):
    """``window=np.float32(5.5)``, a ``Fraction`` or a ``Decimal`` became 5 silently, where the float
    5.5 is refused."""
    from decimal import Decimal  # noqa: F401
    from fractions import Fraction  # noqa: F401

    import numpy as np  # noqa: F401

    with pytest.raises(ConfigError, match="window"):
        Config.from_env({}, window=eval(value))
    assert Config.from_env({}, window=eval(value.replace("5.5", "5").replace("11, 2", "5, 1"))).window == 5


@pytest.mark.parametrize("value", [True, 123, 1.5])
def test_a_run_directory_that_is_not_a_path_is_refused(value):
    """``dir=True`` ran into ``./True``, ``dir=123`` into ``./123``: accepted as text."""
    with pytest.raises(ConfigError, match="dir"):
        Config.from_env({}, dir=value)


def test_a_run_directory_given_as_bytes_or_a_path_object_is_that_path(tmp_path):
    """``dir=b"/abs/path"`` ran into a relative folder named ``b'/abs/path'``."""
    import os

    assert Config.from_env({}, dir=os.fsencode(str(tmp_path))).dir == str(tmp_path)
    assert Config.from_env({}, dir=tmp_path).dir == str(tmp_path)


def test_a_prometheus_host_of_none_is_the_default():
    """``init(prometheus_host=None)`` bound to the host name "None" (a warning, no endpoint), where
    every other optional setting takes None as its default."""
    assert Config.from_env({}, prometheus_host=None).prometheus_host == "127.0.0.1"
    assert Config.from_env({}, prometheus_host=" ").prometheus_host == "127.0.0.1"
    assert Config.from_env({}, prometheus_host="0.0.0.0").prometheus_host == "0.0.0.0"

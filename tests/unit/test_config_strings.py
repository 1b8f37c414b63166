"""Text settings (paths, names, hosts): a value no path or name can hold, or one that is no text,
is a ConfigError naming the argument or variable, at init; not a ValueError from deep inside
the session (a NUL byte), nor its ``str()`` taken as the value (``run_id=b"job7"`` became
``"b'job7'"``, ``gpu_device=True`` ``"True"``)."""

from __future__ import annotations

import logging
import os
import pathlib
import subprocess
import sys

import pytest

from stepwatch.config import Config, ConfigError

TEXT_ARGS = ("run_id", "prometheus_host", "gpu_device")
NUL_ARGS = ("dir", "tensorboard", *TEXT_ARGS)


@pytest.mark.parametrize("name", NUL_ARGS)
def test_a_nul_byte_in_a_text_or_path_argument_is_refused_naming_it(name, tmp_path):
    """``init(dir="/tmp/sw\\0run")`` died of ``ValueError: embedded null byte`` from os.stat in
    ``_files.private_run_dir``, the training script with it."""
    with pytest.raises(ConfigError) as e:
        Config.from_env({}, **{name: str(tmp_path) + "/sw\0run"})
    msg = str(e.value)
    assert msg.startswith(f"stepwatch.init({name}=") and msg.endswith(
        "is not valid: contains a NUL byte (\\0), which no path or name can hold"), msg


@pytest.mark.parametrize("name, value", [("dir", b"/tmp/sw\0run"), ("dir", pathlib.PurePosixPath("/tmp/sw\0run")),
                                         ("tensorboard", pathlib.PurePosixPath("/tmp/sw\0run"))])
def test_a_nul_byte_in_a_path_given_as_bytes_or_a_path_object_is_refused(name, value):
    with pytest.raises(ConfigError, match=rf"^stepwatch\.init\({name}=.*contains a NUL byte"):
        Config.from_env({}, **{name: value})


@pytest.mark.parametrize("var", ["STEPWATCH_DIR", "STEPWATCH_TENSORBOARD", "STEPWATCH_RUN_ID",
                                 "STEPWATCH_PROMETHEUS_HOST", "STEPWATCH_GPU_DEVICE"])
def test_a_nul_byte_in_a_text_variable_is_refused_naming_it(var):
    """``Config.from_env(environ)`` takes any mapping (os.environ itself cannot hold a NUL)."""
    with pytest.raises(ConfigError, match=rf"^{var}='a\\x00b' is not valid: contains a NUL byte"):
        Config.from_env({var: "a\0b"})


def test_init_with_a_nul_byte_in_dir_raises_config_error_and_starts_nothing(tmp_path, monkeypatch):
    """The tester's case, through ``stepwatch.init``: a ConfigError the script can catch."""
    import stepwatch

    for k in [k for k in os.environ if k.startswith("STEPWATCH_")]:
        monkeypatch.delenv(k)
    monkeypatch.chdir(tmp_path)
    assert stepwatch.get_session() is None
    with pytest.raises(stepwatch.ConfigError, match=r"^stepwatch\.init\(dir="):
        stepwatch.init(dir=str(tmp_path) + "/sw\0run")
    assert stepwatch.get_session() is None
    assert list(tmp_path.iterdir()) == []


NO_TEXT = {"bytes": b"job7", "bool": True, "int": 7, "object": object(), "list": ["a"]}


@pytest.mark.parametrize("name,kind", [(n, k) for n in TEXT_ARGS for k in NO_TEXT
                                       if (n, k) != ("gpu_device", "int")])  # an NVML index: see below
def test_a_text_argument_that_is_no_text_is_refused_naming_it(name, kind):
    """They took any object and used its ``str()``, where ``dir=`` refuses such values. (An NVML
    index as a number is a GPU device: test_an_nvml_index_as_a_number_is_a_gpu_device.)"""
    value = NO_TEXT[kind]
    with pytest.raises(ConfigError) as e:
        Config.from_env({}, **{name: value})
    msg = str(e.value)
    assert msg.startswith(f"stepwatch.init({name}=") and msg.endswith(
        f"is not valid: expected text (a str), got {type(value).__name__}"), msg


@pytest.mark.parametrize("name", TEXT_ARGS)
def test_a_text_argument_given_as_text_or_none_is_taken(name):
    assert getattr(Config.from_env({}, **{name: "GPU-1 job"}), name) == "GPU-1 job"
    default = Config.from_env({}, **{name: None})
    assert getattr(default, name) == ("127.0.0.1" if name == "prometheus_host" else None)
    assert getattr(Config.from_env({}, **{name: "  "}), name) == getattr(default, name)


def test_a_misspelled_variable_in_the_wrong_case_gets_the_setting_it_spells(caplog):
    """``STEPWATCH_enabled=0`` suggested STEPWATCH_DIR and ``STEPWATCH_Window`` STEPWATCH_WANDB:
    difflib compares case-sensitively, and lowercase letters match nothing in an uppercase name."""
    env = {"STEPWATCH_enabled": "0", "STEPWATCH_Window": "10", "STEPWATCH_step_boundry": "explicit"}
    with caplog.at_level(logging.WARNING, logger="stepwatch"):
        cfg = Config.from_env(env)
    lines = sorted(r.getMessage() for r in caplog.records)
    assert cfg.enabled is True and cfg.window == 50  # still ignored, as every unknown name
    assert len(lines) == 3, lines
    for var, setting in (("STEPWATCH_Window", "STEPWATCH_WINDOW"), ("STEPWATCH_enabled", "STEPWATCH_ENABLED"),
                         ("STEPWATCH_step_boundry", "STEPWATCH_STEP_BOUNDARY")):
        assert any(m.startswith(f"stepwatch: {var} is not a stepwatch setting, and is ignored; did you mean "
                                f"{setting}? ") for m in lines), (var, lines)


def test_an_nvml_index_as_a_number_is_a_gpu_device():
    assert Config.from_env({}, gpu_device=0).gpu_device == "0"
    assert Config.from_env({}, gpu_device=3).gpu_device == "3"
    with pytest.raises(ConfigError, match=r"gpu_device=-1.*0 or more"):
        Config.from_env({}, gpu_device=-1)


def test_the_master_switch_off_gets_a_job_past_a_bad_setting(caplog):
    """``STEPWATCH_ENABLED=0`` is the switch a user reaches for when a stepwatch setting stops their
    job: a bad value of another variable still raised at ``import stepwatch.auto``, so the job
    could not be run without removing that variable. With the switch off, bad values are ignored,
    one line each; with it on they still raise."""
    import logging

    with caplog.at_level(logging.WARNING, logger="stepwatch"):
        cfg = Config.from_env({"STEPWATCH_ENABLED": "0", "STEPWATCH_WINDOW": "1"}, dir="x\0y")
    assert cfg.enabled is False
    said = [r.getMessage() for r in caplog.records]
    assert any("STEPWATCH_WINDOW='1' is not valid" in m and "ignored: stepwatch is off" in m for m in said), said
    assert any("stepwatch.init(dir=" in m and "ignored: stepwatch is off" in m for m in said), said
    with pytest.raises(ConfigError, match="STEPWATCH_WINDOW"):
        Config.from_env({"STEPWATCH_ENABLED": "1", "STEPWATCH_WINDOW": "1"})
    with pytest.raises(ConfigError, match="STEPWATCH_ENABLED"):  # the switch itself must be readable
        Config.from_env({"STEPWATCH_ENABLED": "maybe", "STEPWATCH_WINDOW": "1"})
    # and a real job: the one-line import, the switch off, a bad setting beside it
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEPWATCH_")}
    env.update(STEPWATCH_ENABLED="0", STEPWATCH_WINDOW="1",
               PYTHONPATH=os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "src"))
    r = subprocess.run([sys.executable, "-c", "import stepwatch.auto; print('trained')"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "trained", r.stderr[-2000:]

"""The public surface, configuration and lifecycle."""

import os
import subprocess
import sys

import pytest
import torch

import stepwatch
from stepwatch.config import Config, ConfigError, env_table

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_public_api_is_pinned():
    assert sorted(stepwatch.__all__) == sorted(
        [
            "Batch",
            "Config",
            "ConfigError",
            "Exporter",
            "Finding",
            "InMemoryExporter",
            "StepRecord",
            "__version__",
            "get_session",
            "init",
            "log",
            "phase",
            "set_step",
            "shutdown",
            "step",
        ]
    )
    for name in stepwatch.__all__:
        assert hasattr(stepwatch, name)
    # ... and the package exposes nothing public beyond it (submodules aside).
    import types

    exposed = {
        n for n, v in vars(stepwatch).items()
        if not n.startswith("_") and not isinstance(v, types.ModuleType)
    }
    assert exposed == set(stepwatch.__all__) - {"__version__"}


def test_import_is_cheap():
    code = "import sys, stepwatch; print('torch' in sys.modules, 'opentelemetry' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": os.path.join(ROOT, "src")},
        capture_output=True, text=True, check=True,
    ).stdout.split()
    assert out == ["False", "False"]


def test_init_twice_same_config_returns_session_different_raises(sw):
    _, _, start = sw
    s1 = start()
    assert start() is s1
    with pytest.raises(ConfigError, match="different configuration"):
        start(window=7)


@pytest.mark.parametrize(
    "var,value,needle",
    [
        ("STEPWATCH_ENABLED", "maybe", "STEPWATCH_ENABLED='maybe'"),
        ("STEPWATCH_STEP_OFFSET", "-3", "integer >= 0"),
        ("STEPWATCH_CONSOLE", "loud", "auto, on, off"),
        ("STEPWATCH_WINDOW", "1", "integer >= 2"),
        ("STEPWATCH_DATA_WAIT_MS", "nan", "finite number > 0"),
    ],
)
def test_bad_environment_names_the_variable(var, value, needle):
    with pytest.raises(ConfigError) as e:
        Config.from_env({var: value})
    assert var in str(e.value) and needle in str(e.value)


def test_bad_argument_names_the_argument():
    with pytest.raises(ConfigError, match=r"stepwatch.init\(window=0\)"):
        Config.from_env({}, window=0)
    with pytest.raises(ConfigError, match="unknown argument 'windw'"):
        Config.from_env({}, windw=3)


def test_explicit_arguments_beat_environment():
    assert Config.from_env({"STEPWATCH_WINDOW": "9"}, window=4).window == 4
    assert Config.from_env({"STEPWATCH_WINDOW": "9"}).window == 9


def test_import_auto_with_a_bad_value_fails_at_import(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src"), "STEPWATCH_QUEUE_SIZE": "lots"}
    r = subprocess.run([sys.executable, "-c", "import stepwatch.auto"], env=env, capture_output=True, text=True)
    assert r.returncode != 0
    assert "STEPWATCH_QUEUE_SIZE='lots' is not valid: expected an integer >= 16" in r.stderr


def test_disabled_is_a_no_op(sw, monkeypatch):
    stepwatch_mod, mem, start = sw
    orig_backward = torch.autograd.backward
    monkeypatch.setenv("STEPWATCH_ENABLED", "0")
    orig_grad = torch.autograd.grad
    s = start()
    assert torch.autograd.backward is orig_backward and torch.autograd.grad is orig_grad
    assert s.tracker is None
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    p.sum().backward()
    opt.step()
    stepwatch_mod.log(loss=1.0)
    stepwatch_mod.step()
    with stepwatch_mod.phase("x"):
        pass
    stepwatch_mod.shutdown()
    assert mem.records == []


def test_shutdown_restores_everything(sw):
    stepwatch_mod, _, start = sw
    from torch.utils.data import dataloader

    before = (torch.autograd.backward, torch.autograd.grad, torch.save, dataloader._BaseDataLoaderIter.__next__,
              torch.amp.GradScaler.step)
    start()
    assert torch.autograd.backward is not before[0] and torch.autograd.grad is not before[1]
    g = torch.autograd.grad  # passes for torch's own
    assert g.__wrapped__ is before[1] and g.__name__ == "grad" and g.__doc__ == before[1].__doc__
    stepwatch_mod.shutdown()
    after = (torch.autograd.backward, torch.autograd.grad, torch.save, dataloader._BaseDataLoaderIter.__next__,
             torch.amp.GradScaler.step)
    assert after == before
    assert stepwatch_mod.get_session() is None


def test_readme_generated_tables_are_current():
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "gen_readme_tables.py"), "--check"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_every_variable_is_in_the_readme():
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    missing = [var for var, _, _ in env_table() if f"`{var}`" not in readme]
    assert not missing, f"README's variable table lacks {missing}"


def test_every_finding_kind_is_in_the_readme():
    from stepwatch.analysis.kinds import KINDS

    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    missing = [k for k in KINDS if f"`{k}`" not in readme]
    assert not missing, f"README's findings table lacks {missing}"


def test_record_schema_is_in_the_readme():
    from stepwatch.record import STEP_FIELDS

    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    missing = [k for k in STEP_FIELDS if f"`{k}`" not in readme]
    assert not missing, f"README's record schema lacks {missing}"

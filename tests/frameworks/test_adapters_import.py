"""The adapters' import contract: ``import stepwatch`` (and ``stepwatch.integrations``) never
imports a framework; an adapter whose framework is missing fails with the install command."""

import subprocess
import sys

from fw_common import SRC


def _run(code):
    return subprocess.run([sys.executable, "-c", code], env={"PYTHONPATH": SRC}, capture_output=True, text=True, timeout=120)


def test_importing_stepwatch_imports_no_framework():
    r = _run(
        "import sys, stepwatch, stepwatch.integrations\n"
        "bad = [m for m in ('lightning', 'pytorch_lightning', 'transformers', 'accelerate', 'torch') if m in sys.modules]\n"
        "print(bad)\n"
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_missing_framework_names_the_fix():
    # sys.modules[name] = None makes that import fail as if the package were not installed.
    for adapter, blocked in (("lightning", ("lightning", "pytorch_lightning")), ("transformers", ("transformers",))):
        block = "".join(f"sys.modules[{b!r}] = None\n" for b in blocked)
        r = _run(f"import sys\n{block}import stepwatch.integrations.{adapter}\n")
        assert r.returncode != 0
        assert "pip install 'stepwatch[frameworks]'" in r.stderr, r.stderr[-2000:]

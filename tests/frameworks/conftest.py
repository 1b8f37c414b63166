"""Framework support-matrix tests (docs/frameworks.md).

A framework's tests are skipped ONLY when its package is not installed (the reason names the fix);
an installed framework that fails to import fails its tests. Test modules import their framework
inside the tests, so a missing one never breaks collection.
"""

import importlib.metadata
import importlib.util
import os

import pytest

# test file -> the package it needs
REQUIRES = {
    "test_lightning.py": "lightning",
    "test_transformers.py": "transformers",
    "test_accelerate.py": "accelerate",
}


def _installed(pkg):
    try:
        return importlib.util.find_spec(pkg) is not None
    except (ImportError, ValueError):  # ValueError: a module blocked in sys.modules (None)
        return False


def pytest_report_header(config):
    out = []
    for pkg in sorted(set(REQUIRES.values())):
        if _installed(pkg):
            out.append(f"{pkg} {importlib.metadata.version(pkg)}")
        else:
            out.append(f"{pkg} NOT INSTALLED (its tests are skipped; pip install -r requirements-frameworks.txt)")
    return "frameworks: " + ", ".join(out)


def pytest_collection_modifyitems(config, items):
    for item in items:
        pkg = REQUIRES.get(item.path.name)
        if pkg and not _installed(pkg):
            item.add_marker(
                pytest.mark.skip(reason=f"{pkg} is not installed: pip install -r requirements-frameworks.txt")
            )


@pytest.fixture(autouse=True)
def _clean_stepwatch(monkeypatch):
    """No STEPWATCH_* from the environment, and no session left running after a test."""
    import stepwatch

    for k in list(os.environ):
        if k.startswith("STEPWATCH_"):
            monkeypatch.delenv(k)
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))
    yield
    stepwatch.shutdown()

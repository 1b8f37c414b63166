import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SRC = os.path.join(ROOT, "src")
if SRC not in sys.path:
    sys.path.insert(0, SRC)


@pytest.fixture
def sw(tmp_path, monkeypatch):
    """A running stepwatch session writing to a temp run dir, with an in-memory exporter.

    Yields ``(stepwatch_module, memory_exporter, start)`` where ``start(**config)`` starts the
    session; it is always shut down after the test."""
    import stepwatch

    for k in list(os.environ):
        if k.startswith("STEPWATCH_"):
            monkeypatch.delenv(k)
    mem = stepwatch.InMemoryExporter()

    def start(**cfg):
        cfg.setdefault("dir", str(tmp_path / "run"))
        cfg.setdefault("console", "off")
        cfg.setdefault("flush_interval_s", 0.05)
        cfg.setdefault("exporters", [mem])
        return stepwatch.init(**cfg)

    yield stepwatch, mem, start
    stepwatch.shutdown()

"""Integration tests run one at a time (``alone``) unless their module says ``shares_cores``.

They are real multi-process jobs, and most hold bounds about load: a hang found within its
timeout, a shutdown within 2 s, a straggler named within a second of evidence, a spike that is
the job's own. A test beside them is load. Those that hold no such bound (bit-identical losses,
files written, memory per step) say ``pytest.mark.shares_cores`` and run with the unit tests on
the xdist workers (scripts/run_tests.sh); the rest are marked ``alone`` here and run after.
"""

import os

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def pytest_collection_modifyitems(config, items):
    for item in items:
        if str(item.fspath).startswith(HERE + os.sep) and item.get_closest_marker("shares_cores") is None:
            item.add_marker(pytest.mark.alone)

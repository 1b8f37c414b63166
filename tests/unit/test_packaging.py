"""Packaging: the project metadata builds with the venv's setuptools without a deprecation warning."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_metadata_builds_without_warnings_and_declares_the_spdx_license(tmp_path):
    # The same backend call `pip install -e .` makes first; stderr carries setuptools' warnings.
    code = "import sys, setuptools.build_meta as b; print(b.prepare_metadata_for_build_wheel(sys.argv[1]))"
    p = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "Warning" not in p.stderr, p.stderr
    meta = (tmp_path / p.stdout.strip().splitlines()[-1] / "METADATA").read_text()
    assert "License-Expression: Apache-2.0" in meta.splitlines()

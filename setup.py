"""Optional native builds: stepwatch.cuda_ext._native (the timer), stepwatch._speedups (the
records file's step line and the background thread's record build), stepwatch.hooks._ctracker
(the step tracker's hot methods) and stepwatch.metrics._cmetrics (the FLOPs/tokens collector's
per-forward fast path); all other metadata lives in pyproject.toml.

They need only a C compiler and the Python headers: the CUDA/HIP runtime is loaded with dlopen
at run time, so no toolkit (nvcc, hipcc) is needed here. When one cannot be built (no compiler,
no headers, not POSIX), `pip install` still succeeds and stepwatch uses its pure-Python timer
(`stepwatch doctor` then reports the timing backend as "python") or its Python step lines and
tracker (the same bytes and records, slower).
"""

import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

_SRC = "src/stepwatch/cuda_ext/"


class OptionalBuildExt(build_ext):
    """build_ext that turns any failure into a warning: the extension is an accelerator only."""

    def run(self):
        try:
            super().run()
        except Exception as exc:  # compiler missing or unusable: fall back, never fail the install
            self._skip(exc)

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as exc:
            self._skip(exc)

    @staticmethod
    def _skip(exc):
        sys.stderr.write(
            "WARNING: a stepwatch native extension was not built "
            f"({type(exc).__name__}: {exc}); stepwatch will use its pure-Python code for it.\n"
        )


def _extensions():
    # dlopen/pthread_atfork/clock_gettime: POSIX only; Windows gets the pure-Python timer and
    # step lines (the same bytes, slower).
    if os.name != "posix":
        return []
    return [
        Extension(
            "stepwatch.cuda_ext._native",
            sources=[_SRC + "module.c", _SRC + "ring.c", _SRC + "runtime.c"],
            depends=[_SRC + "ring.h", _SRC + "runtime.h"],
            extra_compile_args=["-O2", "-std=gnu11"],
            # libdl and libpthread are part of libc from glibc 2.34 on; naming them keeps older
            # glibc (and musl, where they are empty stubs) linking.
            libraries=["dl", "pthread"] if sys.platform.startswith("linux") else [],
            optional=True,
        ),
        # The records file's step line and the background thread's record build in C
        # (exporters/records.py and record.py keep the Python ones).
        Extension("stepwatch._speedups", sources=["src/stepwatch/_speedups.c"],
                  depends=["src/stepwatch/_cobjects.h"], extra_compile_args=["-O2"], optional=True),
        # The step tracker's hot methods in C (hooks/phases.py keeps them in Python, _PyCore).
        Extension("stepwatch.hooks._ctracker", sources=["src/stepwatch/hooks/_ctracker.c"],
                  depends=["src/stepwatch/_cobjects.h"], extra_compile_args=["-O2"], optional=True),
        # The FLOPs/tokens collector's per-forward fast path in C (metrics/flops.py and
        # metrics/tokens.py keep it in Python).
        Extension("stepwatch.metrics._cmetrics", sources=["src/stepwatch/metrics/_cmetrics.c"],
                  depends=["src/stepwatch/_cobjects.h"], extra_compile_args=["-O2"], optional=True),
    ]


setup(ext_modules=_extensions(), cmdclass={"build_ext": OptionalBuildExt})

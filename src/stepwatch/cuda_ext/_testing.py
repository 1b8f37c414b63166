"""Test tooling: compile the fake CUDA/HIP runtime, and the extension itself when it is not built.

Used by tests/unit/test_cuda_ext*.py and benchmarks/timing.py; needs a C compiler (``cc`` or
``$CC``). Not imported by stepwatch itself.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import shutil
import subprocess
import sysconfig
from pathlib import Path
from types import ModuleType
from typing import Any

HERE = Path(__file__).resolve().parent


def compiler() -> str | None:
    cc = os.environ.get("CC") or "cc"
    return shutil.which(cc) or shutil.which("gcc")


def _run(cmd: list[str]) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"compile failed: {' '.join(cmd)}\n{done.stderr}")


def build_fake_runtime(dst: str | os.PathLike[str], *, hip: bool = False) -> str:
    """Compile fake_runtime.c into ``dst``; returns the library path."""
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (set CC or install gcc)")
    out = Path(dst) / ("libfakeamdhip64.so" if hip else "libfakecudart.so")
    cmd = [cc, "-shared", "-fPIC", "-O1", str(HERE / "fake_runtime.c"), "-o", str(out)]
    if hip:
        cmd.insert(1, "-DFAKE_HIP")
    _run(cmd)
    return str(out)


def build_native(dst: str | os.PathLike[str]) -> ModuleType:
    """Compile the extension into ``dst`` and load it (for trees where pip did not build it)."""
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (set CC or install gcc)")
    out = Path(dst) / ("_native" + (sysconfig.get_config_var("EXT_SUFFIX") or ".so"))
    srcs = [str(HERE / n) for n in ("module.c", "ring.c", "runtime.c")]
    inc = sysconfig.get_paths()["include"]
    _run([cc, "-O2", "-std=gnu11", "-shared", "-fPIC", f"-I{inc}", *srcs, "-o", str(out), "-ldl", "-lpthread"])
    spec = importlib.util.spec_from_file_location("_native", out)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def load_native(tmp: str | os.PathLike[str]) -> ModuleType:
    """The installed extension, else one compiled into ``tmp``."""
    try:
        return importlib.import_module("stepwatch.cuda_ext._native")
    except ImportError:
        return build_native(tmp)


def install_native(module: ModuleType) -> None:
    """Make ``module`` (e.g. from ``build_native``) the extension stepwatch.cuda_ext uses, as if
    pip had built it: for scripts/gpu_check_timing.py, which tests the current C sources."""
    from stepwatch import cuda_ext

    cuda_ext._native = module
    cuda_ext._NATIVE_ERROR = None
    cuda_ext.RuntimeUnavailable = module.RuntimeUnavailable
    cuda_ext.NativeRing = cuda_ext.native_ring_class(module)
    cuda_ext._direct = None
    cuda_ext._backends.clear()


class FakeRuntime:
    """ctypes handle on a compiled fake runtime: the controls tests turn."""

    def __init__(self, path: str, *, hip: bool = False) -> None:
        self.path = path
        self.lib = ctypes.CDLL(path)  # same handle the ring dlopens: shared state
        p = self._prefix = "hip" if hip else "cuda"
        self._set_device = getattr(self.lib, p + "SetDevice")
        self._get_device = getattr(self.lib, p + "GetDevice")
        self.lib.fake_set_lag_ns.argtypes = [ctypes.c_int64]
        self.lib.fake_set_capture.argtypes = [ctypes.c_void_p, ctypes.c_int]
        self.lib.fake_counter.argtypes = [ctypes.c_char_p]
        self.lib.fake_counter.restype = ctypes.c_int64
        self.lib.fake_contexts_created.argtypes = [ctypes.c_int]
        self.lib.fake_contexts_created.restype = ctypes.c_int64

    def reset(self) -> None:
        self.lib.fake_set_lag_ns(0)
        self.lib.fake_set_capture(None, 0)
        self.lib.fake_fail_records(0)
        self.lib.fake_set_no_device(0)
        self.set_device(0)

    def set_lag(self, seconds: float) -> None:
        self.lib.fake_set_lag_ns(int(seconds * 1e9))

    def set_capture(self, stream: int | None, on: bool = True, *, blocking: bool = False) -> None:
        """``stream`` captures (``blocking``: a stream that syncs with the legacy stream 0)."""
        self.lib.fake_set_capture(stream, 1 if on else 0)
        self.lib.fake_set_capture_blocking(1 if blocking else 0)

    def fail_records(self, n: int) -> None:
        self.lib.fake_fail_records(n)

    def set_no_device(self, on: bool) -> None:
        self.lib.fake_set_no_device(1 if on else 0)

    def reset_contexts(self) -> None:
        """No device has a context yet (a process before its first CUDA use)."""
        self.lib.fake_reset_contexts()

    def contexts_created(self, device: int) -> int:
        """How many times a primary context was initialized on ``device`` since the last reset."""
        return int(self.lib.fake_contexts_created(device))

    def set_device(self, d: int) -> int:
        return self._set_device(d)

    def get_device(self) -> int:
        v = ctypes.c_int(-1)
        self._get_device(ctypes.byref(v))
        return v.value

    def capture_mode(self) -> int:
        """The calling thread's capture interaction mode (0 global, 1 thread-local, 2 relaxed)."""
        f = getattr(self.lib, self._prefix + "ThreadExchangeStreamCaptureMode")
        m = ctypes.c_int(0)
        f(ctypes.byref(m))
        old = m.value
        f(ctypes.byref(m))  # put it back
        return old

    def counter(self, name: str) -> int:
        v = self.lib.fake_counter(name.encode())
        if v < 0:
            raise KeyError(name)
        return int(v)

    def counters(self) -> dict[str, Any]:
        names = ("created", "destroyed", "records", "queries", "set_device", "wrong_device", "captured_records",
                 "capture_violations")
        return {n: self.counter(n) for n in names}

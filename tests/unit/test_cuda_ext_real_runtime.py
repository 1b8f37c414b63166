"""The native ring against the real CUDA runtime library and headers of an installed toolkit.

Nothing is mocked here: these tests dlopen the toolkit's own libcudart and compile against its
own headers. This machine has the CUDA toolkit (nvcc) but no GPU and no driver, so what can be
checked without a GPU is checked: every symbol the ring needs resolves in the real library, a
runtime without a driver is reported clearly and falls back, an already-loaded runtime is reused
rather than loaded a second time, and our hand-written ABI constants and function-pointer types
agree with cuda_runtime_api.h. Running events on a device is scripts/gpu_check_timing.py's job.
Each test skips when the toolkit is absent, and the driver test skips where a GPU driver is present.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import stepwatch.cuda_ext as cuda_ext
from stepwatch.cuda_ext import _testing

HERE = Path(cuda_ext.__file__).resolve().parent


def _cuda_home() -> Path | None:
    for cand in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if cand and (Path(cand) / "include" / "cuda_runtime_api.h").is_file():
            return Path(cand)
    return None


def _cudart() -> Path | None:
    home = _cuda_home()
    if home is None:
        return None
    for sub in ("lib64", "lib", "targets/x86_64-linux/lib"):
        for lib in sorted((home / sub).glob("libcudart.so.[0-9]*"), reverse=True):
            if lib.name.count(".") == 2:  # the soname link, libcudart.so.13
                return lib.resolve()
    return None


HOME = _cuda_home()
CUDART = _cudart()
needs_cudart = pytest.mark.skipif(CUDART is None, reason="no CUDA toolkit runtime (libcudart.so.N) installed")
NO_DRIVER = not Path("/proc/driver/nvidia").exists()


@needs_cudart
@pytest.mark.skipif(not NO_DRIVER, reason="a GPU driver is present: scripts/gpu_check_timing.py covers this machine")
def test_real_cudart_binds_every_symbol_and_reports_the_missing_driver(native):
    kind, path = native.load_runtime("cuda", str(CUDART))
    assert (kind, path) == ("cuda", str(CUDART))  # every cuda* symbol the table needs resolved
    with pytest.raises(native.RuntimeUnavailable) as err:
        native.Ring(4, "cuda", str(CUDART))
    msg = str(err.value)
    # names the library, the call that failed and the runtime's own words for the error code
    assert str(CUDART) in msg and "cannot create events" in msg
    assert "cudaGetDevice" in msg and "driver" in msg.lower()


@needs_cudart
@pytest.mark.skipif(not NO_DRIVER, reason="a GPU driver is present: scripts/gpu_check_timing.py covers this machine")
def test_real_cudart_without_a_gpu_gives_a_clear_error_from_get_timer():
    with pytest.raises(RuntimeError) as err:
        cuda_ext.get_timer("cuda", library=str(CUDART))
    msg = str(err.value)
    assert "torch.cuda.is_available() is False" in msg and str(CUDART) in msg
    # a host timer still works on the same machine: stepwatch falls back, the job goes on
    with cuda_ext.get_timer() as t:
        t.end(t.begin(None, "x"))
        assert [tag for tag, _, _ in t.poll()] == ["x"]
    assert cuda_ext.backend_name("cuda") == "unavailable"


@needs_cudart
def test_a_runtime_already_in_the_process_is_reused_not_loaded_again(native, tmp_path):
    """Stand-in for torch's copy: a private copy of libcudart, loaded first under another file
    name. The search must find that copy by its soname instead of mapping the system's copy too,
    so our events and torch's streams live in one runtime instance."""
    copy = tmp_path / "torch_private" / "libcudart-0123abcd.so.13"
    copy.parent.mkdir()
    copy.write_bytes(CUDART.read_bytes())
    script = textwrap.dedent(
        f"""
        import ctypes, importlib.util, json, sys
        ctypes.CDLL({str(copy)!r})
        spec = importlib.util.spec_from_file_location("_native", {native.__file__!r})
        mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
        kind, name = mod.load_runtime("cuda")
        maps = [l.split()[-1] for l in open("/proc/self/maps") if "libcudart" in l]
        print(json.dumps({{"kind": kind, "name": name, "mapped": sorted(set(maps))}}))
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    import json

    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["kind"] == "cuda" and seen["name"].startswith("libcudart.so.")
    assert seen["mapped"] == [str(copy)], f"a second runtime was mapped: {seen['mapped']}"


ABI_CHECK = r"""
#include <cuda.h>
#include <cuda_runtime_api.h>
#include "runtime.h"

/* the numeric values runtime.h writes down by hand */
_Static_assert(SW_SUCCESS == cudaSuccess, "cudaSuccess");
_Static_assert(SW_ERR_NOT_READY == cudaErrorNotReady, "cudaErrorNotReady");
_Static_assert(SW_EVENT_DEFAULT == cudaEventDefault, "cudaEventDefault");
_Static_assert(SW_CAPTURE_NONE == cudaStreamCaptureStatusNone, "cudaStreamCaptureStatusNone");
_Static_assert(SW_CAPTURE_MODE_RELAXED == cudaStreamCaptureModeRelaxed, "cudaStreamCaptureModeRelaxed");
/* the types our table passes in their place */
_Static_assert(sizeof(cudaError_t) == sizeof(sw_err_t), "cudaError_t is passed as int");
_Static_assert(sizeof(cudaEvent_t) == sizeof(sw_event_t), "cudaEvent_t is an opaque pointer");
_Static_assert(sizeof(cudaStream_t) == sizeof(sw_stream_t), "cudaStream_t is an opaque pointer");
_Static_assert(sizeof(enum cudaStreamCaptureStatus) == sizeof(int), "capture status is read as int");
_Static_assert(sizeof(enum cudaStreamCaptureMode) == sizeof(int), "capture mode is passed as int");
_Static_assert(sizeof(CUresult) == sizeof(int) && CUDA_SUCCESS == 0, "driver results are read as int, 0 = success");
_Static_assert(sizeof(CUdevice) == sizeof(int), "CUdevice is passed as int");

/* One forwarder per table entry: each compiles (under -Werror) only if the real function takes
 * as many arguments as our pointer type, of the same kinds (pointer / integer), and returns the
 * error enum. The table is then filled with them, so the pointer types are checked as well. */
static sw_err_t create(sw_event_t *e, unsigned int f) { return cudaEventCreateWithFlags((cudaEvent_t *)e, f); }
static sw_err_t record(sw_event_t e, sw_stream_t s) { return cudaEventRecord((cudaEvent_t)e, (cudaStream_t)s); }
static sw_err_t query(sw_event_t e) { return cudaEventQuery((cudaEvent_t)e); }
static sw_err_t elapsed(float *ms, sw_event_t a, sw_event_t b) { return cudaEventElapsedTime(ms, (cudaEvent_t)a, (cudaEvent_t)b); }
static sw_err_t destroy(sw_event_t e) { return cudaEventDestroy((cudaEvent_t)e); }
static sw_err_t capturing(sw_stream_t s, int *st) { return cudaStreamIsCapturing((cudaStream_t)s, (enum cudaStreamCaptureStatus *)st); }
static sw_err_t set_device(int d) { return cudaSetDevice(d); }
static sw_err_t get_device(int *d) { return cudaGetDevice(d); }
static const char *error_string(sw_err_t c) { return cudaGetErrorString((cudaError_t)c); }
static sw_err_t exchange(int *m) { return cudaThreadExchangeStreamCaptureMode((enum cudaStreamCaptureMode *)m); }
/* the two driver entry points (libcuda.so.1) used to restore a device without creating a context */
static int device_get(int *d, int ordinal) { return cuDeviceGet((CUdevice *)d, ordinal); }
static int ctx_state(int d, unsigned int *flags, int *active) { return cuDevicePrimaryCtxGetState((CUdevice)d, flags, active); }

sw_runtime table = {
    .kind = SW_KIND_CUDA, .event_create_with_flags = create, .event_record = record, .event_query = query,
    .event_elapsed_time = elapsed, .event_destroy = destroy, .stream_is_capturing = capturing,
    .set_device = set_device, .get_device = get_device, .get_error_string = error_string,
    .thread_exchange_capture_mode = exchange, .device_get = device_get, .primary_ctx_get_state = ctx_state,
};
"""


@pytest.mark.skipif(HOME is None, reason="no CUDA toolkit headers (cuda_runtime_api.h)")
def test_abi_constants_and_signatures_match_the_cuda_headers(tmp_path):
    cc = _testing.compiler()
    if cc is None:
        pytest.skip("no C compiler")
    src = tmp_path / "abi_check.c"
    src.write_text(ABI_CHECK)
    done = subprocess.run(
        [cc, "-std=gnu11", "-Wall", "-Wextra", "-Werror", "-fsyntax-only",
         f"-I{HOME / 'include'}", f"-I{HERE}", str(src)],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr

/* The few CUDA / HIP runtime entry points the event ring needs, loaded with dlopen at run time.
 *
 * Why dlopen and not linking: one build serves CUDA 11-13 and ROCm 6-7 and needs no toolkit at
 * build time; and we reuse the runtime copy torch already loaded (RTLD_NOLOAD first), so our
 * events live in the same runtime instance as torch's streams.
 *
 * The CUDA and HIP functions used here have the same C signatures and the same numeric codes for
 * the values we test, so one table of function pointers serves both; only the symbol prefix
 * ("cuda" / "hip") differs.
 */
#ifndef STEPWATCH_RUNTIME_H
#define STEPWATCH_RUNTIME_H

#include <stddef.h>

/* cudaError_t / hipError_t are C enums, passed and returned as int. */
typedef int sw_err_t;
typedef void *sw_event_t;  /* cudaEvent_t / hipEvent_t: opaque pointers */
typedef void *sw_stream_t; /* cudaStream_t / hipStream_t: opaque pointers (0 = legacy default) */

/* cudaSuccess = 0 and cudaErrorNotReady = 600: CUDA Runtime API, "Data types used by CUDA
 * Runtime" (enum cudaError, driver_types.h); hipSuccess = 0 and hipErrorNotReady = 600:
 * HIP hip_runtime_api.h (enum hipError_t, chosen to match CUDA's numbers). */
#define SW_SUCCESS 0
#define SW_ERR_NOT_READY 600
/* cudaEventDefault = 0x00 (driver_types.h) / hipEventDefault = 0x0 (hip_runtime_api.h):
 * timing enabled, spin on synchronize (we never synchronize). */
#define SW_EVENT_DEFAULT 0u
/* cudaStreamCaptureStatusNone = 0 (driver_types.h) / hipStreamCaptureStatusNone = 0
 * (hip_runtime_api.h); Active = 1 and Invalidated = 2 both mean "inside a capture". */
#define SW_CAPTURE_NONE 0
/* cudaStreamCaptureModeRelaxed = 2 (driver_types.h, enum cudaStreamCaptureMode: Global = 0,
 * ThreadLocal = 1, Relaxed = 2) / hipStreamCaptureModeRelaxed = 2 (hip_runtime_api.h). */
#define SW_CAPTURE_MODE_RELAXED 2

enum sw_kind { SW_KIND_HOST = 0, SW_KIND_CUDA = 1, SW_KIND_HIP = 2 };

typedef struct sw_runtime {
    int kind; /* SW_KIND_CUDA or SW_KIND_HIP */
    char path[512];
    sw_err_t (*event_create_with_flags)(sw_event_t *, unsigned int);
    sw_err_t (*event_record)(sw_event_t, sw_stream_t);
    sw_err_t (*event_query)(sw_event_t);
    sw_err_t (*event_elapsed_time)(float *, sw_event_t, sw_event_t);
    sw_err_t (*event_destroy)(sw_event_t);
    sw_err_t (*stream_is_capturing)(sw_stream_t, int *);
    sw_err_t (*set_device)(int);
    sw_err_t (*get_device)(int *);
    const char *(*get_error_string)(sw_err_t); /* optional */
    /* optional: lets the poller query events while another thread captures a graph in
     * cudaStreamCaptureModeGlobal (where EventQuery is a prohibited "unsafe" call) */
    sw_err_t (*thread_exchange_capture_mode)(int *);
    /* optional, driver level (CUresult / hipError_t, 0 = success): is a device's primary context
     * active? cuDeviceGet + cuDevicePrimaryCtxGetState from libcuda.so.1 (already loaded by the
     * runtime), hipDeviceGet + hipDevicePrimaryCtxGetState from libamdhip64 itself. Lets a
     * thread's device be restored without creating a context (see ring.c, leave_device). */
    int (*device_get)(int *, int);
    int (*primary_ctx_get_state)(int, unsigned int *, int *);
    struct sw_runtime *next;
} sw_runtime;

/* Which runtimes to look for. */
enum sw_want { SW_WANT_ANY = 0, SW_WANT_CUDA = 1, SW_WANT_HIP = 2 };

/* Load (or reuse an already loaded) runtime. `path` NULL: search the standard sonames, already
 * loaded ones first. On failure returns NULL and writes what was tried into `err`. Loaded
 * runtimes are cached for the life of the process and never dlclose'd (torch may share them). */
const sw_runtime *sw_runtime_load(int want, const char *path, char *err, size_t errlen);

/* A printable name for an error code (the runtime's own string when it exports one). */
const char *sw_runtime_strerror(const sw_runtime *rt, sw_err_t code);

#endif

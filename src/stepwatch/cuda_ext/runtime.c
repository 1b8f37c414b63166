/* dlopen loader for the CUDA / HIP runtime (see runtime.h for why). */
#include "runtime.h"

#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Sonames searched, newest first. libcudart's soname carries the major version
 * (libcudart.so.12 for every 12.x); libamdhip64's does too (libamdhip64.so.6 on ROCm 6.x,
 * .so.7 on ROCm 7.x). The unversioned names come last: they exist only where a toolkit's
 * development files are installed. */
static const char *const CUDA_SONAMES[] = {"libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0",
                                           "libcudart.so.11", "libcudart.so", NULL};
static const char *const HIP_SONAMES[] = {"libamdhip64.so.7", "libamdhip64.so.6", "libamdhip64.so", NULL};

/* Only ever touched with the GIL held (every caller is a Python entry point). */
static sw_runtime *g_loaded = NULL;

static void *sym(void *lib, const char *prefix, const char *suffix) {
    char name[96];
    snprintf(name, sizeof name, "%s%s", prefix, suffix);
    return dlsym(lib, name);
}

static void append(char *err, size_t errlen, const char *fmt, const char *a, const char *b) {
    size_t used = strlen(err);
    if (used + 1 >= errlen) return;
    snprintf(err + used, errlen - used, fmt, a, b);
}

/* Drop the trailing "; " of the last entry. */
static void trim(char *err) {
    size_t n = strlen(err);
    while (n && (err[n - 1] == ' ' || err[n - 1] == ';')) err[--n] = '\0';
}

/* The driver-level primary-context query (optional). HIP exports it from the runtime library;
 * CUDA's is in the driver library, which a working runtime has already loaded (RTLD_NOLOAD: never
 * load a driver ourselves). Both functions or neither. */
static void bind_primary_ctx(void *lib, int kind, sw_runtime *rt) {
    const char *get = kind == SW_KIND_HIP ? "hipDeviceGet" : "cuDeviceGet";
    const char *state = kind == SW_KIND_HIP ? "hipDevicePrimaryCtxGetState" : "cuDevicePrimaryCtxGetState";
    void *from[2] = {lib, NULL};
    if (kind == SW_KIND_CUDA) from[1] = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    for (int i = 0; i < 2 && from[i]; i++) {
        void *g = dlsym(from[i], get), *st = dlsym(from[i], state);
        if (g && st) {
            *(void **)(&rt->device_get) = g;
            *(void **)(&rt->primary_ctx_get_state) = st;
            return;
        }
    }
}

/* Fill a runtime table from an open library; 0 on success, else names the missing symbol. */
static int bind(void *lib, int kind, sw_runtime *rt, const char **missing) {
    const char *p = kind == SW_KIND_HIP ? "hip" : "cuda";
    memset(rt, 0, sizeof *rt);
    rt->kind = kind;
#define BIND(field, suffix)                                   \
    do {                                                      \
        *(void **)(&rt->field) = sym(lib, p, suffix);         \
        if (!rt->field) {                                     \
            *missing = suffix;                                \
            return -1;                                        \
        }                                                     \
    } while (0)
    BIND(event_create_with_flags, "EventCreateWithFlags");
    BIND(event_record, "EventRecord");
    BIND(event_query, "EventQuery");
    /* CUDA 12.8 added cudaEventElapsedTime_v2 with the same signature (CUDA Runtime API, Event
     * Management); accept either name so a runtime that keeps only one still loads. */
    *(void **)(&rt->event_elapsed_time) = sym(lib, p, "EventElapsedTime");
    if (!rt->event_elapsed_time) BIND(event_elapsed_time, "EventElapsedTime_v2");
    BIND(event_destroy, "EventDestroy");
    BIND(stream_is_capturing, "StreamIsCapturing");
    BIND(set_device, "SetDevice");
    BIND(get_device, "GetDevice");
#undef BIND
    *(void **)(&rt->get_error_string) = sym(lib, p, "GetErrorString");
    *(void **)(&rt->thread_exchange_capture_mode) = sym(lib, p, "ThreadExchangeStreamCaptureMode");
    bind_primary_ctx(lib, kind, rt);
    return 0;
}

/* Which prefix does this library export? */
static int detect_kind(void *lib, int want) {
    if (want != SW_WANT_HIP && dlsym(lib, "cudaEventRecord")) return SW_KIND_CUDA;
    if (want != SW_WANT_CUDA && dlsym(lib, "hipEventRecord")) return SW_KIND_HIP;
    return 0;
}

static const sw_runtime *cached(const char *path, int want) {
    for (sw_runtime *r = g_loaded; r; r = r->next) {
        if (path && strcmp(r->path, path) != 0) continue;
        if (want == SW_WANT_CUDA && r->kind != SW_KIND_CUDA) continue;
        if (want == SW_WANT_HIP && r->kind != SW_KIND_HIP) continue;
        return r;
    }
    return NULL;
}

static const sw_runtime *adopt(void *lib, const char *path, int want, char *err, size_t errlen) {
    int kind = detect_kind(lib, want);
    if (!kind) {
        append(err, errlen, "%s (loaded, but exports no %s symbols); ", path,
               want == SW_WANT_HIP ? "hipEvent*" : want == SW_WANT_CUDA ? "cudaEvent*" : "cudaEvent*/hipEvent*");
        return NULL;
    }
    sw_runtime tmp;
    const char *missing = "?";
    if (bind(lib, kind, &tmp, &missing) != 0) {
        char what[128];
        snprintf(what, sizeof what, "%s%s", kind == SW_KIND_HIP ? "hip" : "cuda", missing);
        append(err, errlen, "%s (loaded, but lacks %s); ", path, what);
        return NULL;
    }
    sw_runtime *rt = malloc(sizeof *rt);
    if (!rt) return NULL;
    *rt = tmp;
    snprintf(rt->path, sizeof rt->path, "%s", path);
    rt->next = g_loaded;
    g_loaded = rt;
    return rt;
}

const sw_runtime *sw_runtime_load(int want, const char *path, char *err, size_t errlen) {
    if (errlen) err[0] = '\0';
    const sw_runtime *hit = cached(path, want);
    if (hit) return hit;

    if (path) {
        void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
        if (!lib) {
            const char *e = dlerror();
            append(err, errlen, "%s (%s); ", path, e ? e : "dlopen failed");
            trim(err);
            return NULL;
        }
        const sw_runtime *rt = adopt(lib, path, want, err, errlen);
        if (!rt) trim(err);
        return rt;
    }

    const char *const *lists[2];
    int n = 0;
    if (want != SW_WANT_HIP) lists[n++] = CUDA_SONAMES;
    if (want != SW_WANT_CUDA) lists[n++] = HIP_SONAMES;

    /* Pass 1: a runtime already in the process (torch's), so events and streams share it. */
    for (int i = 0; i < n; i++) {
        for (const char *const *s = lists[i]; *s; s++) {
            void *lib = dlopen(*s, RTLD_NOW | RTLD_NOLOAD);
            if (lib) {
                const sw_runtime *rt = adopt(lib, *s, want, err, errlen);
                if (rt) return rt;
            }
        }
    }
    /* Pass 2: load one ourselves. */
    for (int i = 0; i < n; i++) {
        for (const char *const *s = lists[i]; *s; s++) {
            void *lib = dlopen(*s, RTLD_NOW | RTLD_LOCAL);
            if (!lib) {
                const char *e = dlerror();
                append(err, errlen, "%s (%s); ", *s, e ? e : "dlopen failed");
                continue;
            }
            const sw_runtime *rt = adopt(lib, *s, want, err, errlen);
            if (rt) return rt;
        }
    }
    trim(err);
    return NULL;
}

const char *sw_runtime_strerror(const sw_runtime *rt, sw_err_t code) {
    if (rt && rt->get_error_string) {
        const char *s = rt->get_error_string(code);
        if (s) return s;
    }
    return code == SW_ERR_NOT_READY ? "not ready" : "runtime error";
}

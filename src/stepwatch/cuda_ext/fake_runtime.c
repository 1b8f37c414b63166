/* A fake CUDA (or, with -DFAKE_HIP, HIP) runtime for tests on machines without a GPU.
 *
 * It exports the handful of entry points the event ring loads with dlopen, with the same
 * signatures and error codes, and behaves like a device that finishes work `lag` ns after it
 * was recorded: EventQuery answers 600 (not ready) until then. Tests steer it through the
 * fake_* functions (ctypes) or FAKE_CUDART_LAG_NS / FAKE_CUDART_NO_DEVICE at load time.
 *
 * Build: gcc -shared -fPIC -O1 fake_runtime.c -o libfakecudart.so [-DFAKE_HIP]
 * Not part of the stepwatch extension; compiled by tests/unit/test_cuda_ext*.py.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#ifdef FAKE_HIP
#define API(name) hip##name
#define DRV(name) hip##name
#else
#define API(name) cuda##name
#define DRV(name) cu##name /* driver API: libcuda.so.1 in real life, exported here too */
#endif

/* The codes the ring distinguishes, as in driver_types.h / hip_runtime_api.h. */
enum {
    OK = 0,
    ERR_INVALID_VALUE = 1,
    ERR_INSUFFICIENT_DRIVER = 35,
    ERR_INVALID_DEVICE = 101,
    ERR_INVALID_HANDLE = 400,
    ERR_NOT_READY = 600,
    ERR_CAPTURE_IMPLICIT = 906, /* cudaErrorStreamCaptureImplicit */
};

enum { MODE_GLOBAL = 0, MODE_THREAD_LOCAL = 1, MODE_RELAXED = 2 };

typedef struct {
    unsigned magic;
    int device;
    int recorded;
    int64_t done_at;
} fake_event;

#define MAGIC 0x5eedu

static int64_t g_lag_ns = 0;
static int g_device_count = 2;
static int g_no_device = 0;
static void *g_capture_stream = NULL;
static int g_capture_on = 0;
static int g_capture_blocking = 0; /* the capturing stream is a blocking one */
static int g_fail_records = 0;
static __thread int t_device = 0;
/* Primary contexts, per device and process-wide. As in CUDA >= 12, SetDevice initializes the
 * device's context, and so does a call that needs a context on a thread that has none current
 * (made current on the thread's device: 0 on a fresh thread). */
#define MAX_DEVICES 4
static int g_ctx_active[MAX_DEVICES];
static int64_t c_ctx_created[MAX_DEVICES];
static __thread int t_has_ctx = 0;
static void need_ctx(void) {
    if (t_has_ctx) return;
    t_has_ctx = 1;
    if (!g_ctx_active[t_device]) {
        g_ctx_active[t_device] = 1;
        c_ctx_created[t_device]++;
    }
}
static __thread int t_capture_mode = MODE_GLOBAL;

/* counters, read by fake_counter() */
static int64_t c_created, c_destroyed, c_records, c_queries, c_set_device, c_wrong_device, c_captured_records,
    c_capture_violations;

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

__attribute__((constructor)) static void fake_init(void) {
    const char *s = getenv("FAKE_CUDART_LAG_NS");
    if (s) g_lag_ns = atoll(s);
    s = getenv("FAKE_CUDART_NO_DEVICE");
    if (s && *s == '1') g_no_device = 1;
}

static fake_event *ev(void *p) {
    fake_event *e = p;
    return e && e->magic == MAGIC ? e : NULL;
}

int API(EventCreateWithFlags)(void **out, unsigned flags) {
    (void)flags;
    if (g_no_device) return ERR_INSUFFICIENT_DRIVER;
    need_ctx();
    fake_event *e = calloc(1, sizeof *e);
    if (!e) return 2;
    e->magic = MAGIC;
    e->device = t_device;
    *out = e;
    c_created++;
    return OK;
}

int API(EventRecord)(void *p, void *stream) {
    fake_event *e = ev(p);
    if (!e) return ERR_INVALID_HANDLE;
    if (g_fail_records > 0) {
        g_fail_records--;
        return ERR_INVALID_VALUE;
    }
    /* the real runtime refuses an event and a stream of different devices; the fake's streams
     * belong to the current device */
    if (e->device != t_device) return ERR_INVALID_HANDLE;
    if (g_capture_on && stream == g_capture_stream) c_captured_records++;
    e->recorded = 1;
    e->done_at = now_ns() + g_lag_ns;
    c_records++;
    return OK;
}

int API(EventQuery)(void *p) {
    fake_event *e = ev(p);
    c_queries++;
    need_ctx();
    if (!e) return ERR_INVALID_HANDLE;
    /* as the real runtime in cudaStreamCaptureModeGlobal: while any thread captures, a query
     * from a thread not in Relaxed mode is an "unsafe" call that invalidates the capture */
    if (g_capture_on && t_capture_mode != MODE_RELAXED) {
        c_capture_violations++;
        return ERR_CAPTURE_IMPLICIT;
    }
    /* stricter than the real runtime, on purpose: proves the poller made the device current */
    if (e->device != t_device) {
        c_wrong_device++;
        return ERR_INVALID_HANDLE;
    }
    if (!e->recorded) return OK;
    return now_ns() < e->done_at ? ERR_NOT_READY : OK;
}

int API(EventElapsedTime)(float *ms, void *a, void *b) {
    fake_event *s = ev(a), *t = ev(b);
    if (!s || !t || !s->recorded || !t->recorded) return ERR_INVALID_HANDLE;
    int64_t now = now_ns();
    if (now < s->done_at || now < t->done_at) return ERR_NOT_READY;
    *ms = (float)((double)(t->done_at - s->done_at) / 1e6);
    return OK;
}

int API(EventDestroy)(void *p) {
    fake_event *e = ev(p);
    if (!e) return ERR_INVALID_HANDLE;
    e->magic = 0;
    free(e);
    c_destroyed++;
    return OK;
}

int API(StreamIsCapturing)(void *stream, int *status) {
    /* as the real runtime: the legacy stream (0) cannot say while a blocking stream captures */
    if (g_capture_on && g_capture_blocking && stream == NULL) return ERR_CAPTURE_IMPLICIT;
    *status = g_capture_on && stream == g_capture_stream ? 1 : 0;
    return OK;
}

int API(ThreadExchangeStreamCaptureMode)(int *mode) {
    if (*mode < MODE_GLOBAL || *mode > MODE_RELAXED) return ERR_INVALID_VALUE;
    need_ctx(); /* seen with the real runtime on a fresh thread (meta-pytorch/torchcomms#777) */
    int old = t_capture_mode;
    t_capture_mode = *mode;
    *mode = old;
    return OK;
}

int API(SetDevice)(int d) {
    if (d < 0 || d >= g_device_count) return ERR_INVALID_DEVICE;
    t_device = d;
    c_set_device++;
    t_has_ctx = 0;
    need_ctx();
    return OK;
}

int DRV(DeviceGet)(int *dev, int ordinal) {
    if (ordinal < 0 || ordinal >= g_device_count) return ERR_INVALID_DEVICE;
    *dev = ordinal;
    return OK;
}

int DRV(DevicePrimaryCtxGetState)(int dev, unsigned *flags, int *active) {
    if (dev < 0 || dev >= g_device_count) return ERR_INVALID_DEVICE;
    *flags = 0;
    *active = g_ctx_active[dev];
    return OK;
}

int API(GetDevice)(int *d) {
    if (g_no_device) return ERR_INSUFFICIENT_DRIVER;
    *d = t_device;
    return OK;
}

const char *API(GetErrorString)(int code) {
    static __thread char buf[64];
    snprintf(buf, sizeof buf, "fake runtime error %d", code);
    return buf;
}

/* -- test controls -- */
void fake_set_lag_ns(int64_t ns) { g_lag_ns = ns; }
void fake_set_capture(void *stream, int on) {
    g_capture_stream = stream;
    g_capture_on = on;
    g_capture_blocking = 0;
}
void fake_set_capture_blocking(int blocking) { g_capture_blocking = blocking; }
void fake_fail_records(int n) { g_fail_records = n; }
void fake_set_no_device(int on) { g_no_device = on; }
/* Forget every context (the calling thread's included): a process that has not used a GPU. */
void fake_reset_contexts(void) {
    for (int i = 0; i < MAX_DEVICES; i++) g_ctx_active[i] = 0, c_ctx_created[i] = 0;
    t_has_ctx = 0;
}
int64_t fake_contexts_created(int d) { return d >= 0 && d < MAX_DEVICES ? c_ctx_created[d] : -1; }

int64_t fake_counter(const char *name) {
    struct {
        const char *n;
        int64_t *v;
    } t[] = {{"created", &c_created},       {"destroyed", &c_destroyed},
             {"records", &c_records},       {"queries", &c_queries},
             {"set_device", &c_set_device}, {"wrong_device", &c_wrong_device},
             {"captured_records", &c_captured_records},
             {"capture_violations", &c_capture_violations}};
    for (size_t i = 0; i < sizeof t / sizeof t[0]; i++) {
        const char *a = t[i].n, *b = name;
        while (*a && *a == *b) a++, b++;
        if (*a == *b) return *t[i].v;
    }
    return -1;
}

/* stepwatch.cuda_ext._native: the thin CPython binding over the event ring.
 *
 * CPython C API with METH_FASTCALL, not pybind11 or ctypes: the hot calls (begin/end) cost
 * ~20 ns of binding overhead this way, against ~60 ns for pybind11 and 190-360 ns for ctypes
 * (measured for issue 8). Every call runs with the GIL held, which is what serialises the
 * training thread's begin/end against the background thread's poll.
 *
 * The hot path never raises for conditions of the run (full ring, graph capture, runtime error,
 * stale slot): it counts them and returns -1 / None. It raises only for wrong argument types.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <stdint.h>

#include "ring.h"
#include "runtime.h"

#if defined(__GNUC__)
#define UNLIKELY(x) __builtin_expect(!!(x), 0)
#else
#define UNLIKELY(x) (x)
#endif

#define MAX_CAPACITY (1u << 16)

static PyObject *RuntimeUnavailable; /* subclass of RuntimeError */

/* Bumped in every forked child (pthread_atfork); a ring whose generation differs was created
 * by an ancestor process and resets itself on its next call. */
static volatile unsigned g_fork_gen = 0;
static void on_fork_child(void) { g_fork_gen++; }

static const char FORKED_DEVICE[] =
    "forked child: CUDA/HIP events are not inherited across fork(), device timing is off in this "
    "process (use the 'spawn' start method, or time on the host)";

typedef struct {
    PyObject_HEAD
    sw_ring ring;
    int initialized;
    int closed;
    int events_foreign; /* after fork: the events belong to the parent's context */
    unsigned fork_gen;
    uint64_t reset_seq; /* slots below this were opened before the last fork reset */
    const char *disabled;
    PyObject *weakreflist;
} RingObject;

static void release_tag(void *ctx, void *tag) {
    (void)ctx;
    Py_XDECREF((PyObject *)tag);
}

static int emit_tuple(void *ctx, void *tag, uint64_t seq, double elapsed_s) {
    PyObject *list = (PyObject *)ctx;
    PyObject *s = PyLong_FromUnsignedLongLong(seq);
    PyObject *e = s ? PyFloat_FromDouble(elapsed_s) : NULL;
    PyObject *t = e ? PyTuple_New(3) : NULL;
    if (!t) {
        Py_XDECREF(s);
        Py_XDECREF(e);
        return -1;
    }
    PyTuple_SET_ITEM(t, 0, (PyObject *)tag); /* steals the ring's reference */
    PyTuple_SET_ITEM(t, 1, s);
    PyTuple_SET_ITEM(t, 2, e);
    if (PyList_Append(list, t) != 0) {
        /* the tuple would free the tag: keep the ring's reference alive for the next poll */
        Py_INCREF((PyObject *)tag);
        Py_DECREF(t);
        return -1;
    }
    Py_DECREF(t);
    return 0;
}

static void after_fork(RingObject *self) {
    self->fork_gen = g_fork_gen;
    if (!self->initialized || self->closed) return;
    sw_ring_clear(&self->ring, release_tag, NULL);
    self->reset_seq = self->ring.head;
    self->ring.dropped = self->ring.captured = self->ring.errors = 0;
    self->ring.completed = self->ring.bad_end = 0;
    self->ring.last_error = 0;
    if (self->ring.rt) {
        self->events_foreign = 1;
        self->disabled = FORKED_DEVICE;
    }
}

#define CHECK_FORK(self)                                       \
    do {                                                       \
        if (UNLIKELY((self)->fork_gen != g_fork_gen)) after_fork(self); \
    } while (0)

static int parse_stream(PyObject *o, sw_stream_t *out) {
    if (o == Py_None) {
        *out = NULL;
        return 0;
    }
    if (!PyLong_Check(o)) {
        PyErr_Format(PyExc_TypeError,
                     "stream must be a raw stream handle (int, e.g. torch.cuda.current_stream().cuda_stream) "
                     "or None, not %.80s",
                     Py_TYPE(o)->tp_name);
        return -1;
    }
    void *p = PyLong_AsVoidPtr(o);
    if (p == NULL && PyErr_Occurred()) return -1;
    *out = p;
    return 0;
}

static PyObject *Ring_begin(RingObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (UNLIKELY(nargs != 2)) {
        PyErr_SetString(PyExc_TypeError, "begin(stream, tag) takes exactly 2 arguments");
        return NULL;
    }
    CHECK_FORK(self);
    if (UNLIKELY(self->closed || self->disabled)) return PyLong_FromLong(-1);
    sw_stream_t stream = NULL;
    /* the host backend has no streams: the argument is accepted and ignored */
    if (self->ring.rt && parse_stream(args[0], &stream) != 0) return NULL;
    PyObject *tag = args[1];
    Py_INCREF(tag);
    int64_t seq = sw_ring_begin(&self->ring, stream, tag);
    if (seq < 0) {
        Py_DECREF(tag);
        return PyLong_FromLong(-1);
    }
    return PyLong_FromLongLong(seq);
}

static PyObject *Ring_end(RingObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (UNLIKELY(nargs < 1 || nargs > 2)) {
        PyErr_SetString(PyExc_TypeError, "end(slot, stream=None) takes 1 or 2 arguments");
        return NULL;
    }
    if (UNLIKELY(!PyLong_Check(args[0]))) {
        PyErr_Format(PyExc_TypeError, "slot must be the int returned by begin(), not %.80s",
                     Py_TYPE(args[0])->tp_name);
        return NULL;
    }
    long long seq = PyLong_AsLongLong(args[0]);
    if (seq == -1) {
        if (PyErr_Occurred()) return NULL;
        Py_RETURN_FALSE; /* begin() recorded nothing */
    }
    CHECK_FORK(self);
    if (UNLIKELY(self->closed || self->disabled)) Py_RETURN_FALSE;
    sw_stream_t stream = NULL;
    if (self->ring.rt && nargs == 2 && parse_stream(args[1], &stream) != 0) return NULL;
    if (UNLIKELY(seq >= 0 && (uint64_t)seq < self->reset_seq)) Py_RETURN_FALSE; /* opened before fork */
    void *release = NULL;
    int r = sw_ring_end(&self->ring, seq, stream, &release);
    if (r == 1) Py_XDECREF((PyObject *)release);
    if (r == 0) Py_RETURN_TRUE;
    Py_RETURN_FALSE;
}

static PyObject *Ring_cancel(RingObject *self, PyObject *arg) {
    long long seq = PyLong_AsLongLong(arg);
    if (seq == -1 && PyErr_Occurred()) return NULL;
    CHECK_FORK(self);
    if (self->closed || seq < 0) Py_RETURN_FALSE;
    void *release = NULL;
    if (sw_ring_cancel(&self->ring, seq, &release) != 0) Py_RETURN_FALSE;
    Py_XDECREF((PyObject *)release);
    Py_RETURN_TRUE;
}

static PyObject *Ring_poll(RingObject *self, PyObject *Py_UNUSED(ignored)) {
    CHECK_FORK(self);
    PyObject *out = PyList_New(0);
    if (!out || self->closed || self->disabled) return out;
    if (sw_ring_poll(&self->ring, emit_tuple, release_tag, out) < 0) {
        Py_DECREF(out);
        return NULL;
    }
    return out;
}

static void ring_close(RingObject *self) {
    if (!self->initialized || self->closed) return;
    self->closed = 1;
    sw_ring_clear(&self->ring, release_tag, NULL);
    sw_ring_free(&self->ring, !self->events_foreign);
}

static PyObject *Ring_close(RingObject *self, PyObject *Py_UNUSED(ignored)) {
    CHECK_FORK(self);
    ring_close(self);
    Py_RETURN_NONE;
}

static const char *kind_name(const sw_ring *r) {
    if (!r->rt) return "host";
    return r->rt->kind == SW_KIND_HIP ? "hip" : "cuda";
}

static PyObject *Ring_stats(RingObject *self, PyObject *Py_UNUSED(ignored)) {
    CHECK_FORK(self);
    const sw_ring *r = &self->ring;
    return Py_BuildValue("{s:s,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:i,s:O}", "backend", kind_name(r), "capacity",
                         (unsigned long long)r->cap, "pending", (unsigned long long)sw_ring_pending(r),
                         "dropped", (unsigned long long)r->dropped, "captured",
                         (unsigned long long)r->captured, "errors", (unsigned long long)r->errors,
                         "completed", (unsigned long long)r->completed, "bad_end",
                         (unsigned long long)r->bad_end, "last_error", (int)r->last_error, "closed",
                         self->closed ? Py_True : Py_False);
}

#define COUNTER_GETTER(name)                                                     \
    static PyObject *Ring_get_##name(RingObject *self, void *Py_UNUSED(c)) {     \
        CHECK_FORK(self);                                                        \
        return PyLong_FromUnsignedLongLong((unsigned long long)self->ring.name); \
    }
COUNTER_GETTER(dropped)
COUNTER_GETTER(captured)
COUNTER_GETTER(errors)
COUNTER_GETTER(completed)
COUNTER_GETTER(bad_end)
COUNTER_GETTER(cap)

static PyObject *Ring_get_pending(RingObject *self, void *Py_UNUSED(c)) {
    CHECK_FORK(self);
    return PyLong_FromUnsignedLongLong((unsigned long long)sw_ring_pending(&self->ring));
}

static PyObject *Ring_get_backend(RingObject *self, void *Py_UNUSED(c)) {
    return PyUnicode_FromString(kind_name(&self->ring));
}

static PyObject *Ring_get_library(RingObject *self, void *Py_UNUSED(c)) {
    if (!self->ring.rt) Py_RETURN_NONE;
    return PyUnicode_FromString(self->ring.rt->path);
}

static PyObject *Ring_get_device(RingObject *self, void *Py_UNUSED(c)) {
    if (!self->ring.rt) Py_RETURN_NONE;
    return PyLong_FromLong(self->ring.device);
}

static PyObject *Ring_get_disabled(RingObject *self, void *Py_UNUSED(c)) {
    CHECK_FORK(self);
    if (!self->disabled) Py_RETURN_NONE;
    return PyUnicode_FromString(self->disabled);
}

static PyObject *Ring_get_closed(RingObject *self, void *Py_UNUSED(c)) { return PyBool_FromLong(self->closed); }

static int Ring_init(RingObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"capacity", "backend", "library", "device", NULL};
    PyObject *cap_o = NULL, *dev_o = Py_None;
    const char *backend = "host", *library = NULL;
    if (self->initialized) {
        PyErr_SetString(PyExc_RuntimeError, "Ring is already initialised");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|OszO:Ring", kwlist, &cap_o, &backend, &library, &dev_o))
        return -1;
    long cap = 1024;
    if (cap_o) {
        cap = PyLong_Check(cap_o) && !PyBool_Check(cap_o) ? PyLong_AsLong(cap_o) : -1;
        if (cap == -1 && PyErr_Occurred()) PyErr_Clear();
        if (cap < 2 || cap > (long)MAX_CAPACITY) {
            PyErr_Format(PyExc_ValueError, "capacity must be an int in [2, %u] (rounded up to a power of two)",
                         MAX_CAPACITY);
            return -1;
        }
    }
    int want;
    if (strcmp(backend, "host") == 0) want = -1;
    else if (strcmp(backend, "device") == 0) want = SW_WANT_ANY;
    else if (strcmp(backend, "cuda") == 0) want = SW_WANT_CUDA;
    else if (strcmp(backend, "hip") == 0) want = SW_WANT_HIP;
    else {
        PyErr_Format(PyExc_ValueError, "backend must be one of 'host', 'device', 'cuda', 'hip', not '%s'",
                     backend);
        return -1;
    }
    int device = -1;
    if (dev_o != Py_None) {
        device = PyLong_Check(dev_o) && !PyBool_Check(dev_o) ? (int)PyLong_AsLong(dev_o) : -1;
        if (device == -1 && PyErr_Occurred()) PyErr_Clear();
        if (device < 0) {
            PyErr_SetString(PyExc_ValueError, "device must be None (the current device) or an int >= 0");
            return -1;
        }
    }
    if (want < 0 && (library || dev_o != Py_None)) {
        PyErr_SetString(PyExc_ValueError, "library and device apply only to backend 'device', 'cuda' or 'hip'");
        return -1;
    }
    const sw_runtime *rt = NULL;
    char err[2048];
    if (want >= 0) {
        rt = sw_runtime_load(want, library, err, sizeof err);
        if (!rt) {
            const char *what = want == SW_WANT_CUDA ? "CUDA" : want == SW_WANT_HIP ? "HIP" : "CUDA or HIP";
            PyErr_Format(RuntimeUnavailable, "no usable %s runtime library; tried: %s", what, err);
            return -1;
        }
    }
    if (sw_ring_init(&self->ring, (uint64_t)cap, rt, device, err, sizeof err) != 0) {
        /* a runtime without a working driver or device is as unusable as no runtime */
        if (rt) PyErr_Format(RuntimeUnavailable, "%s loaded, but cannot create events: %s", rt->path, err);
        else PyErr_Format(PyExc_MemoryError, "cannot create the event ring: %s", err);
        return -1;
    }
    self->fork_gen = g_fork_gen;
    self->initialized = 1;
    return 0;
}

static void Ring_dealloc(RingObject *self) {
    if (self->weakreflist) PyObject_ClearWeakRefs((PyObject *)self);
    if (self->fork_gen != g_fork_gen) after_fork(self);
    ring_close(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef Ring_methods[] = {
    {"begin", (PyCFunction)(void (*)(void))Ring_begin, METH_FASTCALL,
     "begin(stream, tag) -> slot: record the start of an interval on the raw stream (ignored on host).\n"
     "Returns -1 when nothing was recorded (ring full, stream capturing a graph, runtime error)."},
    {"end", (PyCFunction)(void (*)(void))Ring_end, METH_FASTCALL,
     "end(slot, stream=None) -> bool: record the end of the interval begun as slot; True when it "
     "will come out of poll(), False when given up (capture began, runtime error) or ignored (-1, stale)."},
    {"cancel", (PyCFunction)Ring_cancel, METH_O, "cancel(slot) -> bool: give up an open interval."},
    {"poll", (PyCFunction)Ring_poll, METH_NOARGS,
     "poll() -> [(tag, slot, elapsed_s)]: finished intervals, oldest first; never blocks."},
    {"close", (PyCFunction)Ring_close, METH_NOARGS, "close(): drop pending intervals and free the events."},
    {"stats", (PyCFunction)Ring_stats, METH_NOARGS, "stats() -> dict of the counters."},
    {NULL, NULL, 0, NULL}};

static PyGetSetDef Ring_getset[] = {
    {"pending", (getter)Ring_get_pending, NULL, "slots taken and not yet polled", NULL},
    {"dropped", (getter)Ring_get_dropped, NULL, "begin() calls refused because the ring was full", NULL},
    {"captured", (getter)Ring_get_captured, NULL, "intervals skipped: the stream was capturing a graph", NULL},
    {"errors", (getter)Ring_get_errors, NULL, "intervals lost to runtime errors", NULL},
    {"completed", (getter)Ring_get_completed, NULL, "intervals returned by poll()", NULL},
    {"bad_end", (getter)Ring_get_bad_end, NULL, "end() calls naming no open slot", NULL},
    {"capacity", (getter)Ring_get_cap, NULL, "number of slots (a power of two)", NULL},
    {"backend", (getter)Ring_get_backend, NULL, "'host', 'cuda' or 'hip'", NULL},
    {"library", (getter)Ring_get_library, NULL, "runtime library in use (None on host)", NULL},
    {"device", (getter)Ring_get_device, NULL, "device index the events live on (None on host)", NULL},
    {"disabled", (getter)Ring_get_disabled, NULL, "why the ring records nothing, or None", NULL},
    {"closed", (getter)Ring_get_closed, NULL, "close() was called", NULL},
    {NULL, NULL, NULL, NULL, NULL}};

static PyTypeObject RingType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "stepwatch.cuda_ext._native.Ring",
    .tp_basicsize = sizeof(RingObject),
    .tp_dealloc = (destructor)Ring_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_doc = "Ring(capacity=1024, backend='host', library=None, device=None): a fixed ring of timing slots.",
    .tp_weaklistoffset = offsetof(RingObject, weakreflist),
    .tp_methods = Ring_methods,
    .tp_getset = Ring_getset,
    .tp_init = (initproc)Ring_init,
    .tp_new = PyType_GenericNew,
};

static PyObject *mod_load_runtime(PyObject *Py_UNUSED(m), PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"backend", "library", NULL};
    const char *backend = "device", *library = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|sz:load_runtime", kwlist, &backend, &library)) return NULL;
    int want;
    if (strcmp(backend, "device") == 0) want = SW_WANT_ANY;
    else if (strcmp(backend, "cuda") == 0) want = SW_WANT_CUDA;
    else if (strcmp(backend, "hip") == 0) want = SW_WANT_HIP;
    else {
        PyErr_Format(PyExc_ValueError, "backend must be one of 'device', 'cuda', 'hip', not '%s'", backend);
        return NULL;
    }
    char err[2048];
    const sw_runtime *rt = sw_runtime_load(want, library, err, sizeof err);
    if (!rt) {
        PyErr_Format(RuntimeUnavailable, "no usable runtime library; tried: %s", err);
        return NULL;
    }
    return Py_BuildValue("(ss)", rt->kind == SW_KIND_HIP ? "hip" : "cuda", rt->path);
}

/* The runtime for the module-level event functions; sets RuntimeUnavailable when none loads. */
static const sw_runtime *event_runtime(const char *library) {
    char err[2048];
    const sw_runtime *rt = sw_runtime_load(SW_WANT_ANY, library, err, sizeof err);
    if (!rt) PyErr_Format(RuntimeUnavailable, "no usable runtime library; tried: %s", err);
    return rt;
}

static PyObject *event_error(const sw_runtime *rt, const char *call, sw_err_t e) {
    PyErr_Format(PyExc_RuntimeError, "%s%s failed: %s (%d)", rt->kind == SW_KIND_HIP ? "hip" : "cuda", call,
                 sw_runtime_strerror(rt, e), e);
    return NULL;
}

static PyObject *mod_event_query(PyObject *Py_UNUSED(m), PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"event", "device", "library", NULL};
    unsigned long long handle = 0;
    int device = -1;
    const char *library = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "Ki|z:event_query", kwlist, &handle, &device, &library))
        return NULL;
    if (!handle) Py_RETURN_TRUE; /* torch creates events lazily: never recorded, nothing to wait for */
    const sw_runtime *rt = event_runtime(library);
    if (!rt) return NULL;
    sw_err_t e = sw_event_query(rt, device, (sw_event_t)(uintptr_t)handle, NULL, NULL);
    if (e == SW_SUCCESS) Py_RETURN_TRUE;
    if (e == SW_ERR_NOT_READY) Py_RETURN_FALSE;
    return event_error(rt, "EventQuery", e);
}

static PyObject *mod_event_elapsed_ms(PyObject *Py_UNUSED(m), PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"start", "end", "device", "library", NULL};
    unsigned long long start = 0, end = 0;
    int device = -1;
    const char *library = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "KKi|z:event_elapsed_ms", kwlist, &start, &end, &device, &library))
        return NULL;
    if (!start || !end) {
        PyErr_SetString(PyExc_ValueError, "event_elapsed_ms: both events must have been recorded (handle 0 given)");
        return NULL;
    }
    const sw_runtime *rt = event_runtime(library);
    if (!rt) return NULL;
    float ms = 0.0f;
    sw_err_t e = sw_event_query(rt, device, (sw_event_t)(uintptr_t)end, (sw_event_t)(uintptr_t)start, &ms);
    if (e != SW_SUCCESS) return event_error(rt, e == SW_ERR_NOT_READY ? "EventQuery" : "EventElapsedTime", e);
    return PyFloat_FromDouble((double)ms);
}

static PyObject *mod_now_ns(PyObject *Py_UNUSED(m), PyObject *Py_UNUSED(a)) {
    return PyLong_FromLongLong(sw_now_ns());
}

static PyMethodDef module_methods[] = {
    {"load_runtime", (PyCFunction)(void (*)(void))mod_load_runtime, METH_VARARGS | METH_KEYWORDS,
     "load_runtime(backend='device', library=None) -> (kind, path): find the CUDA/HIP runtime "
     "(already loaded first). Raises RuntimeUnavailable naming every library tried."},
    {"now_ns", mod_now_ns, METH_NOARGS, "CLOCK_MONOTONIC in ns (the host backend's clock)."},
    {"event_query", (PyCFunction)(void (*)(void))mod_event_query, METH_VARARGS | METH_KEYWORDS,
     "event_query(event, device, library=None) -> bool: has the event (a raw handle, e.g. "
     "torch.cuda.Event.cuda_event) completed? Never blocks; runs on `device` (negative: the current "
     "one) in relaxed capture mode, so it is safe from a background thread during a graph capture."},
    {"event_elapsed_ms", (PyCFunction)(void (*)(void))mod_event_elapsed_ms, METH_VARARGS | METH_KEYWORDS,
     "event_elapsed_ms(start, end, device, library=None) -> float: ms between two completed events, "
     "as event_query; RuntimeError when `end` is not done."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef moduledef = {PyModuleDef_HEAD_INIT, "_native",
                                       "Native event ring for stepwatch (host, CUDA and HIP backends).", -1,
                                       module_methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__native(void) {
    static int atfork_done = 0;
    if (PyType_Ready(&RingType) < 0) return NULL;
    PyObject *m = PyModule_Create(&moduledef);
    if (!m) return NULL;
    if (!RuntimeUnavailable) {
        RuntimeUnavailable = PyErr_NewExceptionWithDoc(
            "stepwatch.cuda_ext._native.RuntimeUnavailable",
            "No CUDA/HIP runtime library could be loaded; the message lists what was tried.",
            PyExc_RuntimeError, NULL);
        if (!RuntimeUnavailable) goto fail;
    }
    Py_INCREF(RuntimeUnavailable);
    if (PyModule_AddObject(m, "RuntimeUnavailable", RuntimeUnavailable) < 0) {
        Py_DECREF(RuntimeUnavailable);
        goto fail;
    }
    Py_INCREF(&RingType);
    if (PyModule_AddObject(m, "Ring", (PyObject *)&RingType) < 0) {
        Py_DECREF(&RingType);
        goto fail;
    }
    if (PyModule_AddIntConstant(m, "MAX_CAPACITY", MAX_CAPACITY) < 0) goto fail;
    if (!atfork_done) {
        if (pthread_atfork(NULL, NULL, on_fork_child) != 0) {
            PyErr_SetString(PyExc_OSError, "pthread_atfork failed");
            goto fail;
        }
        atfork_done = 1;
    }
    return m;
fail:
    Py_DECREF(m);
    return NULL;
}

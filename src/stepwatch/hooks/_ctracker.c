/* stepwatch.hooks._ctracker: the step tracker's hot methods in C.
 *
 * hooks/phases.py's StepTracker is a handful of integer accumulators driven by the hooks: a
 * forward's begin and end, a backward's, an optimizer step's, a data fetch's, log(), and the
 * step's hand-over at its end. In Python those are ~700 bytecodes and a dozen frames a step, a
 * third of everything stepwatch runs on the training thread. This module is that same code in C,
 * line for line: `Core` is the tracker's state (the same attribute names, each a Python object,
 * as phases.py's `_PyCore.__slots__` holds them) and its hot methods. The rest of the tracker
 * (checkpoints, GradScaler, user phases, closures, flush) stays in Python, in phases.py, over the
 * same attributes; so does every branch here that calls back into Python (`_pause_opt`,
 * `_resume_opt`, `_fail`), which keeps the rare logic in one place.
 *
 * It is an accelerator only: phases.py keeps `_PyCore`, the reference these methods translate,
 * and takes it wherever this module is missing; tests run the tracker with both and compare
 * them record for record.
 *
 * Errors behave as in Python: an Exception inside a method goes to `self._fail(where, exc)` and
 * the method returns its default (the tracker disables itself); a BaseException that is not an
 * Exception (KeyboardInterrupt from a collector) passes through.
 *
 * The cyclic GC. A record waits in the pipeline's queue for up to a pass (0.25 s: thousands of
 * steps at a fast step), so every container it holds outlives two young collections and lands in
 * the oldest generation, whose growth (a quarter of it) triggers full collections, and those walk
 * every tracked object of the process (torch's modules included). A step's own containers here
 * (the record, its extras dict, the backward spans and their tuples) cannot be part of a cycle:
 * nothing they hold can reach them. So they are not tracked: not walked by any collection and
 * not counted toward a full one. What they hold stays tracked unless its maker untracks it too
 * (`untracked(obj)`: the collectors' step payloads, which hold numbers and cached counts).
 *
 * The clock is time.perf_counter_ns's (_PyTime_GetPerfCounter / PyTime_PerfCounter), so the
 * Python methods' timestamps and these compare. `_set_clock(fn)` (tests only) makes every C
 * timestamp `fn()` instead.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include "../_cobjects.h"

static PyObject *clock_override = NULL; /* tests: a callable returning int ns */
static PyObject *raw_step_cls = NULL;   /* stepwatch.record.RawStep, from _bind() */

/* Interned names. */
static PyObject *s_opt_stale, *s_pause_opt, *s_resume_opt, *s_pause_bwd, *s_resume_bwd, *s_drop_opt, *s_fail, *s_push_step, *s_push_range, *s_pop_range,
    *s_forward, *s_eval, *s_training, *s_eval_open, *s_backward, *s_optimizer, *s_set_phase, *s_set_step, *s_begin, *s_end,
    *s_name, *s_take, *s_update, *s_backward_spans, *s_checkpoint_bytes, *s_explicit;

/* The phase codes of hooks/phases.py (PHASE_OTHER..PHASE_CHECKPOINT). */
enum { PH_OTHER, PH_DATA, PH_FORWARD, PH_BACKWARD, PH_OPTIMIZER, PH_EVAL, PH_CHECKPOINT };

typedef struct {
    PyObject_HEAD
    PyObject *enabled, *_emit, *_nvtx, *_mem_probe, *_on_error, *collectors, *listeners, *progress,
        *device, *_dslot_fwd, *_dslot_bwd, *_dslot_opt, *step, *boundary, *in_data, *_t_start,
        *_prev_end, *_pending_end, *_pending_skipped, *_step_open, *_fwd_depth, *_fwd_t0,
        *_fwd_grad, *_bwd_depth, *_bwd_t0, *_opt_depth, *_opt_t0, *_opt_paused, *_fwd_paused_opt,
        *_bwd_paused_opt, *_ckpt_depth, *_ckpt_t0, *_eval_open, *_eval_t0, *_eval_end, *_eval_calls,
        *_eval_pulls, *_eval_pulled, *_eval_fwd, *_eval_bwd, *_eval_judged, *_bwd_eval, *_eval_last, *_span_judged, *_last_fetch_t0, *_last_fetch_ns, *_iter_t0, *_iter_t1, *_thread,
        *_in_scaler, *_scaler_fired, *_data, *_fwd, *_bwd, *_opt, *_eval, *_ckpt, *_own, *_ckpt_bytes, *_bwd_spans,
        *_phases, *_scalars;
} Core; /* no __dict__ or __weakref__ of its own: phases.py's StepTracker, a subclass, has both */

/* The object fields in declaration order, for members, traverse and clear. */
#define FIELDS(X)                                                                                      \
    X(enabled) X(_emit) X(_nvtx) X(_mem_probe) X(_on_error) X(collectors) X(listeners) X(progress)     \
    X(device) X(_dslot_fwd) X(_dslot_bwd) X(_dslot_opt) X(step) X(boundary) X(in_data) X(_t_start)     \
    X(_prev_end) X(_pending_end) X(_pending_skipped) X(_step_open) X(_fwd_depth) X(_fwd_t0)            \
    X(_fwd_grad) X(_bwd_depth) X(_bwd_t0) X(_opt_depth) X(_opt_t0) X(_opt_paused) X(_fwd_paused_opt)   \
    X(_bwd_paused_opt) X(_ckpt_depth) X(_ckpt_t0) X(_eval_open) X(_eval_t0) X(_eval_end)               \
    X(_eval_calls) X(_eval_pulls) X(_eval_pulled) X(_eval_fwd) X(_eval_bwd) X(_eval_judged) X(_bwd_eval) \
    X(_eval_last) X(_span_judged)                                                                      \
    X(_last_fetch_t0) X(_last_fetch_ns) X(_iter_t0) X(_iter_t1) X(_thread) X(_in_scaler) X(_scaler_fired) \
    X(_data) X(_fwd) X(_bwd)                                                                           \
    X(_opt) X(_eval) X(_ckpt) X(_own) X(_ckpt_bytes) X(_bwd_spans) X(_phases) X(_scalars)

/* A field read before Python's __init__ set it: the AttributeError Python would raise. */
static PyObject *unset(const char *name) {
    PyErr_Format(PyExc_AttributeError, "'StepTracker' object has no attribute '%s'", name);
    return NULL;
}

#define GET(self, f) ((self)->f ? (self)->f : unset(#f))

static inline void put(PyObject **slot, PyObject *v) { /* steals v */
    PyObject *old = *slot;
    *slot = v;
    Py_XDECREF(old);
}

static inline void put_obj(PyObject **slot, PyObject *v) { /* borrows v */
    Py_INCREF(v);
    put(slot, v);
}

/* An int as a C integer: 0, or -1 with Python's exception (TypeError, OverflowError). Through
 * PyLong_AsLongLongAndOverflow: for a nanosecond timestamp (an int of two or three digits)
 * PyLong_AsLongLong takes _PyLong_AsByteArray's general path, ~5 times the instructions. */
static inline int as_ll(PyObject *v, long long *out) {
    int overflow;
    long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
    if (x == -1 && PyErr_Occurred()) return -1;
    if (overflow) {
        PyErr_SetString(PyExc_OverflowError, "Python int too large to convert to C long long");
        return -1;
    }
    *out = x;
    return 0;
}

/* An int field as a C integer; -1 with an exception set when it is not one. */
static inline int get_ll(PyObject *v, const char *name, long long *out) {
    if (v == NULL) {
        unset(name);
        return -1;
    }
    return as_ll(v, out);
}

#define LL(self, f, var)                                                                               \
    long long var;                                                                                     \
    if (get_ll((self)->f, #f, &var) < 0) goto error

static inline int put_ll(PyObject **slot, long long v) {
    PyObject *o = PyLong_FromLongLong(v);
    if (o == NULL) return -1;
    put(slot, o);
    return 0;
}

#define PUT_LL(self, f, v)                                                                             \
    if (put_ll(&(self)->f, (v)) < 0) goto error

/* Truthiness of a field; -1 on error. */
static inline int truth(PyObject *v, const char *name) {
    if (v == Py_True) return 1;
    if (v == Py_False || v == Py_None) return 0;
    if (v == NULL) {
        unset(name);
        return -1;
    }
    return PyObject_IsTrue(v);
}

#define TRUTH(self, f, var)                                                                            \
    int var = truth((self)->f, #f);                                                                    \
    if (var < 0) goto error

static int now_ns(long long *out) {
    if (clock_override != NULL) {
        PyObject *r = PyObject_CallNoArgs(clock_override);
        if (r == NULL) return -1;
        int rc = as_ll(r, out);
        Py_DECREF(r);
        return rc;
    }
#if PY_VERSION_HEX >= 0x030D0000
    PyTime_t t;
    if (PyTime_PerfCounter(&t) < 0) return -1;
    *out = (long long)t;
#else
    *out = (long long)_PyTime_GetPerfCounter(); /* nanoseconds: what time.perf_counter_ns() returns */
#endif
    return 0;
}

#define NOW(var)                                                                                       \
    long long var;                                                                                     \
    if (now_ns(&var) < 0) goto error

/* obj.name(arg) for a method of one optional argument (arg NULL: no argument); -1 on error. */
static int call_method(PyObject *obj, PyObject *name, PyObject *arg) {
    PyObject *r = arg ? PyObject_CallMethodOneArg(obj, name, arg) : PyObject_CallMethodNoArgs(obj, name);
    if (r == NULL) return -1;
    Py_DECREF(r);
    return 0;
}

static int call_method_int(PyObject *obj, PyObject *name, long long v) {
    PyObject *a = PyLong_FromLongLong(v);
    if (a == NULL) return -1;
    int rc = call_method(obj, name, a);
    Py_DECREF(a);
    return rc;
}

/* progress.set_phase(code) when a progress board is attached. */
static int set_phase(Core *self, int code) {
    PyObject *p = GET(self, progress);
    if (p == NULL) return -1;
    if (p == Py_None) return 0;
    return call_method_int(p, s_set_phase, code);
}

/* slot = device.begin(code) when a device timer is attached (hooks/device.py). */
static int device_begin(Core *self, int code, PyObject **slot) {
    PyObject *dev = GET(self, device);
    if (dev == NULL) return -1;
    if (dev == Py_None) return 0;
    PyObject *a = PyLong_FromLong(code);
    PyObject *r = a ? PyObject_CallMethodOneArg(dev, s_begin, a) : NULL;
    Py_XDECREF(a);
    if (r == NULL) return -1;
    put(slot, r);
    return 0;
}

/* device.end(slot) when a device timer is attached. */
static int device_end(Core *self, PyObject *slot, const char *name) {
    PyObject *dev = GET(self, device);
    if (dev == NULL) return -1;
    if (dev == Py_None) return 0;
    if (slot == NULL) {
        unset(name);
        return -1;
    }
    return call_method(dev, s_end, slot);
}

/* nvtx.push_range(nvtx.<range>) when NVTX is on. */
static int nvtx_push(Core *self, PyObject *range) {
    PyObject *nv = GET(self, _nvtx);
    if (nv == NULL) return -1;
    if (nv == Py_None) return 0;
    PyObject *name = PyObject_GetAttr(nv, range);
    if (name == NULL) return -1;
    int rc = call_method(nv, s_push_range, name);
    Py_DECREF(name);
    return rc;
}

/* nvtx.pop_range() when NVTX is on. */
static int nvtx_pop(Core *self) {
    PyObject *nv = GET(self, _nvtx);
    if (nv == NULL) return -1;
    return nv == Py_None ? 0 : call_method(nv, s_pop_range, NULL);
}

/* An Exception went to self._fail(where, exc): 0, the caller returns its default. Anything that
 * is not an Exception (KeyboardInterrupt, SystemExit): -1, it propagates. */
static int fail(Core *self, const char *where) {
    if (!PyErr_ExceptionMatches(PyExc_Exception)) return -1;
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb != NULL && value != NULL) PyException_SetTraceback(value, tb);
    Py_XDECREF(type);
    Py_XDECREF(tb);
    PyObject *w = PyUnicode_FromString(where);
    PyObject *r = NULL;
    if (w != NULL) {
        PyObject *args[3] = {(PyObject *)self, w, value ? value : Py_None};
        r = PyObject_VectorcallMethod(s_fail, args, 3 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
        Py_DECREF(w);
    }
    Py_XDECREF(value);
    if (r == NULL) return -1;
    Py_DECREF(r);
    return 0;
}

/* -- the methods (each the C of the same-named method of phases.py's _PyCore) ---------------- */

static int reset_step(Core *self) {
    PyObject *zero = PyLong_FromLong(0);
    put_obj(&self->_data, zero);
    put_obj(&self->_fwd, zero);
    put_obj(&self->_bwd, zero);
    put_obj(&self->_opt, zero);
    put_obj(&self->_eval, zero);
    put_obj(&self->_ckpt, zero);
    put(&self->_own, zero);
    put_obj(&self->_ckpt_bytes, Py_None);
    PyObject *spans = PyList_New(0), *scalars = PyDict_New();
    if (spans == NULL || scalars == NULL) {
        Py_XDECREF(spans);
        Py_XDECREF(scalars);
        return -1;
    }
    PyObject_GC_UnTrack(spans); /* the tracker's (ints) spans only (see "The cyclic GC" above) */
    put(&self->_bwd_spans, spans);
    put_obj(&self->_phases, Py_None); /* user phases: a dict made by the first one to end (phases.py) */
    put(&self->_scalars, scalars);
    return 0;
}

static PyObject *Core_reset_step(Core *self, PyObject *unused) {
    if (reset_step(self) < 0) return NULL;
    Py_RETURN_NONE;
}

/* phases.py's _span_judged(evaluation), when one is set: how an eval span closed. */
static int span_judged(Core *self, PyObject *evaluation) {
    PyObject *fn = self->_span_judged;
    if (fn == NULL || fn == Py_None) return 0;
    PyObject *r = PyObject_CallOneArg(fn, evaluation);
    if (r == NULL) return -1;
    Py_DECREF(r);
    return 0;
}

/* The backward spans that began at t0 or later (the closing evaluation's own: phases.py's
 * _close_eval), taken off the end of _bwd_spans. */
static int drop_spans_from(Core *self, long long t0) {
    PyObject *spans = GET(self, _bwd_spans);
    if (spans == NULL) return -1;
    if (!PyList_CheckExact(spans)) {
        PyErr_SetString(PyExc_TypeError, "_bwd_spans must be a list");
        return -1;
    }
    Py_ssize_t n = PyList_GET_SIZE(spans);
    while (n > 0) {
        PyObject *last = PyList_GET_ITEM(spans, n - 1);
        long long s0;
        if (!PyTuple_Check(last) || PyTuple_GET_SIZE(last) < 1 || as_ll(PyTuple_GET_ITEM(last, 0), &s0) < 0) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "_bwd_spans holds (start, end) pairs");
            return -1;
        }
        if (s0 < t0) break;
        n--;
    }
    return PyList_SetSlice(spans, n, PyList_GET_SIZE(spans), NULL);
}

/* phases.py's _close_eval(t): the open span ends where the training fetch after it started
 * (_eval_end), else at t (the work that closes it, the step's end, shutdown). */
static int close_eval(Core *self, long long t) {
    TRUTH(self, _eval_open, open);
    if (open) {
        LL(self, _eval, ev);
        LL(self, _eval_end, eend);
        LL(self, _eval_t0, t0);
        long long span = (eend ? eend : t) - t0;
        PUT_LL(self, _eval, ev + (span > 0 ? span : 0));
        put_obj(&self->_eval_open, Py_False);
        LL(self, _eval_bwd, ebwd);
        if (ebwd && drop_spans_from(self, t0) < 0) goto error;
        if (span_judged(self, Py_True) < 0) goto error;
    }
    return 0;
error:
    return -1;
}

/* phases.py's _open_eval: an eval span is open (from t0, borrowed, if none was), and the fetch
 * right before it is the span's, as for a forward. The span goes on: no training fetch ended it. */
static int open_eval(Core *self, PyObject *t0) {
    {
        LL(self, _eval_end, eend); /* a training fetch had ended it: judged again */
        if (eend) put_obj(&self->_eval_judged, Py_False);
    }
    PUT_LL(self, _eval_end, 0);
    TRUTH(self, _eval_open, open);
    if (!open) {
        put_obj(&self->_eval_open, Py_True);
        put_obj(&self->_eval_t0, t0);
        PUT_LL(self, _eval_calls, 0);
        PUT_LL(self, _eval_pulls, 0);
        PUT_LL(self, _eval_pulled, 0);
        PUT_LL(self, _eval_fwd, 0);
        PUT_LL(self, _eval_bwd, 0);
        put_obj(&self->_eval_judged, Py_False);
        put_obj(&self->_eval_last, t0);
    }
    if (GET(self, _last_fetch_t0) == NULL) goto error;
    if (self->_last_fetch_t0 != Py_None) {
        LL(self, _last_fetch_t0, lf);
        LL(self, _eval_t0, e0);
        if (lf < e0) put_obj(&self->_eval_t0, self->_last_fetch_t0);
        LL(self, _data, data);
        LL(self, _last_fetch_ns, lns);
        PUT_LL(self, _data, data - lns);
        LL(self, _eval_pulls, pulls);
        LL(self, _eval_pulled, pulled);
        PUT_LL(self, _eval_pulls, pulls + 1);
        PUT_LL(self, _eval_pulled, pulled + lns);
        put_obj(&self->_last_fetch_t0, Py_None);
    }
    return 0;
error:
    return -1;
}

static PyObject *Core_open_eval(Core *self, PyObject *t0) {
    if (open_eval(self, t0) < 0) return NULL;
    Py_RETURN_NONE;
}

/* phases.py's _close_eval_for_work: training work begins while an eval span is open. A span
 * with no batch of its own (at most the one fetched right before it, none since its last
 * forward) and at most IN_STEP_NO_GRAD_CALLS calls is the step's own work (a teacher or
 * reference model): its forwards go to _fwd, its fetch back to _data. Else it is evaluation. */
#define IN_STEP_NO_GRAD_CALLS 4 /* phases.py's IN_STEP_NO_GRAD_CALLS (a test compares them) */

/* phases.py's _span_is_work: 1 the open span is the step's own work, 0 evaluation, -1 error. */
static int span_is_work(Core *self) {
    TRUTH(self, _eval_judged, judged);
    if (judged) return 0;
    LL(self, _eval_bwd, ebwd);
    if (ebwd) return 1;
    LL(self, _eval_calls, calls);
    LL(self, _eval_pulls, pulls);
    if (GET(self, _last_fetch_t0) == NULL) goto error;
    return calls <= IN_STEP_NO_GRAD_CALLS && pulls <= 1 && self->_last_fetch_t0 == Py_None;
error:
    return -1;
}

static int close_eval_for_work(Core *self, long long t) {
    int work = span_is_work(self);
    if (work < 0) goto error;
    if (work) {
        LL(self, _fwd, fwd);
        LL(self, _eval_fwd, efwd);
        LL(self, _data, data);
        LL(self, _eval_pulled, pulled);
        LL(self, _bwd, bwd);
        LL(self, _eval_bwd, ebwd);
        PUT_LL(self, _fwd, fwd + efwd);
        PUT_LL(self, _data, data + pulled);
        PUT_LL(self, _bwd, bwd + ebwd);
        put_obj(&self->_eval_open, Py_False);
        return span_judged(self, Py_False);
    }
    return close_eval(self, t);
error:
    return -1;
}

static PyObject *Core_close_eval_for_work(Core *self, PyObject *t_obj) {
    long long t;
    if (as_ll(t_obj, &t) < 0) return NULL;
    TRUTH(self, _eval_open, open);
    if (open && close_eval_for_work(self, t) < 0) return NULL;
    Py_RETURN_NONE;
error:
    return NULL;
}

static PyObject *Core_span_is_work(Core *self, PyObject *unused) {
    int work = span_is_work(self);
    if (work < 0) return NULL;
    return PyBool_FromLong(work);
}

static PyObject *Core_close_eval(Core *self, PyObject *t_obj) {
    long long t;
    if (as_ll(t_obj, &t) < 0) return NULL;
    if (close_eval(self, t) < 0) return NULL;
    Py_RETURN_NONE;
}

/* RawStep(...) as phases.py builds it. RawStep is a slots class whose __init__ only stores its 15
 * arguments: when _bind found each of them a plain object slot, the record is allocated and its
 * slots filled here (what __init__ does, without its frame); else RawStep is called. */
static const char *const raw_names[] = {RAWSTEP_SLOTS};
#define RAW_N RAWSTEP_N
static Py_ssize_t raw_offsets[RAW_N];
static int raw_direct = 0;

static PyObject *raw_step(Core *self, PyObject *t_end, long long step_ns, PyObject *skipped, PyObject *mem,
                          PyObject *extras) {
    if (raw_step_cls == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "stepwatch.hooks._ctracker: _bind(RawStep) was not called");
        return NULL;
    }
    static const char *const names[] = {"step", "_data", "_fwd", "_bwd", "_opt", "_eval", "_ckpt", "_phases",
                                        "_scalars"};
    PyObject *const check[] = {self->step, self->_data, self->_fwd, self->_bwd, self->_opt, self->_eval,
                               self->_ckpt, self->_phases, self->_scalars};
    for (int i = 0; i < 9; i++) {
        if (check[i] == NULL) return unset(names[i]);
    }
    PyObject *sn = PyLong_FromLongLong(step_ns);
    if (sn == NULL) return NULL;
    PyObject *args[RAW_N + 1] = {NULL,         self->step, t_end,        sn,          self->_data,    self->_fwd,
                                 self->_bwd,   self->_opt, self->_eval,  self->_ckpt, self->_phases,  self->_scalars,
                                 skipped,      mem,        extras,       Py_False};
    PyObject *r;
    if (raw_direct) {
        PyTypeObject *tp = (PyTypeObject *)raw_step_cls;
        r = tp->tp_alloc(tp, 0);
        if (r != NULL) {
            for (int i = 0; i < RAW_N; i++) *(PyObject **)((char *)r + raw_offsets[i]) = Py_NewRef(args[i + 1]);
            PyObject_GC_UnTrack(r); /* see "The cyclic GC" above */
        }
    } else {
        r = PyObject_Vectorcall(raw_step_cls, args + 1, (RAW_N - 1) | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    }
    Py_DECREF(sn);
    return r;
}

static int finalize(Core *self, PyObject *t_end_obj, PyObject *skipped) {
    PyObject *mem = NULL, *extras = NULL, *rec = NULL, *r = NULL, *cols = NULL, *lis = NULL, *ended = NULL;
    Py_INCREF(t_end_obj);
    Py_INCREF(skipped);
    long long t_end;
    if (get_ll(t_end_obj, "t_end", &t_end) < 0) goto error;
    {
        TRUTH(self, _eval_open, open);
        if (open && close_eval(self, t_end) < 0) goto error;
    }
    put_obj(&self->_pending_end, Py_None);
    put_obj(&self->_pending_skipped, Py_False);
    long long prev = t_end;
    if (self->_prev_end == NULL) {
        unset("_prev_end");
        goto error;
    }
    if (self->_prev_end != Py_None && get_ll(self->_prev_end, "_prev_end", &prev) < 0) goto error;
    long long step_ns;
    {
        LL(self, _eval, ev);
        LL(self, _ckpt, ck);
        LL(self, _own, own);
        step_ns = t_end - prev - ev - ck - own;
        if (step_ns < 0) step_ns = 0;
    }
    PyObject *probe = GET(self, _mem_probe);
    if (probe == NULL) goto error;
    if (probe != Py_None) {
        mem = PyObject_CallNoArgs(probe);
        if (mem == NULL) goto error;
    } else {
        mem = Py_NewRef(Py_None);
    }
    {
        TRUTH(self, _step_open, open);
        if (open) {
            if (nvtx_pop(self) < 0) goto error;
            put_obj(&self->_step_open, Py_False);
        }
    }
    extras = PyDict_New();
    if (extras == NULL) goto error;
    if (GET(self, _bwd_spans) == NULL || PyDict_SetItem(extras, s_backward_spans, self->_bwd_spans) < 0) goto error;
    {
        TRUTH(self, _ckpt, ck);
        if (ck) {
            if (GET(self, _ckpt_bytes) == NULL) goto error;
            if (PyDict_SetItem(extras, s_checkpoint_bytes, self->_ckpt_bytes) < 0) goto error;
        }
    }
    cols = GET(self, collectors);
    if (cols == NULL) goto error;
    Py_INCREF(cols);
    if (PyList_CheckExact(cols)) {
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(cols); i++) {
            PyObject *c = PyList_GET_ITEM(cols, i);
            Py_INCREF(c);
            PyObject *v = PyObject_CallMethodNoArgs(c, s_take); /* the value first, as Python's */
            PyObject *name = v ? PyObject_GetAttr(c, s_name) : NULL; /* extras[c.name] = c.take() */
            Py_DECREF(c);
            int rc = name ? PyObject_SetItem(extras, name, v) : -1;
            Py_XDECREF(name);
            Py_XDECREF(v);
            if (rc < 0) goto error;
        }
    } else {
        PyObject *it = PyObject_GetIter(cols), *c;
        if (it == NULL) goto error;
        while ((c = PyIter_Next(it)) != NULL) {
            PyObject *v = PyObject_CallMethodNoArgs(c, s_take); /* the value first, as Python's */
            PyObject *name = v ? PyObject_GetAttr(c, s_name) : NULL; /* extras[c.name] = c.take() */
            Py_DECREF(c);
            int rc = name ? PyObject_SetItem(extras, name, v) : -1;
            Py_XDECREF(name);
            Py_XDECREF(v);
            if (rc < 0) {
                Py_DECREF(it);
                goto error;
            }
        }
        Py_DECREF(it);
        if (PyErr_Occurred()) goto error;
    }
    Py_CLEAR(cols);
    PyObject_GC_UnTrack(extras); /* see "The cyclic GC" above */
    if (GET(self, _emit) == NULL) goto error;
    rec = raw_step(self, t_end_obj, step_ns, skipped, mem, extras);
    if (rec == NULL) goto error;
    r = PyObject_CallOneArg(self->_emit, rec);
    if (r == NULL) goto error;
    Py_CLEAR(r);
    ended = Py_NewRef(self->step);
    {
        PyObject *one = PyLong_FromLong(1);
        PyObject *next = PyNumber_Add(ended, one);
        Py_DECREF(one);
        if (next == NULL) goto error;
        put(&self->step, next);
    }
    put_obj(&self->_prev_end, t_end_obj);
    if (reset_step(self) < 0) goto error;
    {
        PyObject *p = GET(self, progress);
        if (p == NULL) goto error;
        if (p != Py_None && call_method(p, s_set_step, self->step) < 0) goto error;
    }
    lis = GET(self, listeners);
    if (lis == NULL) goto error;
    Py_INCREF(lis);
    {
        PyObject *it = PyObject_GetIter(lis), *fn;
        if (it == NULL) goto error;
        while ((fn = PyIter_Next(it)) != NULL) {
            PyObject *x = PyObject_CallOneArg(fn, ended);
            Py_DECREF(fn);
            if (x == NULL) {
                Py_DECREF(it);
                goto error;
            }
            Py_DECREF(x);
        }
        Py_DECREF(it);
        if (PyErr_Occurred()) goto error;
    }
    Py_DECREF(lis);
    Py_DECREF(ended);
    Py_DECREF(rec);
    Py_DECREF(extras);
    Py_DECREF(mem);
    Py_DECREF(t_end_obj);
    Py_DECREF(skipped);
    return 0;
error:
    Py_XDECREF(cols);
    Py_XDECREF(lis);
    Py_XDECREF(ended);
    Py_XDECREF(rec);
    Py_XDECREF(extras);
    Py_XDECREF(mem);
    Py_DECREF(t_end_obj);
    Py_DECREF(skipped);
    return -1;
}

static PyObject *Core_finalize(Core *self, PyObject *const *args, Py_ssize_t n) {
    if (n != 2) {
        PyErr_Format(PyExc_TypeError, "_finalize() takes 2 arguments (t_end, skipped), %zd given", n);
        return NULL;
    }
    if (finalize(self, args[0], args[1]) < 0) return NULL;
    Py_RETURN_NONE;
}

/* Training work begins at t: finalize a pending step, open the next one. */
static int start_work(Core *self, long long t) {
    if (GET(self, _pending_end) == NULL) return -1;
    if (self->_pending_end != Py_None) {
        PyObject *pe = Py_NewRef(self->_pending_end);
        PyObject *sk = GET(self, _pending_skipped);
        int rc = sk ? finalize(self, pe, sk) : -1;
        Py_DECREF(pe);
        if (rc < 0) return -1;
    }
    if (GET(self, _prev_end) == NULL) return -1;
    if (self->_prev_end == Py_None) PUT_LL(self, _prev_end, t);
    {
        TRUTH(self, _step_open, open);
        if (!open) {
            put_obj(&self->_step_open, Py_True);
            PyObject *nv = GET(self, _nvtx);
            if (nv == NULL) goto error;
            if (nv != Py_None && call_method(nv, s_push_step, self->step) < 0) goto error;
        }
    }
    return 0;
error:
    return -1;
}

static PyObject *Core_start_work(Core *self, PyObject *arg) {
    long long t;
    if (as_ll(arg, &t) < 0) return NULL;
    if (start_work(self, t) < 0) return NULL;
    Py_RETURN_NONE;
}

/* _pending_end is not None or _prev_end is None: the test before each _start_work. */
static int needs_start(Core *self) {
    if (GET(self, _pending_end) == NULL || GET(self, _prev_end) == NULL) return -1;
    return self->_pending_end != Py_None || self->_prev_end == Py_None;
}

/* phases.py's _begin_work: the start of a fetch, forward or backward in *t (read by the caller),
 * with a pending step finalized first; when one was, *t is read again after it (the step end's
 * listeners ran: their time is not this phase's). 0, or -1 with an exception. */
static int begin_work(Core *self, long long *t) {
    int ns = needs_start(self);
    if (ns <= 0) return ns;
    int finalizes = self->_pending_end != Py_None;
    if (start_work(self, *t) < 0) return -1;
    return finalizes ? now_ns(t) : 0;
}

static PyObject *Core_begin_work(Core *self, PyObject *unused) {
    NOW(t);
    if (begin_work(self, &t) < 0) goto error;
    return PyLong_FromLongLong(t);
error:
    return NULL;
}

#define ENABLED_OR_RETURN(self, ret)                                                                   \
    do {                                                                                               \
        int en_ = truth((self)->enabled, "enabled");                                                   \
        if (en_ < 0) return NULL;                                                                      \
        if (!en_) return ret;                                                                          \
    } while (0)

/* self.method(t) for _pause_opt/_resume_opt (Python); *out its truth for _pause_opt. */
static int call_self_t(Core *self, PyObject *name, long long t, int *out) {
    PyObject *a = PyLong_FromLongLong(t);
    if (a == NULL) return -1;
    PyObject *r = PyObject_CallMethodOneArg((PyObject *)self, name, a);
    Py_DECREF(a);
    if (r == NULL) return -1;
    int v = out ? PyObject_IsTrue(r) : 0;
    Py_DECREF(r);
    if (v < 0) return -1;
    if (out) *out = v;
    return 0;
}

/* A begin method's depth: +1; 1 for the outermost call (the one timed), 0 for a nested one, -1 on error. */
static int enter(PyObject **depth_slot, const char *name) {
    long long d;
    if (get_ll(*depth_slot, name, &d) < 0 || put_ll(depth_slot, d + 1) < 0) return -1;
    return d + 1 <= 1; /* as Python's "if depth > 1: return" */
}

/* An end method's depth: -1; 1 when the outermost call ends, 0 when a nested one does, -1 on error. */
static int leave(PyObject **depth_slot, const char *name) {
    long long d;
    if (get_ll(*depth_slot, name, &d) < 0 || put_ll(depth_slot, d - 1) < 0) return -1;
    return d - 1 == 0;
}

/* The begin/end methods' shared first lines: the depth, and only the outermost call goes on. */
#define OUTERMOST(self, fn, f)                                                                         \
    {                                                                                                  \
        int outer_ = fn(&(self)->f, #f);                                                               \
        if (outer_ < 0) goto error;                                                                    \
        if (!outer_) Py_RETURN_NONE;                                                                   \
    }

static PyObject *Core_data_begin(Core *self, PyObject *unused) {
    ENABLED_OR_RETURN(self, PyLong_FromLong(0));
    {
        LL(self, in_data, depth);
        if (depth > 0) return PyLong_FromLong(0); /* a fetch inside a fetch: the outer one times it */
        NOW(t);
        if (begin_work(self, &t) < 0) goto error;
        LL(self, in_data, d);
        PUT_LL(self, in_data, d + 1);
        if (set_phase(self, PH_DATA) < 0) goto error;
        return PyLong_FromLongLong(t);
    }
error:
    return fail(self, "data_begin") < 0 ? NULL : PyLong_FromLong(0);
}

/* What a fetch's wrapper tells data_end (phases.py's FETCH_NO_GRAD, FETCH_END): grad was disabled;
 * the fetch ended the iteration (StopIteration). */
enum { FETCH_NO_GRAD = 1, FETCH_END = 2 };

/* phases.py's data_end(t0, how): a fetch with grad disabled is evaluation, and so is the one that
 * ends an iterator while an eval span is open; any other is the step's data wait. */
static PyObject *data_end(Core *self, PyObject *t0_obj, long how) {
    ENABLED_OR_RETURN(self, Py_NewRef(Py_None));
    int t0_true = PyObject_IsTrue(t0_obj);
    if (t0_true < 0) return NULL;
    if (!t0_true) Py_RETURN_NONE;
    PyObject *start = Py_NewRef(t0_obj); /* where a span of this fetch starts */
    long long made = 0;                   /* iter()'s own time, when the span starts at the iterator */
    {
        LL(self, in_data, d);
        PUT_LL(self, in_data, d > 1 ? d - 1 : 0);
        long long t0;
        if (as_ll(t0_obj, &t0) < 0) goto error;
        NOW(t);
        long long dur = t - t0;
        if (GET(self, _iter_t0) == NULL) goto error;
        if (self->_iter_t0 != Py_None) { /* the iterator's first fetch: where a span of it starts */
            PyObject *it0_obj = Py_NewRef(self->_iter_t0);
            put_obj(&self->_iter_t0, Py_None);
            long long it1 = -1;
            if (GET(self, _iter_t1) != NULL && self->_iter_t1 != Py_None && get_ll(self->_iter_t1, "_iter_t1", &it1) < 0) {
                Py_DECREF(it0_obj);
                goto error;
            }
            put_obj(&self->_iter_t1, Py_None);
            long long it0, pe, f0, b0, o0;
            int ok = GET(self, _prev_end) != NULL;
            if (ok && self->_prev_end != Py_None) {
                ok = !(get_ll(it0_obj, "_iter_t0", &it0) < 0 || get_ll(self->_prev_end, "_prev_end", &pe) < 0 ||
                       get_ll(self->_fwd_t0, "_fwd_t0", &f0) < 0 || get_ll(self->_bwd_t0, "_bwd_t0", &b0) < 0 ||
                       get_ll(self->_opt_t0, "_opt_t0", &o0) < 0);
                if (ok && it0 >= pe && it0 >= f0 && it0 >= b0 && it0 >= o0) {
                    Py_SETREF(start, Py_NewRef(it0_obj));
                    made = it1 >= it0 ? it1 - it0 : -1;
                }
            }
            Py_DECREF(it0_obj);
            if (!ok) goto error;
        }
        int eval = 0;
        if (how) {
            if (how & FETCH_NO_GRAD) {
                eval = 1;
            } else {
                TRUTH(self, _eval_open, open);
                eval = open;
            }
        }
        if (eval) {
            if (open_eval(self, start) < 0) goto error;
            if (!(how & FETCH_END)) {
                LL(self, _eval_pulls, pulls);
                PUT_LL(self, _eval_pulls, pulls + 1);
            }
            LL(self, _eval_pulled, pulled);
            PUT_LL(self, _eval_pulled, pulled + dur);
            PUT_LL(self, _eval_last, t);
        } else { /* from the iterator's start, for its first fetch: the loop waited for its workers */
            long long s0;
            if (as_ll(start, &s0) < 0) goto error;
            if (made >= 0 && s0 < t0) {
                /* iter()'s own time and this fetch's: the loop's work between them is not the
                 * loader's (phases.py data_end) */
                s0 = t0 - made;
                PyObject *st = PyLong_FromLongLong(s0);
                if (st == NULL) goto error;
                Py_SETREF(start, st);
            }
            {
                /* training work after an open span: where it ends, unless it takes this fetch */
                TRUTH(self, _eval_open, open);
                if (open) {
                    LL(self, _eval_end, eend);
                    if (!eend) put_obj(&self->_eval_end, start);
                }
            }
            LL(self, _data, data);
            PUT_LL(self, _data, data + (t - s0));
            /* a training loader's end (no batch) is no fetch an evaluation takes (_open_eval) */
            put_obj(&self->_last_fetch_t0, how & FETCH_END ? Py_None : start);
            PUT_LL(self, _last_fetch_ns, t - s0);
        }
        if (set_phase(self, PH_OTHER) < 0) goto error;
    }
    Py_DECREF(start);
    Py_RETURN_NONE;
error:
    Py_DECREF(start);
    if (fail(self, "data_end") < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *Core_data_end(Core *self, PyObject *const *args, Py_ssize_t n) {
    if (n < 1 || n > 2) {
        PyErr_Format(PyExc_TypeError, "data_end() takes 1 or 2 arguments (t0, how=0), %zd given", n);
        return NULL;
    }
    long how = 0;
    if (n == 2 && (how = PyLong_AsLong(args[1])) == -1 && PyErr_Occurred()) return NULL;
    return data_end(self, args[0], how);
}

static PyObject *Core_forward_begin(Core *self, PyObject *grad) {
    ENABLED_OR_RETURN(self, Py_NewRef(Py_None));
    {
        OUTERMOST(self, enter, _fwd_depth);
        {
            /* inside a backward: a checkpointed root's recompute, the backward's time (phases.py) */
            TRUTH(self, _bwd_depth, bd);
            if (bd) Py_RETURN_NONE;
        }
        NOW(t);
        if (begin_work(self, &t) < 0) goto error;
        {
            TRUTH(self, _opt_depth, od);
            int paused = 0;
            if (od && call_self_t(self, s_pause_opt, t, &paused) < 0) goto error;
            put_obj(&self->_fwd_paused_opt, paused ? Py_True : Py_False);
        }
        put_obj(&self->_fwd_grad, grad);
        PUT_LL(self, _fwd_t0, t);
        int g = PyObject_IsTrue(grad);
        if (g < 0) goto error;
        if (nvtx_push(self, g ? s_forward : s_eval) < 0) goto error;
        if (set_phase(self, g ? PH_FORWARD : PH_EVAL) < 0) goto error;
        if (g) {
            TRUTH(self, _eval_open, open);
            if (open && close_eval_for_work(self, t) < 0) goto error;
            put_obj(&self->_last_fetch_t0, Py_None);
            if (device_begin(self, PH_FORWARD, &self->_dslot_fwd) < 0) goto error;
            Py_RETURN_NONE;
        }
        /* Evaluation: the fetch right before this forward, and fetches inside the span, are eval. */
        {
            PyObject *t_obj = PyLong_FromLongLong(t);
            if (t_obj == NULL) goto error;
            int r = open_eval(self, t_obj);
            Py_DECREF(t_obj);
            if (r < 0) goto error;
        }
        {
            LL(self, _eval_calls, calls);
            PUT_LL(self, _eval_calls, calls + 1);
        }
    }
    Py_RETURN_NONE;
error:
    if (fail(self, "forward_begin") < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *Core_forward_end(Core *self, PyObject *unused) {
    ENABLED_OR_RETURN(self, Py_NewRef(Py_None));
    {
        int z = truth(self->_fwd_depth, "_fwd_depth");
        if (z < 0) return NULL; /* Python reads it outside its try, too */
        if (!z) Py_RETURN_NONE;
    }
    {
        OUTERMOST(self, leave, _fwd_depth);
        {
            TRUTH(self, _bwd_depth, bd); /* a recompute inside a backward (forward_begin) */
            if (bd) Py_RETURN_NONE;
        }
        NOW(t);
        if (nvtx_pop(self) < 0) goto error;
        if (set_phase(self, PH_OTHER) < 0) goto error;
        TRUTH(self, _fwd_grad, g);
        if (g) {
            if (device_end(self, self->_dslot_fwd, "_dslot_fwd") < 0) goto error;
            LL(self, _fwd, fwd);
            LL(self, _fwd_t0, t0);
            PUT_LL(self, _fwd, fwd + (t - t0));
        } else {
            LL(self, _eval_fwd, efwd);
            LL(self, _fwd_t0, t0);
            PUT_LL(self, _eval_fwd, efwd + (t - t0));
            PUT_LL(self, _eval_last, t);
        }
        TRUTH(self, _fwd_paused_opt, paused);
        if (paused) {
            put_obj(&self->_fwd_paused_opt, Py_False);
            if (call_self_t(self, s_resume_opt, t, NULL) < 0) goto error;
        }
    }
    Py_RETURN_NONE;
error:
    if (fail(self, "forward_end") < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *Core_backward_begin(Core *self, PyObject *unused) {
    ENABLED_OR_RETURN(self, Py_NewRef(Py_None));
    {
        OUTERMOST(self, enter, _bwd_depth);
        NOW(t);
        if (begin_work(self, &t) < 0) goto error;
        put_obj(&self->_bwd_eval, Py_False);
        {
            /* inside an open span, not the step's end: the span's until training work closes it */
            TRUTH(self, _eval_open, open);
            if (open) {
                int keep = 0;
                if (GET(self, boundary) == NULL) goto error;
                int opt = PyUnicode_Check(self->boundary) && PyUnicode_CompareWithASCIIString(self->boundary, "optimizer") == 0;
                if (opt) {
                    TRUTH(self, _opt_depth, od0);
                    if (!od0) {
                        TRUTH(self, _eval_judged, judged);
                        keep = judged ? 1 : span_is_work(self);
                        if (keep < 0) goto error;
                    }
                }
                if (keep) put_obj(&self->_bwd_eval, Py_True);
                else if (close_eval_for_work(self, t) < 0) goto error;
            }
        }
        put_obj(&self->_last_fetch_t0, Py_None);
        {
            TRUTH(self, _opt_depth, od);
            int paused = 0;
            if (od && call_self_t(self, s_pause_opt, t, &paused) < 0) goto error;
            put_obj(&self->_bwd_paused_opt, paused ? Py_True : Py_False);
        }
        PUT_LL(self, _bwd_t0, t);
        if (device_begin(self, PH_BACKWARD, &self->_dslot_bwd) < 0) goto error;
        if (nvtx_push(self, s_backward) < 0) goto error;
        if (set_phase(self, PH_BACKWARD) < 0) goto error;
    }
    Py_RETURN_NONE;
error:
    if (fail(self, "backward_begin") < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *Core_backward_end(Core *self, PyObject *unused) {
    ENABLED_OR_RETURN(self, Py_NewRef(Py_None));
    {
        int z = truth(self->_bwd_depth, "_bwd_depth");
        if (z < 0) return NULL;
        if (!z) Py_RETURN_NONE;
    }
    {
        OUTERMOST(self, leave, _bwd_depth);
        NOW(t);
        if (device_end(self, self->_dslot_bwd, "_dslot_bwd") < 0) goto error;
        LL(self, _bwd_t0, t0);
        {
            TRUTH(self, _bwd_eval, in_span);
            int open = 0;
            if (in_span) {
                TRUTH(self, _eval_open, o);
                open = o;
            }
            if (open) {
                LL(self, _eval_bwd, ebwd);
                PUT_LL(self, _eval_bwd, ebwd + (t - t0));
                PyObject *end = PyLong_FromLongLong(t);
                if (end == NULL) goto error;
                put(&self->_eval_last, end);
            } else {
                LL(self, _bwd, bwd);
                PUT_LL(self, _bwd, bwd + (t - t0));
            }
            put_obj(&self->_bwd_eval, Py_False);
        }
        {
            PyObject *spans = GET(self, _bwd_spans);
            if (spans == NULL) goto error;
            PyObject *end = PyLong_FromLongLong(t);
            if (end == NULL) goto error;
            PyObject *span = PyTuple_Pack(2, self->_bwd_t0, end);
            Py_DECREF(end);
            if (span == NULL) goto error;
            PyObject_GC_UnTrack(span); /* two ints (see "The cyclic GC" above) */
            int rc = PyList_CheckExact(spans) ? PyList_Append(spans, span) : -2;
            if (rc == -2) {
                PyObject *r = PyObject_CallMethod(spans, "append", "O", span);
                rc = r ? 0 : -1;
                Py_XDECREF(r);
            }
            Py_DECREF(span);
            if (rc < 0) goto error;
        }
        if (nvtx_pop(self) < 0) goto error;
        if (set_phase(self, PH_OTHER) < 0) goto error;
        TRUTH(self, _bwd_paused_opt, paused);
        if (paused) {
            put_obj(&self->_bwd_paused_opt, Py_False);
            if (call_self_t(self, s_resume_opt, t, NULL) < 0) goto error;
        } else {
            TRUTH(self, _opt_depth, od);
            if (od) { /* a step that began inside it raised out of it: phases.py's _drop_opt */
                PyObject *r = PyObject_CallMethodNoArgs((PyObject *)self, s_drop_opt);
                if (r == NULL) goto error;
                Py_DECREF(r);
                Py_RETURN_NONE;
            }
            PyObject *b = GET(self, boundary);
            if (b == NULL) goto error;
            int is_bwd = PyObject_RichCompareBool(b, s_backward, Py_EQ);
            if (is_bwd < 0) goto error;
            if (is_bwd) {
                PUT_LL(self, _pending_end, t); /* no optimizer in this loop: the backward ends the step */
                put_obj(&self->_pending_skipped, Py_False);
            } else {
                if (GET(self, _pending_end) == NULL) goto error;
                if (self->_pending_end != Py_None) { /* as phases.py: nearly every backward has none */
                    int explicit = PyObject_RichCompareBool(b, s_explicit, Py_EQ);
                    if (explicit < 0) goto error;
                    /* its optimizer steps ran inside it (_pause_bwd): it ends the step */
                    if (!explicit) PUT_LL(self, _pending_end, t);
                }
            }
        }
    }
    Py_RETURN_NONE;
error:
    if (fail(self, "backward_end") < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *Core_optimizer_begin(Core *self, PyObject *unused) {
    ENABLED_OR_RETURN(self, Py_NewRef(Py_None));
    {
        int outer = enter(&self->_opt_depth, "_opt_depth");
        if (outer < 0) goto error;
        if (!outer) { /* nested, or the open one raised out of its step(): phases.py's _opt_stale */
            PyObject *r = PyObject_CallMethodNoArgs((PyObject *)self, s_opt_stale);
            if (r == NULL) goto error;
            int stale = PyObject_IsTrue(r);
            Py_DECREF(r);
            if (stale < 0) goto error;
            if (!stale) Py_RETURN_NONE;
        }
        NOW(t);
        PyObject *b = GET(self, boundary);
        if (b == NULL) goto error;
        int is_bwd = PyObject_RichCompareBool(b, s_backward, Py_EQ);
        if (is_bwd < 0) goto error;
        if (is_bwd) put_obj(&self->boundary, s_optimizer); /* an optimizer after all */
        if (GET(self, _prev_end) == NULL) goto error;
        if (self->_prev_end == Py_None) {
            if (start_work(self, t) < 0) goto error;
        } else {
            TRUTH(self, _step_open, open);
            if (!open) {
                put_obj(&self->_step_open, Py_True);
                PyObject *nv = GET(self, _nvtx);
                if (nv == NULL) goto error;
                if (nv != Py_None && call_method(nv, s_push_step, self->step) < 0) goto error;
            }
        }
        /* A pending end stays pending: a second optimizer in the same iteration extends it. */
        put_obj(&self->_pending_end, Py_None);
        {
            TRUTH(self, _eval_open, open);
            if (open && close_eval_for_work(self, t) < 0) goto error;
        }
        put_obj(&self->_last_fetch_t0, Py_None);
        PUT_LL(self, _opt_t0, t);
        PUT_LL(self, _opt_paused, 0);
        {
            TRUTH(self, _bwd_depth, bd); /* an optimizer step in backward: phases.py's _pause_bwd */
            if (bd && call_self_t(self, s_pause_bwd, t, NULL) < 0) goto error;
        }
        if (device_begin(self, PH_OPTIMIZER, &self->_dslot_opt) < 0) goto error;
        if (nvtx_push(self, s_optimizer) < 0) goto error;
        if (set_phase(self, PH_OPTIMIZER) < 0) goto error;
    }
    Py_RETURN_NONE;
error:
    if (fail(self, "optimizer_begin") < 0) return NULL;
    Py_RETURN_NONE;
}

/* Also torch's global optimizer step post-hook as it is: (optimizer, args, kwargs) are ignored. */
static PyObject *Core_optimizer_end(Core *self, PyObject *const *args, Py_ssize_t n, PyObject *kwnames) {
    ENABLED_OR_RETURN(self, Py_NewRef(Py_None));
    {
        int z = truth(self->_opt_depth, "_opt_depth");
        if (z < 0) return NULL;
        if (!z) Py_RETURN_NONE;
    }
    {
        OUTERMOST(self, leave, _opt_depth);
        NOW(t);
        TRUTH(self, _opt_paused, paused);
        if (!paused) { /* paused: the closure's forward/backward never ended (it raised) */
            if (device_end(self, self->_dslot_opt, "_dslot_opt") < 0) goto error;
            LL(self, _opt, opt);
            LL(self, _opt_t0, t0);
            PUT_LL(self, _opt, opt + (t - t0));
        }
        if (nvtx_pop(self) < 0) goto error;
        if (set_phase(self, PH_OTHER) < 0) goto error;
        {
            TRUTH(self, _bwd_depth, bd);
            if (bd && call_self_t(self, s_resume_bwd, t, NULL) < 0) goto error;
        }
        PyObject *b = GET(self, boundary);
        if (b == NULL) goto error;
        int explicit = PyObject_RichCompareBool(b, s_explicit, Py_EQ);
        if (explicit < 0) goto error;
        if (!explicit) { /* explicit: only stepwatch.step() ends a step */
            PUT_LL(self, _pending_end, t);
            put_obj(&self->_pending_skipped, Py_False);
        }
        TRUTH(self, _in_scaler, sc);
        if (sc) put_obj(&self->_scaler_fired, Py_True);
    }
    Py_RETURN_NONE;
error:
    if (fail(self, "optimizer_end") < 0) return NULL;
    Py_RETURN_NONE;
}

/* Attach scalars to the step in progress (or to the one that just ended). */
static PyObject *Core_log(Core *self, PyObject *scalars) {
    ENABLED_OR_RETURN(self, Py_NewRef(Py_None));
    {
        PyObject *d = GET(self, _scalars);
        if (d == NULL) goto error;
        if (PyDict_CheckExact(d) && PyDict_Check(scalars)) {
            if (PyDict_Update(d, scalars) < 0) goto error;
        } else if (call_method(d, s_update, scalars) < 0) {
            goto error;
        }
    }
    Py_RETURN_NONE;
error:
    if (fail(self, "log") < 0) return NULL;
    Py_RETURN_NONE;
}

/* stepwatch.log's values as the pipeline takes them: a float or int as it is, anything else
 * through convert(value); an error from convert passes to the caller (the session reports it). */
static PyObject *Core_log_values(Core *self, PyObject *const *args, Py_ssize_t n) {
    if (n != 2) {
        PyErr_Format(PyExc_TypeError, "log_values() takes 2 arguments (scalars, convert), %zd given", n);
        return NULL;
    }
    ENABLED_OR_RETURN(self, Py_NewRef(Py_None));
    PyObject *scalars = args[0], *convert = args[1];
    PyObject *out = PyDict_New();
    if (out == NULL) return NULL;
    PyObject *items = PyDict_CheckExact(scalars) ? Py_NewRef(scalars) : PyDict_Copy(scalars);
    if (items == NULL) goto error;
    Py_ssize_t pos = 0;
    PyObject *k, *v;
    while (PyDict_Next(items, &pos, &k, &v)) {
        PyObject *x;
        if (PyFloat_CheckExact(v) || PyLong_CheckExact(v)) {
            x = Py_NewRef(v);
        } else {
            Py_INCREF(k);
            Py_INCREF(v);
            x = PyObject_CallOneArg(convert, v);
            Py_DECREF(v);
            if (x == NULL) {
                Py_DECREF(k);
                Py_DECREF(items);
                goto error;
            }
            int rc = PyDict_SetItem(out, k, x);
            Py_DECREF(k);
            Py_DECREF(x);
            if (rc < 0) {
                Py_DECREF(items);
                goto error;
            }
            continue;
        }
        int rc = PyDict_SetItem(out, k, x);
        Py_DECREF(x);
        if (rc < 0) {
            Py_DECREF(items);
            goto error;
        }
    }
    Py_DECREF(items);
    PyObject *r = Core_log(self, out);
    Py_DECREF(out);
    return r;
error:
    Py_DECREF(out);
    return NULL;
}

/* A hook wants to attribute something to the step before timing it: a pending end becomes final. */
static PyObject *Core_work_begins(Core *self, PyObject *unused) {
    ENABLED_OR_RETURN(self, Py_NewRef(Py_None));
    if (GET(self, _pending_end) == NULL) return NULL;
    if (self->_pending_end == Py_None) Py_RETURN_NONE;
    {
        NOW(t);
        if (start_work(self, t) < 0) goto error;
    }
    Py_RETURN_NONE;
error:
    if (fail(self, "work_begins") < 0) return NULL;
    Py_RETURN_NONE;
}

/* -- the type ------------------------------------------------------------------------------ */

#define MEMBER(f) {#f, T_OBJECT_EX, offsetof(Core, f), 0, NULL},
static PyMemberDef Core_members[] = {FIELDS(MEMBER){NULL}};

static PyMethodDef Core_methods[] = {
    {"_reset_step", (PyCFunction)Core_reset_step, METH_NOARGS, NULL},
    {"_close_eval", (PyCFunction)Core_close_eval, METH_O, NULL},
    {"_close_eval_for_work", (PyCFunction)Core_close_eval_for_work, METH_O, NULL},
    {"_span_is_work", (PyCFunction)Core_span_is_work, METH_NOARGS, NULL},
    {"_open_eval", (PyCFunction)Core_open_eval, METH_O, NULL},
    {"_finalize", (PyCFunction)(void (*)(void))Core_finalize, METH_FASTCALL, NULL},
    {"_start_work", (PyCFunction)Core_start_work, METH_O, NULL},
    {"_begin_work", (PyCFunction)Core_begin_work, METH_NOARGS, NULL},
    {"data_begin", (PyCFunction)Core_data_begin, METH_NOARGS, NULL},
    {"data_end", (PyCFunction)(void (*)(void))Core_data_end, METH_FASTCALL, NULL},
    {"forward_begin", (PyCFunction)Core_forward_begin, METH_O, NULL},
    {"forward_end", (PyCFunction)Core_forward_end, METH_NOARGS, NULL},
    {"backward_begin", (PyCFunction)Core_backward_begin, METH_NOARGS, NULL},
    {"backward_end", (PyCFunction)Core_backward_end, METH_NOARGS, NULL},
    {"optimizer_begin", (PyCFunction)Core_optimizer_begin, METH_NOARGS, NULL},
    {"optimizer_end", (PyCFunction)(void (*)(void))Core_optimizer_end, METH_FASTCALL | METH_KEYWORDS, NULL},
    {"log", (PyCFunction)Core_log, METH_O, NULL},
    {"log_values", (PyCFunction)(void (*)(void))Core_log_values, METH_FASTCALL, NULL},
    {"work_begins", (PyCFunction)Core_work_begins, METH_NOARGS, NULL},
    {NULL},
};

OBJECT_TYPE(Core, FIELDS, "stepwatch.hooks._ctracker.Core",
            "The step tracker's state and hot methods (hooks/phases.py's _PyCore, in C).",
            {Py_tp_methods, Core_methods},)


/* -- a root module's call (hooks/install.py's _PyRootCall, in C) ------------------------------
 *
 * What nn.Module.__call__ runs as the instance's _compiled_call_impl: the observers, then the
 * forward phase around the module's own call. In C it adds no frame to the user's traceback. */

typedef struct {
    PyObject_HEAD
    PyObject *inst, *tr, *mod, *inner, *bound, *dynamo, *compiler, *replay, *grad_enabled, *follows;
} RootCall;

#define ROOT_FIELDS(X) \
    X(inst) X(tr) X(mod) X(inner) X(bound) X(dynamo) X(compiler) X(replay) X(grad_enabled) X(follows)

static PyObject *s_is_compiling_flag, *s_active, *s_mine, *s_enabled, *s_in_data, *s_not_roots, *s_forward_observers,
    *s_exception_observers, *s_fwd_depth, *s_pending_end, *s_work_begins, *s_observe_forward, *s_no_grad_call,
    *s_forward_begin, *s_forward_end, *s_observe_exception, *s_drop_observer, *s_last_optimizer, *s_new_optimizer,
    *s_opt_pre_args, *s_optimizer_observers, *s_observe_optimizer, *s_optimizer_begin, *s_backward_begin,
    *s_backward_end, *s_boundary_checked, *s_check_boundary, *s_data_begin, *s_data_end, *s_data_scanned, *s_scan,
    *s_first_data_fetch, *s_data, *s_thread, *s_bwd_depth, *s_recompute_observers, *s_observe_recompute,
    *s_recompute, *s_ckpt_code, *s_checkpointed_forward;

/* The module, from the weak reference ``mod`` holds (install.py's _RootCallBase says why): borrowed,
   since the module is the one being called and its caller holds it; NULL with an error if gone. */
static PyObject *root_mod(RootCall *self) {
    PyObject *m;
#if PY_VERSION_HEX >= 0x030D0000
    if (PyWeakref_GetRef(self->mod, &m) < 0) return NULL;
    if (m != NULL) Py_DECREF(m);
#else
    m = PyWeakref_GetObject(self->mod);
    if (m == NULL) return NULL;
    if (m == Py_None) m = NULL;
#endif
    if (m == NULL) PyErr_SetString(PyExc_ReferenceError, "stepwatch: the root module of this call is gone");
    return m;
}

/* The module's own call: ``inner`` as it is, or (``bound``) the module's class's ``_call_impl``
   with the module first, as the bound method would (no tuple made). */
static PyObject *call_inner(RootCall *self, PyObject *mod, PyObject *args, PyObject *kwargs) {
    if (self->bound != Py_True) return PyObject_Call(self->inner, args, kwargs);
    Py_ssize_t n = PyTuple_GET_SIZE(args);
    PyObject *small[9], **stack = small;
    if (n + 1 > 9) {
        stack = PyMem_Malloc((size_t)(n + 1) * sizeof(PyObject *));
        if (stack == NULL) return PyErr_NoMemory();
    }
    stack[0] = mod;
    for (Py_ssize_t i = 0; i < n; i++) stack[i + 1] = PyTuple_GET_ITEM(args, i);
    PyObject *out = PyObject_VectorcallDict(self->inner, stack, (size_t)(n + 1), kwargs);
    if (stack != small) PyMem_Free(stack);
    return out;
}

/* The tracker as this module's Core, when its type reads the hot fields and runs the hot methods
 * the root call, the backward and the optimizer pre-hook use as Core does (phases.py's StepTracker over this Core; none of them replaced
 * in a subclass): its fields are read and its methods called directly, without the attribute
 * lookups on the type (each a few cache lines, cold in a real loop: ~1.5 us a root call on this
 * project's machine, overhead.py --crossings). NULL for another tracker (the Python core, a
 * subclass that overrides one): the attribute path, as Python does it. A type is checked once. */
static PyTypeObject *core_type = NULL;       /* Core, set at module init */
static PyTypeObject *core_like_type = NULL;  /* the last type that passed the check (borrowed: compared only) */

static Core *as_core(PyObject *tr) {
    PyTypeObject *tp = Py_TYPE(tr);
    if (tp == core_like_type) return (Core *)tr;
    if (core_type == NULL || !PyObject_TypeCheck(tr, core_type)) return NULL;
    PyObject *names[] = {s_enabled, s_in_data, s_fwd_depth, s_pending_end, s_forward_begin, s_forward_end,
                         s_work_begins, s_optimizer_begin, s_backward_begin, s_backward_end, s_data_begin, s_data_end};
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
        PyObject *mine = _PyType_Lookup(tp, names[i]);                         /* borrowed */
        PyObject *core = _PyType_Lookup(core_type, names[i]); /* borrowed */
        if (mine == NULL || mine != core) return NULL;
    }
    core_like_type = tp;
    return (Core *)tr;
}

/* In a wrapper's call, for each of its FIELDS(X): a field Python's __init__ did not set yet is
 * the AttributeError Python would raise. */
#define FIELD_SET(f)                                                                                   \
    if (self->f == NULL) return unset(#f);

/* bool(tr.<field>) for the root call: the Core's field, or the attribute. */
#define TR_TRUTH(core, tr, f, name) ((core) ? truth((core)->f, #f) : attr_truth((tr), (name)))

typedef PyObject *(*CoreMethod)(Core *, PyObject *);

/* tr.<name>(arg), or tr.<name>() when arg is NULL: the Core's C method ``direct`` when ``core``
 * (as_core(tr)) is set, else through the attribute, as Python does it. A new reference, or NULL. */
static PyObject *tr_call(Core *core, PyObject *tr, CoreMethod direct, PyObject *name, PyObject *arg) {
    if (core) return direct(core, arg);
    return arg ? PyObject_CallMethodOneArg(tr, name, arg) : PyObject_CallMethodNoArgs(tr, name);
}

/* tr_call for a method whose result is dropped: 0, or -1 with the exception. */
static int tr_run(Core *core, PyObject *tr, CoreMethod direct, PyObject *name, PyObject *arg) {
    PyObject *r = tr_call(core, tr, direct, name, arg);
    if (r == NULL) return -1;
    Py_DECREF(r);
    return 0;
}

/* The user's call under a wrapper raised (the exception is set): the exception observers are told
 * (inst._observe_exception(phase, exc); not of a StopIteration when ``stop_ends`` says it ends an
 * iteration), the phase ends (tr_run(core, tr, end, end_name, arg); as Python's finally, an
 * exception there replaces the user's), and the user's exception goes on. Returns NULL. */
static void observe_failure(PyObject *inst, PyObject *phase, int stop_ends, PyObject **type, PyObject **value,
                            PyObject **tb) {
    PyErr_Fetch(type, value, tb);
    PyErr_NormalizeException(type, value, tb);
    if (*tb != NULL) PyException_SetTraceback(*value, *tb);
    int eo = stop_ends && PyErr_GivenExceptionMatches(*value, PyExc_StopIteration)
                 ? 0
                 : attr_truth(inst, s_exception_observers);
    if (eo < 0) {
        PyErr_Clear(); /* the user's exception goes on; what failed here is ours */
        eo = 0;
    }
    if (eo) {
        PyObject *oargs[3] = {inst, phase, *value};
        PyObject *r = PyObject_VectorcallMethod(s_observe_exception, oargs, 3 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
        if (r == NULL) PyErr_Clear();
        Py_XDECREF(r);
    }
}

static PyObject *call_failed(PyObject *inst, PyObject *phase, int stop_ends, Core *core, PyObject *tr, CoreMethod end,
                             PyObject *end_name, PyObject *arg) {
    PyObject *type, *value, *tb;
    observe_failure(inst, phase, stop_ends, &type, &value, &tb); /* the exception, fetched; the observers told */
    if (tr_run(core, tr, end, end_name, arg) < 0) {
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(tb);
        return NULL;
    }
    PyErr_Restore(type, value, tb);
    return NULL;
}

/* install.py's _observe_forward / _observe_optimizer: each observer of inst.<list_name> in turn
 * (called with cargs); one that raises an Exception is dropped (inst._drop_observer(kind, ...))
 * and the others still run. The list is read once, as Python's
 * `for` does (remove_observer replaces it; an observer appended meanwhile is called too). A
 * list of another type takes the Python method. */
static int observe(PyObject *inst, PyObject *list_name, PyObject *method, PyObject *kind, PyObject *const *cargs,
                   size_t n) {
    PyObject *obs = PyObject_GetAttr(inst, list_name);
    if (obs == NULL) return -1;
    if (!PyList_CheckExact(obs)) {
        Py_DECREF(obs);
        PyObject *oargs[4] = {inst, n > 0 ? cargs[0] : NULL, n > 1 ? cargs[1] : NULL, n > 2 ? cargs[2] : NULL};
        PyObject *r = PyObject_VectorcallMethod(method, oargs, (n + 1) | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
        if (r == NULL) return -1;
        Py_DECREF(r);
        return 0;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(obs); i++) {
        PyObject *fn = Py_NewRef(PyList_GET_ITEM(obs, i));
        PyObject *r = PyObject_Vectorcall(fn, cargs, n, NULL);
        if (r != NULL) {
            Py_DECREF(r);
            Py_DECREF(fn);
            continue;
        }
        if (!PyErr_ExceptionMatches(PyExc_Exception)) { /* KeyboardInterrupt and the like pass through */
            Py_DECREF(fn);
            Py_DECREF(obs);
            return -1;
        }
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        PyErr_NormalizeException(&type, &value, &tb);
        if (tb != NULL) PyException_SetTraceback(value, tb);
        PyObject *dargs[4] = {inst, kind, fn, value};
        r = PyObject_VectorcallMethod(s_drop_observer, dargs, 4 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(tb);
        Py_DECREF(fn);
        if (r == NULL) {
            Py_DECREF(obs);
            return -1;
        }
        Py_DECREF(r);
    }
    Py_DECREF(obs);
    return 0;
}

static int observe_forward(PyObject *inst, PyObject *mod, PyObject *args, PyObject *kw) {
    PyObject *cargs[3] = {mod, args, kw};
    return observe(inst, s_forward_observers, s_observe_forward, s_forward, cargs, 3);
}

/* install.py's CHECKPOINT_CALLER_DEPTH (a test compares them). */
#define CHECKPOINT_CALLER_DEPTH 4

/* install.py's called_from(inst._ckpt_code, the frame above this call): a reentrant
 * checkpoint's forward called the root (without grad). 1, 0, or -1 with the exception. */
static int ckpt_caller(PyObject *inst) {
    PyObject *code = PyObject_GetAttr(inst, s_ckpt_code);
    if (code == NULL) return -1;
    int found = 0;
    if (code != Py_None) {
        PyFrameObject *f = PyEval_GetFrame(); /* borrowed: Module._wrapped_call_impl's */
        Py_XINCREF(f);
        for (int i = 0; f != NULL && i <= CHECKPOINT_CALLER_DEPTH; i++) {
            PyCodeObject *c = PyFrame_GetCode(f);
            found = (PyObject *)c == code;
            Py_DECREF(c);
            if (found) break;
            PyFrameObject *back = PyFrame_GetBack(f);
            Py_DECREF(f);
            f = back;
        }
        Py_XDECREF(f);
    }
    Py_DECREF(code);
    return found;
}

/* The open eval span is not judged evaluation yet (phases.py's eval_span_is_evaluation). */
static int eval_not_judged(Core *core) {
    return core->_eval_judged != Py_True;
}

static PyObject *RootCall_call(RootCall *self, PyObject *args, PyObject *kwargs) {
    ROOT_FIELDS(FIELD_SET)
    PyObject *mod = root_mod(self);
    if (mod == NULL) return NULL;
    /* Inside torch.compile's tracing, torch.export, or stepwatch's own FLOP-count replay: the call as it is. */
    {
        int c = 0; /* dynamo None: a function that is False outside dynamo's tracing, not called (install.py) */
        if (self->dynamo != Py_None) {
            PyObject *d = PyObject_CallNoArgs(self->dynamo);
            if (d == NULL) return NULL;
            c = PyObject_IsTrue(d);
            Py_DECREF(d);
            if (c < 0) return NULL;
        }
        if (!c && (c = attr_truth(self->compiler, s_is_compiling_flag)) < 0) return NULL;
        if (!c) {
            int some = attr_truth(self->replay, s_active);
            if (some < 0) return NULL;
            if (some) { /* some thread replays: is it this one? (hooks/replay.py) */
                PyObject *mine = PyObject_CallMethodNoArgs(self->replay, s_mine);
                if (mine == NULL) return NULL;
                c = PyObject_IsTrue(mine);
                Py_DECREF(mine);
                if (c < 0) return NULL;
            }
        }
        if (c) return call_inner(self, mod, args, kwargs);
    }
    PyObject *inst = self->inst, *tr = self->tr;
    Core *core = as_core(tr);
    /* in_data: a module called inside a DataLoader fetch (a Dataset transform) */
    {
        int en = TR_TRUTH(core, tr, enabled, s_enabled);
        if (en < 0) return NULL;
        if (!en) return call_inner(self, mod, args, kwargs);
        PyObject *nr = PyObject_GetAttr(inst, s_not_roots);
        if (nr == NULL) return NULL;
        int skip = 0;
        if (PyAnySet_Check(nr) ? PySet_GET_SIZE(nr) > 0 : PyObject_IsTrue(nr)) {
            PyObject *id = PyLong_FromVoidPtr(mod);
            skip = id ? PySequence_Contains(nr, id) : -1;
            Py_XDECREF(id);
        }
        Py_DECREF(nr);
        if (skip < 0) return NULL;
        if (!skip && (skip = TR_TRUTH(core, tr, in_data, s_in_data)) < 0) return NULL;
        if (skip) return call_inner(self, mod, args, kwargs);
    }
    /* Only the outermost call is observed: a declared root nested in another is part of it. */
    PyObject *kw = NULL;
    {
        int obs = attr_truth(inst, s_forward_observers);
        if (obs < 0) return NULL;
        if (obs) {
            int depth = TR_TRUTH(core, tr, _fwd_depth, s_fwd_depth);
            if (depth < 0) return NULL;
            int bwd = depth ? 0 : TR_TRUTH(core, tr, _bwd_depth, s_bwd_depth);
            if (bwd < 0) return NULL;
            if (bwd) { /* inside a backward: a recompute (checkpoint(model, x)), the backward's work */
                int rec = attr_truth(inst, s_recompute_observers);
                if (rec < 0) return NULL;
                if (rec) {
                    kw = kwargs ? Py_NewRef(kwargs) : PyDict_New();
                    if (kw == NULL) return NULL;
                    PyObject *cargs[3] = {mod, args, kw};
                    int r = observe(inst, s_recompute_observers, s_observe_recompute, s_recompute, cargs, 3);
                    Py_CLEAR(kw);
                    if (r < 0) return NULL;
                }
            } else if (!depth) {
                PyObject *pe = core ? Py_XNewRef(core->_pending_end) : PyObject_GetAttr(tr, s_pending_end);
                if (pe == NULL) return core ? unset("_pending_end") : NULL;
                int pending = pe != Py_None;
                Py_DECREF(pe);
                /* what the observers count belongs to the step this forward opens */
                if (pending) {
                    if (tr_run(core, tr, Core_work_begins, s_work_begins, NULL) < 0) return NULL;
                }
                kw = kwargs ? Py_NewRef(kwargs) : PyDict_New();
                if (kw == NULL) return NULL;
                int r = observe_forward(inst, mod, args, kw);
                Py_CLEAR(kw);
                if (r < 0) return NULL;
            }
        }
    }
    PyObject *grad;
    int no_grad = 0; /* grad disabled (not eval mode alone): install.py's _no_grad_call judges it */
    if (self->follows == Py_True) {
        /* A root without parameters (a loss module, an augmentation), grad or not, is the open
           eval span's, else the step's work (install.py's _PyRootCallCore says why). */
        int open = TR_TRUTH(core, tr, _eval_open, s_eval_open);
        if (open < 0) return NULL;
        grad = Py_NewRef(open ? Py_False : Py_True);
    } else if ((grad = PyObject_CallNoArgs(self->grad_enabled)) == NULL) {
        return NULL;
    } else if (grad != Py_True) {
        no_grad = 1;
        int ck = ckpt_caller(inst);
        if (ck < 0) {
            Py_DECREF(grad);
            return NULL;
        }
        if (ck) { /* a reentrant checkpoint's forward: the step's forward, run without grad */
            PyObject *ka = kwargs ? Py_NewRef(kwargs) : PyDict_New();
            if (ka == NULL) {
                Py_DECREF(grad);
                return NULL;
            }
            PyObject *r = PyObject_CallMethodObjArgs(inst, s_checkpointed_forward, mod, args, ka, NULL);
            Py_DECREF(ka);
            if (r == NULL) {
                Py_DECREF(grad);
                return NULL;
            }
            Py_DECREF(r);
            no_grad = 0;
            PyObject *training = PyObject_GetAttr(mod, s_training);
            if (training == NULL) {
                if (!PyErr_ExceptionMatches(PyExc_AttributeError)) {
                    Py_DECREF(grad);
                    return NULL;
                }
                PyErr_Clear();
            }
            Py_SETREF(grad, Py_NewRef(training == Py_False ? Py_False : Py_True));
            Py_XDECREF(training);
        }
    } else {
        /* A root in eval mode (model.eval()) is evaluation with grad enabled too: a validation
           loop without torch.no_grad() (install.py's _PyRootCallCore says why). */
        PyObject *training = PyObject_GetAttr(mod, s_training);
        if (training == NULL) {
            if (!PyErr_ExceptionMatches(PyExc_AttributeError)) {
                Py_DECREF(grad);
                return NULL;
            }
            PyErr_Clear(); /* not an nn.Module's attribute set: a training call, as before */
        } else if (training == Py_False) {
            Py_SETREF(grad, Py_NewRef(Py_False));
        }
        Py_XDECREF(training);
    }
    if (tr_run(core, tr, Core_forward_begin, s_forward_begin, grad) < 0) {
        Py_DECREF(grad);
        return NULL;
    }
    if (no_grad && (core == NULL || (core->_eval_open == Py_True && eval_not_judged(core)))) {
        /* an evaluation of the model being trained? (never raises: it reports its own errors) */
        PyObject *r = PyObject_CallMethodOneArg(inst, s_no_grad_call, mod);
        if (r == NULL) PyErr_Clear();
        Py_XDECREF(r);
    }
    PyObject *out = call_inner(self, mod, args, kwargs);
    if (out == NULL) {
        PyObject *phase = grad == Py_False ? s_eval : s_forward; /* torch.is_grad_enabled(): a bool */
        Py_DECREF(grad);
        return call_failed(inst, phase, 0, core, tr, Core_forward_end, s_forward_end, NULL);
    }
    Py_DECREF(grad);
    if (tr_run(core, tr, Core_forward_end, s_forward_end, NULL) < 0) {
        Py_DECREF(out);
        return NULL;
    }
    return out;
}

#define ROOT_MEMBER(f) {#f, T_OBJECT_EX, offsetof(RootCall, f), 0, NULL},
static PyMemberDef RootCall_members[] = {ROOT_FIELDS(ROOT_MEMBER){NULL}};

OBJECT_TYPE(RootCall, ROOT_FIELDS, "stepwatch.hooks._ctracker.RootCall",
            "A root module's call (hooks/install.py's _PyRootCall, in C).",
            {Py_tp_call, RootCall_call},)

/* -- torch.autograd.backward, wrapped (hooks/install.py's _PyBackwardCore, in C) --------------
 *
 * The backward phase around torch's own backward (what Tensor.backward calls). */

typedef struct {
    PyObject_HEAD
    PyObject *inst, *tr, *inner, *replay;
} BackwardCall;

#define BWD_FIELDS(X) X(inst) X(tr) X(inner) X(replay)

static PyObject *BackwardCall_call(BackwardCall *self, PyObject *args, PyObject *kwargs) {
    BWD_FIELDS(FIELD_SET)
    /* stepwatch's own FLOP-count replay (a reentrant checkpoint's backward): the call as it is */
    int some = attr_truth(self->replay, s_active);
    if (some < 0) return NULL;
    if (some) {
        PyObject *mine = PyObject_CallMethodNoArgs(self->replay, s_mine);
        if (mine == NULL) return NULL;
        int c = PyObject_IsTrue(mine);
        Py_DECREF(mine);
        if (c < 0) return NULL;
        if (c) return PyObject_Call(self->inner, args, kwargs);
    }
    PyObject *inst = self->inst, *tr = self->tr;
    Core *core = as_core(tr);
    int en = TR_TRUTH(core, tr, enabled, s_enabled);
    if (en < 0) return NULL;
    if (en) { /* the first backward: the roots, and whether the loop has an optimizer */
        int checked = attr_truth(inst, s_boundary_checked);
        if (checked < 0) return NULL;
        if (!checked) {
            PyObject *r = PyObject_CallMethodNoArgs(inst, s_check_boundary);
            if (r == NULL) return NULL;
            Py_DECREF(r);
        }
    }
    if (tr_run(core, tr, Core_backward_begin, s_backward_begin, NULL) < 0) return NULL;
    PyObject *out = PyObject_Call(self->inner, args, kwargs);
    if (out == NULL) return call_failed(inst, s_backward, 0, core, tr, Core_backward_end, s_backward_end, NULL);
    if (tr_run(core, tr, Core_backward_end, s_backward_end, NULL) < 0) {
        Py_DECREF(out);
        return NULL;
    }
    return out;
}

#define BWD_MEMBER(f) {#f, T_OBJECT_EX, offsetof(BackwardCall, f), 0, NULL},
static PyMemberDef BackwardCall_members[] = {BWD_FIELDS(BWD_MEMBER){NULL}};

OBJECT_TYPE(BackwardCall, BWD_FIELDS, "stepwatch.hooks._ctracker.BackwardCall",
            "torch.autograd.backward, wrapped (hooks/install.py's _PyBackwardCore, in C).",
            {Py_tp_call, BackwardCall_call},)

/* -- a DataLoader iterator's __next__, wrapped (hooks/install.py's _PyDataNextCore, in C) ------
 *
 * On _BaseDataLoaderIter, so called with the iterator: the data phase around torch's own
 * __next__ (told whether grad was disabled and whether the fetch ended the iteration), and at the
 * first fetch of an enabled tracker, a scan for the roots; on a thread other than the tracker's
 * (a prefetcher's), torch's own __next__ alone. tp_descr_get binds it to the iterator as a
 * function on a class does. */

typedef struct {
    PyObject_HEAD
    PyObject *inst, *tr, *inner, *grad_enabled;
} DataNext;

#define DN_FIELDS(X) X(inst) X(tr) X(inner) X(grad_enabled)

/* tr.data_end(t0, how | FETCH_NO_GRAD when grad is disabled now): the Core's C function when
 * ``core`` is set, else through the attribute. 0, or -1 with the exception. */
static int fetch_ended(DataNext *self, Core *core, PyObject *tr, PyObject *t0, long how) {
    PyObject *g = PyObject_CallNoArgs(self->grad_enabled);
    if (g == NULL) return -1;
    int on = PyObject_IsTrue(g);
    Py_DECREF(g);
    if (on < 0) return -1;
    if (!on) how |= FETCH_NO_GRAD;
    PyObject *r;
    if (core) {
        r = data_end(core, t0, how);
    } else {
        PyObject *h = PyLong_FromLong(how);
        if (h == NULL) return -1;
        PyObject *cargs[3] = {tr, t0, h};
        r = PyObject_VectorcallMethod(s_data_end, cargs, 3 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
        Py_DECREF(h);
    }
    if (r == NULL) return -1;
    Py_DECREF(r);
    return 0;
}

static PyObject *DataNext_call(DataNext *self, PyObject *args, PyObject *kwargs) {
    DN_FIELDS(FIELD_SET)
    PyObject *inst = self->inst, *tr = self->tr;
    Core *core = as_core(tr);
    { /* another thread's fetch (a prefetcher): not the training loop's wait, the tracker untouched */
        PyObject *th = core ? Py_XNewRef(core->_thread) : PyObject_GetAttr(tr, s_thread);
        if (th == NULL) return core ? unset("_thread") : NULL;
        unsigned long want = PyLong_AsUnsignedLong(th);
        Py_DECREF(th);
        if (want == (unsigned long)-1 && PyErr_Occurred()) return NULL;
        if (want != PyThread_get_thread_ident()) return PyObject_Call(self->inner, args, kwargs);
    }
    int scanned = attr_truth(inst, s_data_scanned);
    if (scanned < 0) return NULL;
    if (!scanned) {
        int en = TR_TRUTH(core, tr, enabled, s_enabled);
        if (en < 0) return NULL;
        if (en) {
            if (PyObject_SetAttr(inst, s_data_scanned, Py_True) < 0) return NULL;
            PyObject *r = PyObject_CallMethodOneArg(inst, s_scan, s_first_data_fetch);
            if (r == NULL) return NULL;
            Py_DECREF(r);
        }
    }
    PyObject *t0 = tr_call(core, tr, Core_data_begin, s_data_begin, NULL);
    if (t0 == NULL) return NULL;
    PyObject *out = PyObject_Call(self->inner, args, kwargs);
    if (out == NULL) {
        long how = PyErr_ExceptionMatches(PyExc_StopIteration) ? FETCH_END : 0;
        PyObject *type, *value, *tb;
        observe_failure(inst, s_data, 1, &type, &value, &tb);
        int rc = fetch_ended(self, core, tr, t0, how);
        Py_DECREF(t0);
        if (rc < 0) { /* as Python's, an exception there replaces the user's */
            Py_XDECREF(type);
            Py_XDECREF(value);
            Py_XDECREF(tb);
            return NULL;
        }
        PyErr_Restore(type, value, tb);
        return NULL;
    }
    int rc = fetch_ended(self, core, tr, t0, 0);
    Py_DECREF(t0);
    if (rc < 0) {
        Py_DECREF(out);
        return NULL;
    }
    return out;
}

static PyObject *DataNext_get(PyObject *self, PyObject *obj, PyObject *type) {
    if (obj == NULL || obj == Py_None) return Py_NewRef(self);
    return PyMethod_New(self, obj);
}

#define DN_MEMBER(f) {#f, T_OBJECT_EX, offsetof(DataNext, f), 0, NULL},
static PyMemberDef DataNext_members[] = {DN_FIELDS(DN_MEMBER){NULL}};

OBJECT_TYPE(DataNext, DN_FIELDS, "stepwatch.hooks._ctracker.DataNext",
            "A DataLoader iterator's __next__, wrapped (hooks/install.py's _PyDataNextCore, in C).",
            {Py_tp_call, DataNext_call}, {Py_tp_descr_get, DataNext_get},)

/* -- the optimizer step pre-hook (hooks/install.py's _PyOptPreCore, in C) ----------------------
 *
 * torch's global optimizer step pre-hook, called (optimizer, args, kwargs) by every
 * optimizer.step: the observers (the grad-norm probe), then the optimizer phase opens. */

typedef struct {
    PyObject_HEAD
    PyObject *inst, *tr;
} OptPre;

#define OPT_FIELDS(X) X(inst) X(tr)

static Py_ssize_t closure_at = 1; /* install.py's _CLOSURE_AT */

static PyObject *OptPre_call(OptPre *self, PyObject *targs, PyObject *tkwargs) {
    PyObject *a[3];
    if (positional("OptPre", targs, tkwargs, 3, a) < 0) return NULL;
    PyObject *optimizer = a[0], *args = a[1], *kwargs = a[2];
    OPT_FIELDS(FIELD_SET)
    PyObject *inst = self->inst, *tr = self->tr;
    Core *core = as_core(tr);
    int en = TR_TRUTH(core, tr, enabled, s_enabled);
    if (en <= 0) return en < 0 ? NULL : Py_NewRef(Py_None);
    /* the common case, one optimizer: the last one again (no WeakSet lookup) */
    PyObject *last = PyObject_GetAttr(inst, s_last_optimizer);
    if (last == NULL) return NULL;
    PyObject *o = deref(last); /* None, or a weak reference (install.py's _new_optimizer) */
    int same = o == optimizer;
    Py_XDECREF(o);
    Py_DECREF(last);
    if (!same) {
        PyObject *r = PyObject_CallMethodOneArg(inst, s_new_optimizer, optimizer);
        if (r == NULL) return NULL;
        Py_DECREF(r);
    }
    /* more than the optimizer given to step(): maybe a closure */
    int more;
    if (kwargs != Py_None && (more = PyObject_IsTrue(kwargs)) != 0) {
        if (more < 0) return NULL;
    } else {
        Py_ssize_t na = PyObject_Size(args);
        if (na < 0) return NULL;
        more = na > closure_at;
    }
    if (more) {
        PyObject *cargs[4] = {inst, optimizer, args, kwargs};
        return PyObject_VectorcallMethod(s_opt_pre_args, cargs, 4 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    }
    /* the observers (an empty list calls none: one lookup, not a truth test and then the loop's) */
    if (observe(inst, s_optimizer_observers, s_observe_optimizer, s_optimizer, &optimizer, 1) < 0) return NULL;
    if (tr_run(core, tr, Core_optimizer_begin, s_optimizer_begin, NULL) < 0) return NULL;
    Py_RETURN_NONE;
}

#define OPT_MEMBER(f) {#f, T_OBJECT_EX, offsetof(OptPre, f), 0, NULL},
static PyMemberDef OptPre_members[] = {OPT_FIELDS(OPT_MEMBER){NULL}};

OBJECT_TYPE(OptPre, OPT_FIELDS, "stepwatch.hooks._ctracker.OptPre",
            "The optimizer step pre-hook (hooks/install.py's _PyOptPreCore, in C).",
            {Py_tp_call, OptPre_call},)

/* -- stepwatch.log's values: a CPU tensor read in C (phases.py's cpu_items) ---------------------
 *
 * _pipeline.py's loggable reads a CPU torch.Tensor at once (v.item()): the value of nearly every
 * stepwatch.log(loss=loss) on a CPU job. CpuItem(Tensor, loggable) is that first branch of
 * loggable in C (no Python frame a logged value); anything else, and a value item() does not make
 * a float of, goes to loggable itself. */

typedef struct {
    PyObject_HEAD
    PyObject *tensor, *full;
} CpuItem;

#define ITEM_FIELDS(X) X(tensor) X(full)

static PyObject *s_is_cpu, *s_item;

static PyObject *CpuItem_call(CpuItem *self, PyObject *args, PyObject *kwargs) {
    PyObject *v;
    if (positional("CpuItem", args, kwargs, 1, &v) < 0) return NULL;
    if (self->tensor == NULL || self->full == NULL) return unset(self->tensor == NULL ? "tensor" : "full");
    if ((PyObject *)Py_TYPE(v) == self->tensor) {
        int cpu = attr_truth(v, s_is_cpu);
        if (cpu < 0) return NULL;
        if (cpu) {
            PyObject *x = PyObject_CallMethodNoArgs(v, s_item);
            if (x == NULL) {
                /* several values: not one number; loggable says so (its except) */
                if (PyErr_ExceptionMatches(PyExc_RuntimeError) || PyErr_ExceptionMatches(PyExc_ValueError) ||
                    PyErr_ExceptionMatches(PyExc_TypeError)) {
                    PyErr_Clear();
                    return PyObject_CallOneArg(self->full, v);
                }
                return NULL;
            }
            if (PyFloat_CheckExact(x)) return x;
            Py_DECREF(x);
        }
    }
    return PyObject_CallOneArg(self->full, v);
}

#define ITEM_MEMBER(f) {#f, T_OBJECT_EX, offsetof(CpuItem, f), 0, NULL},
static PyMemberDef CpuItem_members[] = {ITEM_FIELDS(ITEM_MEMBER){NULL}};

OBJECT_TYPE(CpuItem, ITEM_FIELDS, "stepwatch.hooks._ctracker.CpuItem",
            "stepwatch.log's converter with a CPU tensor's item() read in C (phases.py's cpu_items).",
            {Py_tp_call, CpuItem_call},)

/* -- module ---------------------------------------------------------------------------------- */

static PyObject *mod_bind(PyObject *m, PyObject *cls) {
    Py_XSETREF(raw_step_cls, Py_NewRef(cls));
    raw_direct = 0;
    if (!PyType_Check(cls)) Py_RETURN_NONE;
    PyTypeObject *tp = (PyTypeObject *)cls;
    for (int i = 0; i < RAW_N; i++) {
        if ((raw_offsets[i] = plain_slot_offset(tp, raw_names[i])) < 0) Py_RETURN_NONE;
    }
    raw_direct = 1;
    Py_RETURN_NONE;
}

static PyObject *mod_bound_directly(PyObject *m, PyObject *unused) { return PyBool_FromLong(raw_direct); }

static PyObject *mod_set_clock(PyObject *m, PyObject *fn) {
    if (fn == Py_None) {
        Py_CLEAR(clock_override);
    } else {
        Py_XSETREF(clock_override, Py_NewRef(fn));
    }
    Py_RETURN_NONE;
}

static PyObject *mod_untracked(PyObject *m, PyObject *obj) { return Py_NewRef(untrack(obj)); }

/* instances(objects, a, b) -> (the objects whose type is a subclass of a, those of b): the module
   discovery's pass over gc.get_objects() (install.py's _instances, line for line). A scan went
   over every object of the heap in Python, ~170 ns each: ~60 ms for 300k objects, three times at
   a session's start. A type's answer is kept for the objects of the same type that follow. */
static PyObject *mod_instances(PyObject *m, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyList_Check(args[0]) || !PyType_Check(args[1]) || !PyType_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "instances(objects: list, a: type, b: type)");
        return NULL;
    }
    PyTypeObject *a = (PyTypeObject *)args[1], *b = (PyTypeObject *)args[2];
    PyObject *objects = args[0], *out_a = PyList_New(0), *out_b = PyList_New(0);
    if (out_a == NULL || out_b == NULL) goto fail;
    PyTypeObject *last = NULL;
    int which = 0; /* of last: 0 neither, 1 a, 2 b */
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(objects); i++) {
        PyObject *o = PyList_GET_ITEM(objects, i);
        PyTypeObject *tp = Py_TYPE(o);
        if (tp != last) {
            last = tp;
            which = PyType_IsSubtype(tp, a) ? 1 : PyType_IsSubtype(tp, b) ? 2 : 0;
        }
        if (which && PyList_Append(which == 1 ? out_a : out_b, o) < 0) goto fail;
    }
    PyObject *r = PyTuple_Pack(2, out_a, out_b);
    Py_DECREF(out_a);
    Py_DECREF(out_b);
    return r;
fail:
    Py_XDECREF(out_a);
    Py_XDECREF(out_b);
    return NULL;
}

/* frame_values(frame) -> the values of a function frame's bound local variables (a cell's or free
   variable's contents included), or None where only ``frame.f_locals`` can tell (before Python
   3.12, or a frame that is not a function's). Read without ``frame.f_locals``: before 3.13 that is
   a snapshot dict the frame keeps, and every local it copied (a trial's model, dropped by the
   script a moment later) stays alive until the next snapshot or the function's return. The
   module discovery's walk (install.py's _reachable) reads its callers' locals this way. */
static PyObject *mod_frame_values(PyObject *m, PyObject *frame) {
#if PY_VERSION_HEX >= 0x030C0000
    if (!PyFrame_Check(frame)) {
        PyErr_SetString(PyExc_TypeError, "frame_values(frame): a frame object");
        return NULL;
    }
    PyCodeObject *code = PyFrame_GetCode((PyFrameObject *)frame);
    if (!(code->co_flags & CO_OPTIMIZED)) {
        Py_DECREF(code);
        Py_RETURN_NONE; /* a module's or a class body's: its f_locals is its namespace, no snapshot */
    }
    PyObject *out = PyList_New(0);
    PyObject *groups[3] = {PyCode_GetVarnames(code), PyCode_GetCellvars(code), PyCode_GetFreevars(code)};
    Py_DECREF(code);
    for (int g = 0; g < 3 && out != NULL; g++) {
        PyObject *names = groups[g];
        if (names == NULL) {
            Py_CLEAR(out);
            break;
        }
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(names); i++) {
            PyObject *v = PyFrame_GetVar((PyFrameObject *)frame, PyTuple_GET_ITEM(names, i));
            if (v == NULL) {
                if (PyErr_ExceptionMatches(PyExc_NameError)) { /* unbound, or deleted by the script */
                    PyErr_Clear();
                    continue;
                }
                Py_CLEAR(out);
                break;
            }
            int r = PyList_Append(out, v);
            Py_DECREF(v);
            if (r < 0) {
                Py_CLEAR(out);
                break;
            }
        }
    }
    for (int g = 0; g < 3; g++) Py_XDECREF(groups[g]);
    return out;
#else
    Py_RETURN_NONE;
#endif
}

static PyMethodDef mod_methods[] = {
    {"untracked", mod_untracked, METH_O,
     "untracked(obj) -> obj, no longer tracked by the cyclic GC: for a step's payload that cannot be part "
     "of a reference cycle (see \"The cyclic GC\" in hooks/_ctracker.c)."},
    {"instances", (PyCFunction)(void (*)(void))mod_instances, METH_FASTCALL,
     "instances(objects, a, b) -> (objects of a subclass of a, of b): the module discovery's heap pass."},
    {"frame_values", mod_frame_values, METH_O,
     "frame_values(frame) -> a function frame's local values, read without f_locals's snapshot; None before 3.12."},
    {"_bind", mod_bind, METH_O, "_bind(RawStep): the record class _finalize builds."},
    {"_bound_directly", mod_bound_directly, METH_NOARGS, "Whether _finalize fills RawStep's slots itself."},
    {"_set_clock", mod_set_clock, METH_O, "_set_clock(fn | None): tests only; every C timestamp is fn()."},
    {NULL},
};

static struct PyModuleDef moddef = {PyModuleDef_HEAD_INIT, "stepwatch.hooks._ctracker", NULL, -1, mod_methods};

PyMODINIT_FUNC PyInit__ctracker(void) {
    INTERN(s_pause_opt, "_pause_opt");
    INTERN(s_opt_stale, "_opt_stale");
    INTERN(s_resume_opt, "_resume_opt");
    INTERN(s_pause_bwd, "_pause_bwd");
    INTERN(s_resume_bwd, "_resume_bwd");
    INTERN(s_drop_opt, "_drop_opt");
    INTERN(s_fail, "_fail");
    INTERN(s_push_step, "push_step");
    INTERN(s_push_range, "push_range");
    INTERN(s_pop_range, "pop_range");
    INTERN(s_forward, "forward");
    INTERN(s_eval, "eval");
    INTERN(s_training, "training");
    INTERN(s_eval_open, "_eval_open");
    INTERN(s_backward, "backward"); /* also the backward boundary's value and the phase's name */
    INTERN(s_optimizer, "optimizer");
    INTERN(s_explicit, "explicit");
    INTERN(s_set_phase, "set_phase");
    INTERN(s_set_step, "set_step");
    INTERN(s_begin, "begin");
    INTERN(s_end, "end");
    INTERN(s_name, "name");
    INTERN(s_take, "take");
    INTERN(s_update, "update");
    INTERN(s_backward_spans, "backward_spans");
    INTERN(s_checkpoint_bytes, "checkpoint_bytes");
    INTERN(s_is_compiling_flag, "_is_compiling_flag");
    INTERN(s_active, "active");
    INTERN(s_mine, "mine");
    INTERN(s_enabled, "enabled");
    INTERN(s_in_data, "in_data");
    INTERN(s_not_roots, "_not_roots");
    INTERN(s_forward_observers, "forward_observers");
    INTERN(s_exception_observers, "exception_observers");
    INTERN(s_fwd_depth, "_fwd_depth");
    INTERN(s_bwd_depth, "_bwd_depth");
    INTERN(s_recompute_observers, "recompute_observers");
    INTERN(s_observe_recompute, "_observe_recompute");
    INTERN(s_recompute, "recompute");
    INTERN(s_ckpt_code, "_ckpt_code");
    INTERN(s_checkpointed_forward, "_checkpointed_forward");
    INTERN(s_pending_end, "_pending_end");
    INTERN(s_work_begins, "work_begins");
    INTERN(s_observe_forward, "_observe_forward");
    INTERN(s_no_grad_call, "_no_grad_call");
    INTERN(s_forward_begin, "forward_begin");
    INTERN(s_forward_end, "forward_end");
    INTERN(s_observe_exception, "_observe_exception");
    INTERN(s_drop_observer, "_drop_observer");
    INTERN(s_last_optimizer, "_last_optimizer");
    INTERN(s_new_optimizer, "_new_optimizer");
    INTERN(s_opt_pre_args, "_opt_pre_args");
    INTERN(s_optimizer_observers, "optimizer_observers");
    INTERN(s_observe_optimizer, "_observe_optimizer");
    INTERN(s_optimizer_begin, "optimizer_begin");
    INTERN(s_is_cpu, "is_cpu");
    INTERN(s_backward_begin, "backward_begin");
    INTERN(s_backward_end, "backward_end");
    INTERN(s_boundary_checked, "_boundary_checked");
    INTERN(s_check_boundary, "_check_boundary");
    INTERN(s_item, "item");
    INTERN(s_data_begin, "data_begin");
    INTERN(s_data_end, "data_end");
    INTERN(s_data_scanned, "_data_scanned");
    INTERN(s_scan, "_scan");
    INTERN(s_first_data_fetch, "first data fetch");
    INTERN(s_data, "data");
    INTERN(s_thread, "_thread");
    PyObject *m = PyModule_Create(&moddef);
    if (m == NULL) return NULL;
    if (add_type(m, &Core_spec, "Core", &core_type) < 0 || add_type(m, &RootCall_spec, "RootCall", NULL) < 0 ||
        add_type(m, &OptPre_spec, "OptPre", NULL) < 0 || add_type(m, &BackwardCall_spec, "BackwardCall", NULL) < 0 ||
        add_type(m, &CpuItem_spec, "CpuItem", NULL) < 0 || add_type(m, &DataNext_spec, "DataNext", NULL) < 0 ||
        PyModule_AddIntConstant(m, "IN_STEP_NO_GRAD_CALLS", IN_STEP_NO_GRAD_CALLS) < 0 ||
        PyModule_AddIntConstant(m, "CHECKPOINT_CALLER_DEPTH", CHECKPOINT_CALLER_DEPTH) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

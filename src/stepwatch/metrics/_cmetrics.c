/* stepwatch.metrics._cmetrics: the FLOPs/tokens collector's per-forward fast path in C.
 *
 * Every root forward (the model's, the loss module's) runs metrics/tokens.py's
 * ThroughputCollector.on_forward on the training thread: a call like the module's last one (the
 * same argument shapes, dtypes, devices, grad flags and global state: metrics/flops.py's
 * CallSig.matches) appends what that call left to the step's list. In Python that is ~100
 * bytecodes and two frames a forward, the largest share of what the feature costs a step. This
 * module is the same code in C, line for line:
 *
 *   SigCore         CallSig's descriptors and `matches` (flops.py's _PySigCore)
 *   ThroughputCore  the collector's hot-path state, `on_forward` and the step's `take`
 *                   (tokens.py's _PyThroughputCore)
 *   GradNormCore    the grad-norm collector's optimizer step pre-hook, its common case: no clip
 *                   or GradScaler seen, the optimizer stepped last time too, one parameter group
 *                   as last time, plain dense parameters, no grad_scale (grads.py's
 *                   GradNormProbe.on_optimizer_step -> _probe -> _compute_plain, composed)
 *
 * Everything off the hot path (a first call, a new signature, an override, a count that depends
 * on the values) calls back into the Python (`_on_forward_full`, `_batch_counts`), so the rare
 * logic stays in one place. It is an accelerator only: both Python modules keep the reference
 * these methods translate and take it wherever this module is missing; tests run the collector
 * with both and compare them call for call. Exceptions pass through as they would in Python.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include "../_cobjects.h"

static PyObject *s_dtype, *s_shape, *s_requires_grad, *s_is_cuda, *s_is_cpu, *s_active, *s_mine, *s_matches,
    *s_on_forward_full, *s_training, *s_batch_counts, *s_getters_var, *s_getters_fn, *s_state_fn, *s_grad, *s_used, *s_last,
    *s_every, *s_param_groups, *s_params, *s_dict, *s_grad_scale, *s_probe_fn;

/* metrics/flops.py's globals, from _bind(): its _GETTERS (torch, any autocast, grad mode, the two
 * TF32 switches; None until _getters() binds them) and _state, read at each comparison as the
 * Python reads them. */
static PyObject *flops_globals = NULL;

static PyTypeObject *SigCore_type = NULL;

#define MEMBER(T, f) {#f, T_OBJECT_EX, offsetof(T, f), 0, NULL},

/* A field read before Python's __init__ set it: the AttributeError Python would raise. */
static PyObject *unset(const char *cls, const char *name) {
    PyErr_Format(PyExc_AttributeError, "'%s' object has no attribute '%s'", cls, name);
    return NULL;
}

/* A tensor's attribute (dtype, shape, requires_grad, is_cpu, is_cuda) read through its getter.
 * PyObject_GetAttr finds the same getset descriptor every call (torch's TensorBase's) through
 * the type's attribute machinery; here the getter found last time for the tensor's exact type is
 * called directly while that type is unchanged (its version tag, which CPython replaces whenever
 * the type or a base is modified) and reads attributes the generic way (no __getattr__ of its
 * own). The getter is torch's own, so a tensor subclass's or a mode's __torch_function__ still
 * runs in it. Anything else takes PyObject_GetAttr, which then fills the cache. */
typedef struct {
    PyTypeObject *type; /* not owned: compared only, and the tag below never repeats */
    unsigned int tag;
    getter get;
    void *closure;
} AttrCache;

enum { A_DTYPE, A_SHAPE, A_REQUIRES_GRAD, A_IS_CUDA, A_IS_CPU, A_GRAD, A_N };
static AttrCache attr_cache[A_N];
static PyObject **attr_names[A_N] = {&s_dtype, &s_shape, &s_requires_grad, &s_is_cuda, &s_is_cpu, &s_grad};

static PyObject *tensor_attr(PyObject *obj, int which) {
    AttrCache *c = &attr_cache[which];
    PyTypeObject *tp = Py_TYPE(obj);
    if (c->type == tp && c->tag != 0 && tp->tp_version_tag == c->tag &&
        PyType_HasFeature(tp, Py_TPFLAGS_VALID_VERSION_TAG)) {
        return c->get(obj, c->closure);
    }
    PyObject *name = *attr_names[which];
    PyObject *v = PyObject_GetAttr(obj, name);
    if (v != NULL && tp->tp_getattro == PyObject_GenericGetAttr) {
        PyObject *d = _PyType_Lookup(tp, name); /* borrowed; gives the type a version tag */
        if (d != NULL && Py_IS_TYPE(d, &PyGetSetDescr_Type) && ((PyGetSetDescrObject *)d)->d_getset->get != NULL &&
            PyType_HasFeature(tp, Py_TPFLAGS_VALID_VERSION_TAG)) {
            PyGetSetDef *gs = ((PyGetSetDescrObject *)d)->d_getset;
            c->type = tp;
            c->tag = tp->tp_version_tag;
            c->get = gs->get;
            c->closure = gs->closure;
        }
    }
    return v;
}

/* tensor_attr(obj) is want / its truth: 1, 0, or -1 with an exception. */
static int tensor_attr_is(PyObject *obj, int which, PyObject *want) {
    PyObject *v = tensor_attr(obj, which);
    if (v == NULL) return -1;
    int r = v == want;
    Py_DECREF(v);
    return r;
}

static int tensor_attr_truth(PyObject *obj, int which) {
    PyObject *v = tensor_attr(obj, which);
    if (v == NULL) return -1;
    int r = v == Py_None ? 0 : PyObject_IsTrue(v);
    Py_DECREF(v);
    return r;
}


/* Python's `a == b` / `a != b` truthiness, without RichCompareBool's identity shortcut (a NaN
 * is not equal to itself here, as in the Python). */
static int cmp(PyObject *a, PyObject *b, int op) {
    PyObject *r = PyObject_RichCompare(a, b, op);
    if (r == NULL) return -1;
    int t = PyObject_IsTrue(r);
    Py_DECREF(r);
    return t;
}

/* f() truthiness / f() == want. */
static int call_truth(PyObject *f) {
    PyObject *r = PyObject_CallNoArgs(f);
    if (r == NULL) return -1;
    int t = PyObject_IsTrue(r);
    Py_DECREF(r);
    return t;
}

static int call_eq(PyObject *f, PyObject *want) {
    PyObject *r = PyObject_CallNoArgs(f);
    if (r == NULL) return -1;
    int t = cmp(r, want, Py_EQ);
    Py_DECREF(r);
    return t;
}

/* -- CallSig (metrics/flops.py's _PySigCore, in C) -------------------------------------------- */

typedef struct {
    PyObject_HEAD
    PyObject *state, *args, *kwargs, *single, *flat, *keys;
} SigCore;

#define SIG_FIELDS(X) X(state) X(args) X(kwargs) X(single) X(flat) X(keys)

/* One tensor against its descriptor (class, shape, dtype, on CUDA, requires grad): the
 * comparisons of the Python's single path, in its order. */
static int tensor_matches(PyObject *a, PyObject *d) {
    if (!PyTuple_Check(d) || PyTuple_GET_SIZE(d) < 5) {
        PyErr_SetString(PyExc_TypeError, "CallSig: a tensor descriptor must be a 5-tuple");
        return -1;
    }
    if ((PyObject *)Py_TYPE(a) != PyTuple_GET_ITEM(d, 0)) return 0;
    int r = tensor_attr_is(a, A_DTYPE, PyTuple_GET_ITEM(d, 2));
    if (r <= 0) return r;
    PyObject *shape = tensor_attr(a, A_SHAPE);
    if (shape == NULL) return -1;
    r = cmp(shape, PyTuple_GET_ITEM(d, 1), Py_EQ);
    Py_DECREF(shape);
    if (r <= 0) return r;
    if ((r = tensor_attr_is(a, A_REQUIRES_GRAD, PyTuple_GET_ITEM(d, 4))) <= 0) return r;
    int cuda = PyObject_IsTrue(PyTuple_GET_ITEM(d, 3));
    if (cuda < 0) return -1;
    return tensor_attr_truth(a, cuda ? A_IS_CUDA : A_IS_CPU);
}

/* One value of the general path against its descriptor: a scalar's (class, value) by `!=`, a
 * tensor's as above but in that loop's order (dtype, shape, device, grad). */
static int value_matches(PyObject *a, PyObject *d) {
    if (!PyTuple_Check(d) || PyTuple_GET_SIZE(d) < 2) {
        PyErr_SetString(PyExc_TypeError, "CallSig: a descriptor must be a tuple");
        return -1;
    }
    if ((PyObject *)Py_TYPE(a) != PyTuple_GET_ITEM(d, 0)) return 0;
    if (PyTuple_GET_SIZE(d) == 2) {
        int ne = cmp(a, PyTuple_GET_ITEM(d, 1), Py_NE); /* same class, so 1 and True are told apart */
        return ne < 0 ? -1 : !ne;
    }
    if (PyTuple_GET_SIZE(d) < 5) {
        PyErr_SetString(PyExc_IndexError, "tuple index out of range");
        return -1;
    }
    int r = tensor_attr_is(a, A_DTYPE, PyTuple_GET_ITEM(d, 2));
    if (r <= 0) return r;
    PyObject *shape = tensor_attr(a, A_SHAPE);
    if (shape == NULL) return -1;
    r = cmp(shape, PyTuple_GET_ITEM(d, 1), Py_EQ);
    Py_DECREF(shape);
    if (r <= 0) return r;
    int cuda = PyObject_IsTrue(PyTuple_GET_ITEM(d, 3));
    if (cuda < 0) return -1;
    if ((r = tensor_attr_truth(a, cuda ? A_IS_CUDA : A_IS_CPU)) <= 0) return r;
    return tensor_attr_is(a, A_REQUIRES_GRAD, PyTuple_GET_ITEM(d, 4));
}

static int args_vs(PyObject *keys, PyObject *flat, PyObject *args, PyObject *kwargs);

static int args_match(SigCore *self, PyObject *args, PyObject *kwargs) {
    if (!PyTuple_CheckExact(args)) return 0;
    PyObject *keys = self->keys, *flat = self->flat;
    if (keys == NULL) return unset("CallSig", "keys"), -1;
    if (flat == NULL) return unset("CallSig", "flat"), -1;
    Py_INCREF(keys); /* held: a comparison may run Python code */
    Py_INCREF(flat);
    int r = args_vs(keys, flat, args, kwargs);
    Py_DECREF(keys);
    Py_DECREF(flat);
    return r;
}

static int args_vs(PyObject *keys, PyObject *flat, PyObject *args, PyObject *kwargs) {
    if (!PyTuple_Check(keys) || !PyTuple_Check(flat)) {
        PyErr_SetString(PyExc_TypeError, "CallSig: keys and flat must be tuples");
        return -1;
    }
    int has_kw = kwargs == Py_None ? 0 : PyObject_IsTrue(kwargs);
    if (has_kw < 0) return -1;
    Py_ssize_t na = PyTuple_GET_SIZE(args), nk = 0;
    if (has_kw) {
        if (!PyDict_CheckExact(kwargs)) return 0;
        /* tuple(kwargs) != self.keys */
        nk = PyDict_GET_SIZE(kwargs);
        if (nk != PyTuple_GET_SIZE(keys)) return 0;
        Py_ssize_t pos = 0, i = 0;
        PyObject *k, *v;
        while (PyDict_Next(kwargs, &pos, &k, &v)) {
            int eq = PyObject_RichCompareBool(k, PyTuple_GET_ITEM(keys, i++), Py_EQ);
            if (eq <= 0) return eq;
        }
    } else if (PyTuple_GET_SIZE(keys)) {
        return 0;
    }
    if (na + nk != PyTuple_GET_SIZE(flat)) return 0;
    for (Py_ssize_t i = 0; i < na; i++) {
        int r = value_matches(PyTuple_GET_ITEM(args, i), PyTuple_GET_ITEM(flat, i));
        if (r <= 0) return r;
    }
    if (nk) {
        Py_ssize_t pos = 0, i = na;
        PyObject *k, *v;
        while (PyDict_Next(kwargs, &pos, &k, &v)) {
            Py_INCREF(v); /* a descriptor's comparison may run Python code */
            int r = value_matches(v, PyTuple_GET_ITEM(flat, i++));
            Py_DECREF(v);
            if (r <= 0) return r;
        }
    }
    return 1;
}

/* The global state now against the one kept (``st``): the Python's comparison, in its order
 * (the TF32 switches not read when ``st`` keeps None for them).
 * ``grad``: grad mode as the caller just read it (the throughput collector's hot path asks it
 * first, and only goes on when it is on), or NULL to ask torch here. */
static int state_vs(PyObject *st, PyObject *getters, PyObject *grad) {
    if (st == NULL) return unset("CallSig", "state"), -1;
    if (!PyTuple_Check(st) || PyTuple_GET_SIZE(st) < 4) {
        PyErr_SetString(PyExc_TypeError, "CallSig: the state must be a 4-tuple");
        return -1;
    }
    int auto_on = PyTuple_GET_ITEM(st, 1) != Py_False;
    if (!auto_on && (auto_on = call_truth(PyTuple_GET_ITEM(getters, 1))) < 0) return -1;
    if (auto_on) { /* st == _state(tf32) */
        PyObject *state_fn = PyDict_GetItemWithError(flops_globals, s_state_fn); /* borrowed */
        if (state_fn == NULL) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_NameError, "name '_state' is not defined");
            return -1;
        }
        PyObject *now = PyObject_CallOneArg(state_fn, PyTuple_GET_ITEM(st, 2) == Py_None ? Py_False : Py_True);
        if (now == NULL) return -1;
        int r = PyObject_RichCompareBool(st, now, Py_EQ); /* a tuple's == (identity first, as Python's) */
        Py_DECREF(now);
        return r;
    }
    int r = grad != NULL ? cmp(grad, PyTuple_GET_ITEM(st, 0), Py_EQ)
                         : call_eq(PyTuple_GET_ITEM(getters, 2), PyTuple_GET_ITEM(st, 0));
    if (r <= 0 || PyTuple_GET_ITEM(st, 2) == Py_None) return r; /* a count the TF32 switches cannot change */
    if ((r = call_eq(PyTuple_GET_ITEM(getters, 3), PyTuple_GET_ITEM(st, 2))) <= 0) return r;
    return call_eq(PyTuple_GET_ITEM(getters, 4), PyTuple_GET_ITEM(st, 3));
}

static int state_matches(SigCore *self, PyObject *grad) {
    if (flops_globals == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "stepwatch.metrics._cmetrics: _bind() was not called");
        return -1;
    }
    PyObject *getters = PyDict_GetItemWithError(flops_globals, s_getters_var); /* borrowed */
    if (getters == NULL) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_NameError, "name '_GETTERS' is not defined");
        return -1;
    }
    if (getters == Py_None) { /* `_GETTERS or _getters()` */
        PyObject *bind = PyDict_GetItemWithError(flops_globals, s_getters_fn); /* borrowed */
        if (bind == NULL) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_NameError, "name '_getters' is not defined");
            return -1;
        }
        getters = PyObject_CallNoArgs(bind);
        if (getters == NULL) return -1;
    } else {
        Py_INCREF(getters);
    }
    if (!PyTuple_Check(getters) || PyTuple_GET_SIZE(getters) != 5) {
        Py_DECREF(getters);
        PyErr_SetString(PyExc_TypeError, "CallSig: flops._GETTERS must be a 5-tuple");
        return -1;
    }
    PyObject *st = self->state;
    Py_XINCREF(st);
    int r = state_vs(st, getters, grad);
    Py_XDECREF(st);
    Py_DECREF(getters);
    return r;
}

/* CallSig.matches: 1, 0, or -1 with an exception (``grad``: see state_vs). */
static int sig_matches(SigCore *self, PyObject *args, PyObject *kwargs, PyObject *grad) {
    PyObject *d = self->single;
    if (d == NULL) return unset("CallSig", "single"), -1;
    int r;
    if (d != Py_None) {
        PyObject *a = Py_None;
        if (PyTuple_CheckExact(args) && PyTuple_GET_SIZE(args) == 1) {
            int has_kw = kwargs == Py_None ? 0 : PyObject_IsTrue(kwargs);
            if (has_kw < 0) return -1;
            if (!has_kw) a = PyTuple_GET_ITEM(args, 0);
        }
        Py_INCREF(d); /* a tensor subclass's attributes may run Python code */
        r = tensor_matches(a, d);
        Py_DECREF(d);
    } else {
        r = args_match(self, args, kwargs);
    }
    if (r <= 0) return r;
    return state_matches(self, grad);
}

static PyObject *SigCore_matches(SigCore *self, PyObject *const *argv, Py_ssize_t n) {
    if (n != 2) {
        PyErr_Format(PyExc_TypeError, "matches() takes 2 arguments (%zd given)", n);
        return NULL;
    }
    int r = sig_matches(self, argv[0], argv[1], NULL);
    if (r < 0) return NULL;
    return PyBool_FromLong(r);
}

static PyMethodDef SigCore_methods[] = {
    {"matches", (PyCFunction)(void (*)(void))SigCore_matches, METH_FASTCALL,
     "matches(args, kwargs) -> bool: another call with this call's signature."},
    {NULL},
};

#define SIG_MEMBER(f) MEMBER(SigCore, f)
static PyMemberDef SigCore_members[] = {SIG_FIELDS(SIG_MEMBER){NULL}};

OBJECT_TYPE(SigCore, SIG_FIELDS, "stepwatch.metrics._cmetrics.SigCore",
            "One call's signature and its comparison (metrics/flops.py's _PySigCore, in C).",
            {Py_tp_methods, SigCore_methods},)

/* -- ThroughputCollector's hot path (metrics/tokens.py's _PyThroughputCore, in C) -------------- */

typedef struct {
    PyObject_HEAD
    PyObject *_grad_enabled, *_replay, *_hits, *_items, *_any_call, *_recount, *_followers;
    char _appended; /* the last on_forward appended an item (a call that raises takes it back) */
} ThroughputCore; /* no __dict__ of its own: tokens.py's ThroughputCollector, a subclass, has one */

#define TP_FIELDS(X) X(_grad_enabled) X(_replay) X(_hits) X(_items) X(_any_call) X(_recount) X(_followers)

#define TP_GET(self, f) ((self)->f ? (self)->f : unset("ThroughputCollector", #f))

static PyObject *Throughput_on_forward(ThroughputCore *self, PyObject *const *argv, Py_ssize_t n) {
    if (n != 3) {
        PyErr_Format(PyExc_TypeError, "on_forward() takes 3 arguments (%zd given)", n);
        return NULL;
    }
    PyObject *module = argv[0], *args = argv[1], *kwargs = argv[2];
    self->_appended = 0;
    PyObject *grad_enabled = TP_GET(self, _grad_enabled), *replay = TP_GET(self, _replay);
    if (grad_enabled == NULL || replay == NULL) return NULL;
    int t = call_truth(grad_enabled);
    if (t < 0) return NULL;
    if (!t) Py_RETURN_NONE;
    if ((t = attr_truth(replay, s_active)) < 0) return NULL;
    if (t) { /* some thread replays a FLOP count: is it this one? (hooks/replay.py) */
        PyObject *mine = PyObject_CallMethodNoArgs(replay, s_mine);
        if (mine == NULL) return NULL;
        t = PyObject_IsTrue(mine);
        Py_DECREF(mine);
        if (t < 0) return NULL;
        if (t) Py_RETURN_NONE;
    }
    /* A root in eval mode with grad enabled: evaluation or the step's own forward, which the
       tracker judges later; the full path holds its item until then (tokens.py's _hold). */
    PyObject *training = PyObject_GetAttr(module, s_training);
    if (training == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError)) return NULL;
        PyErr_Clear();
    } else {
        int eval_mode = training == Py_False;
        Py_DECREF(training);
        if (eval_mode) goto full;
    }
    PyObject *hits = TP_GET(self, _hits), *any_call = TP_GET(self, _any_call), *recount = TP_GET(self, _recount);
    if (hits == NULL || any_call == NULL || recount == NULL) return NULL;
    PyObject *key = PyLong_FromVoidPtr(module);
    if (key == NULL) return NULL;
    PyObject *hit;
    if (PyDict_CheckExact(hits)) {
        hit = PyDict_GetItemWithError(hits, key);
        Py_XINCREF(hit);
    } else {
        hit = PyObject_CallMethod(hits, "get", "O", key);
        if (hit == Py_None) Py_CLEAR(hit);
    }
    Py_DECREF(key);
    if (hit == NULL && PyErr_Occurred()) return NULL;
    if (hit != NULL) {
        if (!PyTuple_Check(hit) || PyTuple_GET_SIZE(hit) < 2) {
            Py_DECREF(hit);
            PyErr_SetString(PyExc_TypeError, "ThroughputCollector: a hit must be a (signature, item) pair");
            return NULL;
        }
        /* The hit's signature, then the one before it (its third part, when a tuple): two in
           turn (two micro-batch lengths) both stay on this path (tokens.py's _remember). */
        PyObject *cand = hit, *sig = NULL;
        int m = 0;
        for (int tries = 0; tries < 2; tries++) {
            if (tries) {
                if (PyTuple_GET_SIZE(hit) < 3) break;
                cand = PyTuple_GET_ITEM(hit, 2);
                if (!PyTuple_Check(cand) || PyTuple_GET_SIZE(cand) < 2) break;
            }
            sig = PyTuple_GET_ITEM(cand, 0);
            if (sig == any_call) {
                m = 1;
            } else if (PyObject_TypeCheck(sig, SigCore_type)) {
                m = sig_matches((SigCore *)sig, args, kwargs, Py_True); /* grad mode is on: asked above */
            } else {
                PyObject *r = PyObject_CallMethodObjArgs(sig, s_matches, args, kwargs, NULL);
                m = r == NULL ? -1 : PyObject_IsTrue(r);
                Py_XDECREF(r);
            }
            if (m) break;
        }
        if (m < 0) {
            Py_DECREF(hit);
            return NULL;
        }
        if (m) {
            PyObject *item = Py_NewRef(PyTuple_GET_ITEM(cand, 1));
            int may_open = sig != any_call && PyTuple_Check(item) && PyTuple_GET_SIZE(item) >= 2 &&
                           PyTuple_GET_ITEM(item, 1) == Py_None; /* not the model when remembered */
            Py_DECREF(hit);
            if (may_open) { /* another root opens the step: the step's model now (tokens.py's _take_over) */
                PyObject *its = TP_GET(self, _items);
                int some = its == NULL ? -1 : PyObject_IsTrue(its); /* `not self._items` */
                if (some == 0) { /* unless it has no parameters: `id(module) not in self._followers` */
                    PyObject *followers = TP_GET(self, _followers), *mid = NULL;
                    some = followers == NULL || (mid = PyLong_FromVoidPtr(module)) == NULL
                               ? -1
                               : PySequence_Contains(followers, mid);
                    Py_XDECREF(mid);
                    if (some == 0) {
                        Py_DECREF(item);
                        goto full;
                    }
                }
                if (some < 0) {
                    Py_DECREF(item);
                    return NULL;
                }
            }
            if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) < 2) {
                Py_DECREF(item);
                PyErr_SetString(PyExc_TypeError, "ThroughputCollector: an item must be a (flops, counts) pair");
                return NULL;
            }
            if (PyTuple_GET_ITEM(item, 1) == recount) {
                PyObject *counts = PyObject_CallMethodObjArgs((PyObject *)self, s_batch_counts, args, kwargs, NULL);
                if (counts == NULL) {
                    Py_DECREF(item);
                    return NULL;
                }
                PyObject *fresh = PyTuple_Pack(2, PyTuple_GET_ITEM(item, 0), counts);
                Py_DECREF(counts);
                Py_DECREF(item);
                if (fresh == NULL) return NULL;
                item = fresh;
            }
            PyObject *items = TP_GET(self, _items);
            int rc;
            if (items == NULL) {
                rc = -1;
            } else if (PyList_CheckExact(items)) {
                rc = PyList_Append(items, item);
            } else {
                PyObject *r = PyObject_CallMethod(items, "append", "O", item);
                rc = r == NULL ? -1 : 0;
                Py_XDECREF(r);
            }
            Py_DECREF(item);
            if (rc < 0) return NULL;
            self->_appended = 1;
            Py_RETURN_NONE;
        }
        Py_DECREF(hit);
    }
full:;
    PyObject *full[4] = {(PyObject *)self, module, args, kwargs};
    return PyObject_VectorcallMethod(s_on_forward_full, full, 4 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
}

/* tokens.py's StepThroughput and its _UNSET, from _bind_take(): take() allocates the step's
 * StepThroughput and fills its two slots itself, as its __init__ would (the Python take's call of
 * that __init__ was a frame a step). Unbound (or a class whose slots are not plain), it calls the
 * class. */
static PyObject *step_cls = NULL, *unset_marker = NULL;
static Py_ssize_t st_items_off = -1, st_flops_off = -1;

/* _PyThroughputCore.take: the step's items as a StepThroughput (None when there are none), a
 * fresh list for the next step; both untracked by the cyclic GC (numbers and cached counts only:
 * nothing in them can refer back to them). */
static PyObject *Throughput_take(ThroughputCore *self, PyObject *unused) {
    PyObject *items = TP_GET(self, _items);
    if (items == NULL) return NULL;
    int t = PyList_CheckExact(items) ? PyList_GET_SIZE(items) != 0 : PyObject_IsTrue(items);
    if (t <= 0) {
        if (t < 0) return NULL;
        Py_RETURN_NONE;
    }
    if (step_cls == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "stepwatch.metrics._cmetrics: _bind_take() was not called");
        return NULL;
    }
    PyObject *fresh = PyList_New(0);
    if (fresh == NULL) return NULL;
    Py_INCREF(items);
    Py_SETREF(self->_items, fresh);
    untrack(items);
    PyObject *st;
    if (st_items_off >= 0) {
        PyTypeObject *tp = (PyTypeObject *)step_cls;
        st = tp->tp_alloc(tp, 0);
        if (st == NULL) {
            Py_DECREF(items);
            return NULL;
        }
        *(PyObject **)((char *)st + st_items_off) = items; /* tp_alloc zeroed both slots */
        *(PyObject **)((char *)st + st_flops_off) = Py_NewRef(unset_marker);
    } else {
        st = PyObject_CallOneArg(step_cls, items);
        Py_DECREF(items);
        if (st == NULL) return NULL;
    }
    return untrack(st);
}

static PyMethodDef ThroughputCore_methods[] = {
    {"on_forward", (PyCFunction)(void (*)(void))Throughput_on_forward, METH_FASTCALL,
     "on_forward(module, args, kwargs): a root module's call, before its forward."},
    {"take", (PyCFunction)Throughput_take, METH_NOARGS,
     "take() -> StepThroughput | None: the step's items, at its end."},
    {NULL},
};

#define TP_MEMBER(f) MEMBER(ThroughputCore, f)
static PyMemberDef ThroughputCore_members[] = {
    TP_FIELDS(TP_MEMBER){"_appended", T_BOOL, offsetof(ThroughputCore, _appended), 0, NULL}, {NULL}};

OBJECT_TYPE(ThroughputCore, TP_FIELDS, "stepwatch.metrics._cmetrics.ThroughputCore",
            "The FLOPs/tokens collector's hot path (metrics/tokens.py's _PyThroughputCore, in C).",
            {Py_tp_methods, ThroughputCore_methods},)

/* -- GradNormCollector's optimizer step (metrics/grads.py, its common case in C) ---------------
 *
 * The pre-hook's Python path is GradNormProbe.on_optimizer_step -> _probe -> _compute_plain:
 * about 60 bytecodes over four frames a step, whose code and data the loop's torch work has
 * evicted from the caches by the next step. This is that path, composed, for the case nearly
 * every step takes; every condition below that does not hold sends the step, untouched, to the
 * Python (grads.py's _PyGradNormCore.on_optimizer_step, bound as gn_full). Past the step count's
 * increment, a case the common path does not take goes to GradNormProbe._probe, which counts
 * nothing. tests/unit/test_grads_core.py runs both collectors side by side and compares them. */

typedef struct {
    PyObject_HEAD
    PyObject *_buf, *probe;
} GradNormCore; /* no __dict__ of its own: grads.py's GradNormCollector, a subclass, has one */

#define GN_FIELDS(X) X(_buf) X(probe)

/* From _bind_grads(): the Python path, the tap (_TAP), the classes read here, torch's functions. */
static PyObject *gn_full = NULL, *gn_tap = NULL, *gn_probe_cls = NULL, *gn_state_cls = NULL, *gn_pending_cls = NULL;
static PyObject *gn_tensor_cls = NULL, *gn_foreach_norm = NULL, *gn_stack = NULL,
                *gn_capturing = NULL, *gn_copy_to_host = NULL, *gn_kw_dtype = NULL, *gn_two = NULL,
                *gn_s_item = NULL;
enum { OS_CALLS, OS_PARAMS, OS_SHAPE, OS_PLAIN, OS_FSDP1, OS_NORM_DTYPE, OS_SCALE_IN_DICT, OS_N };
static const char *os_names[OS_N] = {"calls", "params", "shape", "plain", "fsdp1", "norm_dtype", "scale_in_dict"};
static Py_ssize_t os_off[OS_N];
enum { PG_VALUES, PG_HOST, PG_EVENT, PG_SHARDED, PG_FROM_CLIP, PG_SKIPPED, PG_OPTIMIZER_ID, PG_DEVICE, PG_PER_TENSOR,
       PG_MANUAL, PG_N };
static const char *pg_names[PG_N] = {"values", "host", "event", "sharded", "from_clip", "skipped", "optimizer_id",
                                     "device", "per_tensor", "manual"};
static Py_ssize_t pg_off[PG_N];
static int gn_bound = 0; /* 1: everything above is bound and every offset is a plain slot */

#define SLOT(obj, off) (*(PyObject **)((char *)(obj) + (off)))

static PyObject *gn_fallback(GradNormCore *self, PyObject *optimizer) {
    if (gn_full == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "stepwatch.metrics._cmetrics: _bind_grads() was not called");
        return NULL;
    }
    return PyObject_CallFunctionObjArgs(gn_full, (PyObject *)self, optimizer, NULL);
}

/* GradNormProbe._probe(optimizer, None, st): the Python for a probed step the common path does
 * not take; its result appended as _PyGradNormCore.on_optimizer_step appends it. */
static PyObject *gn_probe_py(GradNormCore *self, PyObject *probe, PyObject *optimizer, PyObject *st) {
    PyObject *args[4] = {probe, optimizer, Py_None, st};
    PyObject *pending = PyObject_VectorcallMethod(s_probe_fn, args, 4 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    if (pending == NULL) return NULL;
    int rc = 0;
    if (pending != Py_None) {
        PyObject *r = PyObject_CallMethod(self->_buf, "append", "O", pending);
        rc = r == NULL ? -1 : 0;
        Py_XDECREF(r);
    }
    Py_DECREF(pending);
    if (rc < 0) return NULL;
    Py_RETURN_NONE;
}

/* 1: group["params"] is the list that pair (id, len) recorded, that long; 0: not; -1: an error. */
static int group_matches(PyObject *group, PyObject *pair) {
    if (!PyDict_CheckExact(group) || !PyTuple_CheckExact(pair) || PyTuple_GET_SIZE(pair) != 2 ||
        !PyLong_CheckExact(PyTuple_GET_ITEM(pair, 0)) || !PyLong_CheckExact(PyTuple_GET_ITEM(pair, 1)))
        return 0;
    PyObject *ps = PyDict_GetItemWithError(group, s_params); /* borrowed */
    if (ps == NULL) return PyErr_Occurred() ? -1 : 0;
    if (!PyList_CheckExact(ps)) return 0;
    void *id = PyLong_AsVoidPtr(PyTuple_GET_ITEM(pair, 0));
    Py_ssize_t n = PyLong_AsSsize_t(PyTuple_GET_ITEM(pair, 1));
    if (PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    return id == (void *)ps && n == PyList_GET_SIZE(ps);
}

/* 1: st's recorded parameter list is optimizer's (_OptState.parameters would return it unchanged:
 * each group's list the same object and length; one group's recorded as its (id, len) pair, several
 * as a tuple of them); 0: not, or not known here; -1: an error. Several groups are the common AdamW
 * recipe (decay and no-decay): they took the Python every step, a call per parameter tensor. */
static int same_params(PyObject *optimizer, PyObject *st) {
    PyObject *groups = PyObject_GetAttr(optimizer, s_param_groups);
    if (groups == NULL) return -1;
    int same = 0;
    PyObject *shape = SLOT(st, os_off[OS_SHAPE]);
    if (PyList_CheckExact(groups) && shape != NULL && PyTuple_CheckExact(shape)) {
        Py_ssize_t ng = PyList_GET_SIZE(groups);
        if (ng == 1) {
            same = group_matches(PyList_GET_ITEM(groups, 0), shape);
        } else if (ng > 1 && PyTuple_GET_SIZE(shape) == ng) {
            same = 1;
            for (Py_ssize_t i = 0; i < ng && same == 1; i++)
                same = group_matches(PyList_GET_ITEM(groups, i), PyTuple_GET_ITEM(shape, i));
        }
    }
    Py_DECREF(groups);
    return same;
}

/* optimizer.__dict__.get("grad_scale") is None: 1, 0 (a scale, or no plain __dict__), -1. */
static int no_scale(PyObject *optimizer) {
    PyObject *d = PyObject_GetAttr(optimizer, s_dict);
    if (d == NULL) return -1;
    int r = 0;
    if (PyDict_CheckExact(d)) {
        PyObject *v = PyDict_GetItemWithError(d, s_grad_scale);
        r = v == NULL ? (PyErr_Occurred() ? -1 : 1) : v == Py_None;
    }
    Py_DECREF(d);
    return r;
}

static int is_torch_error(void) {
    return PyErr_ExceptionMatches(PyExc_RuntimeError) || PyErr_ExceptionMatches(PyExc_NotImplementedError) ||
           PyErr_ExceptionMatches(PyExc_TypeError);
}

static PyObject *GradNorm_on_optimizer_step(GradNormCore *self, PyObject *optimizer) {
    if (!gn_bound || self->_buf == NULL || self->probe == NULL || !PyList_CheckExact(self->_buf) ||
        Py_TYPE(self->probe) != (PyTypeObject *)gn_probe_cls)
        return gn_fallback(self, optimizer);
    /* _TAP.take_clip(optimizer) is None without a look at the thread's state until any thread has
     * clipped or stepped a GradScaler; from then on, the Python */
    int t = attr_truth(gn_tap, s_used);
    if (t != 0) return t < 0 ? NULL : gn_fallback(self, optimizer);
    PyObject *probe = self->probe;
    /* probe._opt_state(optimizer): its shortcut, the last optimizer's state */
    PyObject *last = PyObject_GetAttr(probe, s_last);
    if (last == NULL) return NULL;
    PyObject *st = NULL;
    if (PyTuple_CheckExact(last) && PyTuple_GET_SIZE(last) == 2) {
        PyObject *opt = deref(PyTuple_GET_ITEM(last, 0));
        if (opt == optimizer) st = deref(PyTuple_GET_ITEM(last, 1));
        Py_XDECREF(opt);
    }
    Py_DECREF(last);
    if (st == NULL || Py_TYPE(st) != (PyTypeObject *)gn_state_cls) {
        Py_XDECREF(st);
        return gn_fallback(self, optimizer);
    }
    /* The attribute reads first (they could run Python); st's slots are read after them. */
    int same = same_params(optimizer, st);
    if (same < 0) goto error;
    int unscaled = SLOT(st, os_off[OS_SCALE_IN_DICT]) == Py_True ? no_scale(optimizer) : 0;
    if (unscaled < 0) goto error;
    PyObject *every = PyObject_GetAttr(probe, s_every);
    if (every == NULL) goto error;
    Py_ssize_t each = PyLong_CheckExact(every) ? PyLong_AsSsize_t(every) : -1;
    Py_DECREF(every);
    PyObject *calls = SLOT(st, os_off[OS_CALLS]), *params = SLOT(st, os_off[OS_PARAMS]);
    PyObject *norm_dtype = SLOT(st, os_off[OS_NORM_DTYPE]);
    Py_ssize_t n = calls != NULL && PyLong_CheckExact(calls) ? PyLong_AsSsize_t(calls) : -1;
    if ((n == -1 || each == -1) && PyErr_Occurred()) PyErr_Clear();
    int plain = SLOT(st, os_off[OS_PLAIN]) == Py_True && SLOT(st, os_off[OS_FSDP1]) == Py_False;
    if (!same || !unscaled || !plain || params == NULL || !PyList_CheckExact(params) || PyList_GET_SIZE(params) == 0 ||
        norm_dtype == NULL || norm_dtype == Py_None || n < 0 || n == PY_SSIZE_T_MAX || each < 1) {
        Py_DECREF(st);
        return gn_fallback(self, optimizer);
    }
    /* every: probe one optimizer step in N (counted here, as on_optimizer_step counts) */
    PyObject *next = PyLong_FromSsize_t(n + 1);
    if (next == NULL) goto error;
    Py_SETREF(SLOT(st, os_off[OS_CALLS]), next);
    if (n % each) {
        Py_DECREF(st);
        Py_RETURN_NONE;
    }
    /* _probe: a step being captured into a CUDA graph is not probed */
    Py_INCREF(params); /* st's list may be replaced by a callback below */
    int cuda = tensor_attr_truth(PyList_GET_ITEM(params, 0), A_IS_CUDA);
    if (cuda < 0) goto error_params;
    if (cuda && (t = call_truth(gn_capturing)) != 0) {
        Py_DECREF(params);
        Py_DECREF(st);
        if (t < 0) return NULL;
        Py_RETURN_NONE;
    }
    /* _compute_plain: [g for p in params if (g := p.grad) is not None] */
    Py_ssize_t np = PyList_GET_SIZE(params);
    PyObject *grads = PyList_New(0);
    if (grads == NULL) goto error_params;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(params) && i < np; i++) {
        PyObject *g = tensor_attr(PyList_GET_ITEM(params, i), A_GRAD);
        if (g == NULL) goto error_grads;
        int rc = g == Py_None ? 0 : PyList_Append(grads, g);
        Py_DECREF(g);
        if (rc < 0) goto error_grads;
    }
    Py_DECREF(params);
    params = NULL;
    if (PyList_GET_SIZE(grads) == 0) { /* no grad: no probe */
        Py_DECREF(grads);
        Py_DECREF(st);
        Py_RETURN_NONE;
    }
    if (Py_TYPE(PyList_GET_ITEM(grads, 0)) != (PyTypeObject *)gn_tensor_cls) { /* a DTensor, or any subclass */
        Py_DECREF(grads);
        PyObject *r = gn_probe_py(self, probe, optimizer, st);
        Py_DECREF(st);
        return r;
    }
    /* stack(_foreach_norm(grads, 2.0, dtype=st.norm_dtype)): each grad's norm, float32 (float64 for
     * float64 grads; read again: the grads' reads above could have run Python that replaced it);
     * their root sum of squares is taken where the background thread reads them (per_tensor) */
    norm_dtype = SLOT(st, os_off[OS_NORM_DTYPE]);
    if (norm_dtype == NULL || norm_dtype == Py_None) {
        Py_DECREF(grads);
        PyObject *r = gn_probe_py(self, probe, optimizer, st);
        Py_DECREF(st);
        return r;
    }
    /* CPU grads: their norms read at once, as Python floats (each one's item(): no tensor
     * outlives the step; _compute_plain says why) */
    int cpu = tensor_attr_truth(PyList_GET_ITEM(grads, 0), A_IS_CPU);
    if (cpu < 0) {
        Py_DECREF(grads);
        goto error;
    }
    Py_INCREF(norm_dtype);
    PyObject *fargs[3] = {grads, gn_two, norm_dtype};
    PyObject *norms = PyObject_Vectorcall(gn_foreach_norm, fargs, 2, gn_kw_dtype);
    Py_DECREF(norm_dtype);
    Py_DECREF(grads);
    PyObject *values = NULL;
    if (norms != NULL && cpu && PyTuple_CheckExact(norms)) {
        /* a list of floats, untracked: it refers to no object */
        Py_ssize_t k = PyTuple_GET_SIZE(norms);
        values = PyList_New(k);
        for (Py_ssize_t i = 0; values != NULL && i < k; i++) {
            PyObject *x = PyObject_CallMethodNoArgs(PyTuple_GET_ITEM(norms, i), gn_s_item);
            if (x == NULL) Py_CLEAR(values);
            else PyList_SET_ITEM(values, i, x);
        }
        Py_DECREF(norms);
        if (values != NULL) untrack(values);
    } else if (norms != NULL) {
        values = PyObject_CallOneArg(gn_stack, norms);
        Py_DECREF(norms);
    }
    if (values == NULL) {
        if (!is_torch_error()) goto error;
        /* a sparse grad, grads on several devices: _probe's own try marks the optimizer not
         * plain and takes the general path */
        PyErr_Clear();
        PyObject *r = gn_probe_py(self, probe, optimizer, st);
        Py_DECREF(st);
        return r;
    }
    Py_DECREF(st);
    /* PendingGradNorm(values, host, event, False, False, False, id(optimizer), device, True, False), filled as
     * its __init__ fills it; a value on the GPU is copied to the host without blocking (the
     * values' device, as _probe asks it: the first parameter's may differ) */
    PyObject *host = Py_None, *event = Py_None, *device = NULL, *hed = NULL;
    int on_gpu = PyList_CheckExact(values) ? 0 : tensor_attr_truth(values, A_IS_CUDA);
    if (on_gpu < 0) {
        Py_DECREF(values);
        return NULL;
    }
    if (on_gpu) {
        hed = PyObject_CallOneArg(gn_copy_to_host, values);
        if (hed == NULL || !PyTuple_Check(hed) || PyTuple_GET_SIZE(hed) != 3) {
            if (hed != NULL) PyErr_SetString(PyExc_TypeError, "copy_to_host must return (host, event, device)");
            Py_XDECREF(hed);
            Py_DECREF(values);
            return NULL;
        }
        host = PyTuple_GET_ITEM(hed, 0);
        event = PyTuple_GET_ITEM(hed, 1);
        device = Py_NewRef(PyTuple_GET_ITEM(hed, 2));
    } else {
        device = PyLong_FromLong(-1);
    }
    PyObject *oid = PyLong_FromVoidPtr(optimizer);
    PyTypeObject *tp = (PyTypeObject *)gn_pending_cls;
    PyObject *pending = oid == NULL || device == NULL ? NULL : tp->tp_alloc(tp, 0);
    if (pending == NULL) {
        Py_XDECREF(oid);
        Py_XDECREF(device);
        Py_XDECREF(hed);
        Py_DECREF(values);
        return NULL;
    }
    SLOT(pending, pg_off[PG_VALUES]) = values;
    SLOT(pending, pg_off[PG_HOST]) = Py_NewRef(host);
    SLOT(pending, pg_off[PG_EVENT]) = Py_NewRef(event);
    SLOT(pending, pg_off[PG_SHARDED]) = Py_NewRef(Py_False);
    SLOT(pending, pg_off[PG_FROM_CLIP]) = Py_NewRef(Py_False);
    SLOT(pending, pg_off[PG_SKIPPED]) = Py_NewRef(Py_False);
    SLOT(pending, pg_off[PG_OPTIMIZER_ID]) = oid;
    SLOT(pending, pg_off[PG_DEVICE]) = device;
    SLOT(pending, pg_off[PG_PER_TENSOR]) = Py_NewRef(Py_True);
    SLOT(pending, pg_off[PG_MANUAL]) = Py_NewRef(Py_False);
    Py_XDECREF(hed);
    /* tensors and numbers: it cannot be part of a cycle, and it waits in the queue (the buffer
     * read again: the torch calls above could have run Python that replaced it) */
    int rc;
    if (self->_buf != NULL && PyList_CheckExact(self->_buf)) {
        rc = PyList_Append(self->_buf, untrack(pending));
    } else {
        PyObject *r = self->_buf == NULL ? unset("GradNormCollector", "_buf")
                                         : PyObject_CallMethod(self->_buf, "append", "O", untrack(pending));
        rc = r == NULL ? -1 : 0;
        Py_XDECREF(r);
    }
    Py_DECREF(pending);
    if (rc < 0) return NULL;
    Py_RETURN_NONE;

error_grads:
    Py_DECREF(grads);
error_params:
    Py_XDECREF(params);
error:
    Py_DECREF(st);
    return NULL;
}

/* _PyGradNormCore.take: the step's pending probes (None when there are none), a fresh list for
 * the next step; the list is untracked by the cyclic GC (its PendingGradNorms are too). */
static PyObject *GradNorm_take(GradNormCore *self, PyObject *unused) {
    PyObject *buf = self->_buf;
    if (buf == NULL) return unset("GradNormCollector", "_buf");
    int t = PyList_CheckExact(buf) ? PyList_GET_SIZE(buf) != 0 : PyObject_IsTrue(buf);
    if (t <= 0) {
        if (t < 0) return NULL;
        Py_RETURN_NONE;
    }
    PyObject *fresh = PyList_New(0);
    if (fresh == NULL) return NULL;
    self->_buf = fresh; /* the old list's reference passes to the caller */
    return untrack(buf);
}

static PyMethodDef GradNormCore_methods[] = {
    {"on_optimizer_step", (PyCFunction)GradNorm_on_optimizer_step, METH_O,
     "on_optimizer_step(optimizer): from the optimizer step pre-hook; queues the step's grad-norm probe."},
    {"take", (PyCFunction)GradNorm_take, METH_NOARGS, "take() -> list | None: the step's pending probes, at its end."},
    {NULL},
};

#define GN_MEMBER(f) MEMBER(GradNormCore, f)
static PyMemberDef GradNormCore_members[] = {GN_FIELDS(GN_MEMBER){NULL}};

OBJECT_TYPE(GradNormCore, GN_FIELDS, "stepwatch.metrics._cmetrics.GradNormCore",
            "The grad-norm collector's optimizer step, its common case (metrics/grads.py, in C).",
            {Py_tp_methods, GradNormCore_methods},)

/* -- module ---------------------------------------------------------------------------------- */

static PyObject *mod_bind(PyObject *m, PyObject *globals) {
    if (!PyDict_Check(globals)) {
        PyErr_SetString(PyExc_TypeError, "_bind(globals): metrics/flops.py's globals() dict");
        return NULL;
    }
    Py_XSETREF(flops_globals, Py_NewRef(globals));
    Py_RETURN_NONE;
}

static PyObject *mod_bind_take(PyObject *m, PyObject *const *args, Py_ssize_t n) {
    if (n != 2 || !PyType_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "_bind_take(StepThroughput, unset)");
        return NULL;
    }
    PyTypeObject *tp = (PyTypeObject *)args[0];
    Py_XSETREF(step_cls, Py_NewRef(args[0]));
    Py_XSETREF(unset_marker, Py_NewRef(args[1]));
    st_items_off = plain_slot_offset(tp, "items");
    st_flops_off = plain_slot_offset(tp, "_flops");
    /* allocated here only while __init__ is the one that stores (items, _UNSET) in those slots */
    if (st_flops_off < 0) st_items_off = -1;
    return PyBool_FromLong(st_items_off >= 0);
}

static int gn_py_bound = 0, gn_torch_bound = 0;

/* _bind_grads(full, tap, GradNormProbe, _OptState, PendingGradNorm): at grads.py's import. True when
 * both classes keep their fields in plain slots (otherwise every step takes the Python). */
static PyObject *mod_bind_grads(PyObject *m, PyObject *const *args, Py_ssize_t n) {
    if (n != 5 || !PyCallable_Check(args[0]) || !PyType_Check(args[2]) || !PyType_Check(args[3]) ||
        !PyType_Check(args[4])) {
        PyErr_SetString(PyExc_TypeError, "_bind_grads(full, tap, GradNormProbe, _OptState, PendingGradNorm)");
        return NULL;
    }
    Py_XSETREF(gn_full, Py_NewRef(args[0]));
    Py_XSETREF(gn_tap, Py_NewRef(args[1]));
    Py_XSETREF(gn_probe_cls, Py_NewRef(args[2]));
    Py_XSETREF(gn_state_cls, Py_NewRef(args[3]));
    Py_XSETREF(gn_pending_cls, Py_NewRef(args[4]));
    int ok = 1;
    for (int i = 0; i < OS_N; i++) ok &= (os_off[i] = plain_slot_offset((PyTypeObject *)args[3], os_names[i])) >= 0;
    for (int i = 0; i < PG_N; i++) ok &= (pg_off[i] = plain_slot_offset((PyTypeObject *)args[4], pg_names[i])) >= 0;
    gn_py_bound = ok;
    gn_bound = gn_py_bound && gn_torch_bound;
    return PyBool_FromLong(ok);
}

/* _bind_grads_torch(torch.Tensor, torch._foreach_norm, torch.stack,
 * torch.cuda.is_current_stream_capturing, copy_to_host): once torch is imported. */
static PyObject *mod_bind_grads_torch(PyObject *m, PyObject *const *args, Py_ssize_t n) {
    if (n != 5 || !PyType_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "_bind_grads_torch(Tensor, _foreach_norm, stack, "
                                         "is_current_stream_capturing, copy_to_host)");
        return NULL;
    }
    if (gn_kw_dtype == NULL && (gn_kw_dtype = Py_BuildValue("(s)", "dtype")) == NULL) return NULL;
    if (gn_two == NULL && (gn_two = PyFloat_FromDouble(2.0)) == NULL) return NULL;
    if (gn_s_item == NULL && (gn_s_item = PyUnicode_InternFromString("item")) == NULL) return NULL;
    Py_XSETREF(gn_tensor_cls, Py_NewRef(args[0]));
    Py_XSETREF(gn_foreach_norm, Py_NewRef(args[1]));
    Py_XSETREF(gn_stack, Py_NewRef(args[2]));
    Py_XSETREF(gn_capturing, Py_NewRef(args[3]));
    Py_XSETREF(gn_copy_to_host, Py_NewRef(args[4]));
    gn_torch_bound = 1;
    gn_bound = gn_py_bound && gn_torch_bound;
    return PyBool_FromLong(gn_bound);
}

static PyMethodDef mod_methods[] = {
    {"_bind_grads", (PyCFunction)(void (*)(void))mod_bind_grads, METH_FASTCALL,
     "_bind_grads(full, tap, GradNormProbe, _OptState, PendingGradNorm) -> bool: whether the slots are plain."},
    {"_bind_grads_torch", (PyCFunction)(void (*)(void))mod_bind_grads_torch, METH_FASTCALL,
     "_bind_grads_torch(Tensor, _foreach_norm, stack, capturing, copy_to_host) -> bool."},
    {"_bind", mod_bind, METH_O, "_bind(globals): metrics/flops.py's globals (its _GETTERS and _state)."},
    {"_bind_take", (PyCFunction)(void (*)(void))mod_bind_take, METH_FASTCALL,
     "_bind_take(StepThroughput, unset) -> bool: the class take() builds; whether it fills its slots itself."},
    {NULL},
};

static struct PyModuleDef moddef = {PyModuleDef_HEAD_INIT, "stepwatch.metrics._cmetrics", NULL, -1, mod_methods};

PyMODINIT_FUNC PyInit__cmetrics(void) {
    INTERN(s_dtype, "dtype");
    INTERN(s_shape, "shape");
    INTERN(s_requires_grad, "requires_grad");
    INTERN(s_is_cuda, "is_cuda");
    INTERN(s_is_cpu, "is_cpu");
    INTERN(s_active, "active");
    INTERN(s_mine, "mine");
    INTERN(s_matches, "matches");
    INTERN(s_on_forward_full, "_on_forward_full");
    INTERN(s_training, "training");
    INTERN(s_batch_counts, "_batch_counts");
    INTERN(s_getters_var, "_GETTERS");
    INTERN(s_getters_fn, "_getters");
    INTERN(s_state_fn, "_state");
    INTERN(s_grad, "grad");
    INTERN(s_used, "used");
    INTERN(s_last, "_last");
    INTERN(s_every, "every");
    INTERN(s_param_groups, "param_groups");
    INTERN(s_params, "params");
    INTERN(s_dict, "__dict__");
    INTERN(s_grad_scale, "grad_scale");
    INTERN(s_probe_fn, "_probe");
    PyObject *m = PyModule_Create(&moddef);
    if (m == NULL) return NULL;
    if (add_type(m, &SigCore_spec, "SigCore", &SigCore_type) < 0 ||
        add_type(m, &ThroughputCore_spec, "ThroughputCore", NULL) < 0 ||
        add_type(m, &GradNormCore_spec, "GradNormCore", NULL) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

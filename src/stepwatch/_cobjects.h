/* What stepwatch's C accelerators (hooks/_ctracker.c, metrics/_cmetrics.c, _speedups.c) share: the
 * boilerplate of a heap type whose fields are all objects and of a module's init (names, types),
 * one attribute read, a weak reference's referent, a call's positional arguments, where a Python
 * class keeps a slot, untracking from the cyclic GC, and record.py's RawStep slots. Included after <Python.h> and <structmember.h>; everything here is
 * static, so each extension has its own copy. */
#ifndef STEPWATCH_COBJECTS_H
#define STEPWATCH_COBJECTS_H

/* traverse, clear and dealloc of a heap type whose fields are all objects (FIELDS_OF(X) lists them). */
#define VISIT_FIELD(f) Py_VISIT(self->f);
#define CLEAR_FIELD(f) Py_CLEAR(self->f);
#define GC_FUNCTIONS(Type, FIELDS_OF)                                                                  \
    static int Type##_traverse(Type *self, visitproc visit, void *arg) {                               \
        FIELDS_OF(VISIT_FIELD)                                                                         \
        Py_VISIT(Py_TYPE(self));                                                                       \
        return 0;                                                                                      \
    }                                                                                                  \
    static int Type##_clear(Type *self) {                                                              \
        FIELDS_OF(CLEAR_FIELD)                                                                         \
        return 0;                                                                                      \
    }                                                                                                  \
    static void Type##_dealloc(Type *self) {                                                           \
        PyTypeObject *tp = Py_TYPE(self);                                                              \
        PyObject_GC_UnTrack(self);                                                                     \
        Type##_clear(self);                                                                            \
        tp->tp_free((PyObject *)self);                                                                 \
        Py_DECREF(tp);                                                                                 \
    }

/* A heap type whose fields are all objects: its GC functions, slots and spec. Type##_members must
 * be defined; the variadic part holds its other slots (methods, call), each `{Py_tp_..., ...},`. */
#define OBJECT_TYPE(Type, FIELDS_OF, QUALNAME, DOC, ...)                                               \
    GC_FUNCTIONS(Type, FIELDS_OF)                                                                      \
    static PyType_Slot Type##_slots[] = {                                                              \
        {Py_tp_doc, DOC},                                                                              \
        {Py_tp_members, Type##_members},                                                               \
        __VA_ARGS__{Py_tp_traverse, Type##_traverse},                                                  \
        {Py_tp_clear, Type##_clear},                                                                   \
        {Py_tp_dealloc, Type##_dealloc},                                                               \
        {Py_tp_new, PyType_GenericNew},                                                                \
        {0, NULL},                                                                                     \
    };                                                                                                 \
    static PyType_Spec Type##_spec = {                                                                 \
        QUALNAME, sizeof(Type), 0, Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,       \
        Type##_slots,                                                                                  \
    };

/* Python's `bool(obj.name)`: 1, 0, or -1 with an exception. */
static inline int attr_truth(PyObject *obj, PyObject *name) {
    PyObject *v = PyObject_GetAttr(obj, name);
    if (v == NULL) return -1;
    int r = v == Py_None ? 0 : PyObject_IsTrue(v);
    Py_DECREF(v);
    return r;
}

/* The offset of ``name`` in ``tp``'s instances when it is a plain, writable object slot (a
 * ``__slots__`` entry), so C may fill it as the class's __init__ would; -1 when it is not one. */
static inline Py_ssize_t plain_slot_offset(PyTypeObject *tp, const char *name) {
    PyObject *d = PyDict_GetItemString(tp->tp_dict, name); /* borrowed */
    if (d == NULL || !Py_IS_TYPE(d, &PyMemberDescr_Type)) return -1;
    PyMemberDef *md = ((PyMemberDescrObject *)d)->d_member;
    if (md->type != T_OBJECT_EX || (md->flags & READONLY)) return -1;
    return md->offset;
}

/* ``o``, no longer tracked by the cyclic GC when it was (a step's payload that cannot be part of
 * a reference cycle; see "The cyclic GC" in hooks/_ctracker.c). */
static inline PyObject *untrack(PyObject *o) {
    if (PyObject_IS_GC(o)) PyObject_GC_UnTrack(o);
    return o;
}

/* One interned name for the module's lookups; inside PyInit_*, which fails with NULL. */
#define INTERN(var, text)                                                                              \
    if ((var = PyUnicode_InternFromString(text)) == NULL) return NULL

/* The type of ``spec`` made and added to module ``m`` as ``name`` (and kept in *out when out is
 * not NULL): 0, or -1 with an exception. */
static inline int add_type(PyObject *m, PyType_Spec *spec, const char *name, PyTypeObject **out) {
    PyObject *t = PyType_FromSpec(spec);
    if (t == NULL) return -1;
    if (out != NULL) *out = (PyTypeObject *)Py_NewRef(t);
    if (PyModule_AddObject(m, name, t) < 0) {
        Py_DECREF(t);
        return -1;
    }
    return 0;
}

/* The referent of weak reference ``r`` when it is one and alive: a new reference, or NULL (no
 * exception) otherwise. */
static inline PyObject *deref(PyObject *r) {
    if (!PyWeakref_Check(r)) return NULL;
#if PY_VERSION_HEX >= 0x030D0000
    PyObject *o = NULL;
    if (PyWeakref_GetRef(r, &o) < 0) PyErr_Clear();
    return o;
#else
    PyObject *o = PyWeakref_GET_OBJECT(r);
    return o == Py_None ? NULL : Py_NewRef(o);
#endif
}

/* A tp_call's arguments as exactly ``n`` positional ones into out[0..n-1] (borrowed): 0, or -1
 * with the TypeError a Python function of n parameters would raise. */
static inline int positional(const char *name, PyObject *args, PyObject *kwargs, Py_ssize_t n, PyObject **out) {
    if (kwargs != NULL && PyDict_GET_SIZE(kwargs) != 0) {
        PyErr_Format(PyExc_TypeError, "%s() takes no keyword arguments", name);
        return -1;
    }
    if (PyTuple_GET_SIZE(args) != n) {
        PyErr_Format(PyExc_TypeError, "%s() takes %zd positional arguments (%zd given)", name, n,
                     PyTuple_GET_SIZE(args));
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) out[i] = PyTuple_GET_ITEM(args, i);
    return 0;
}

/* record.py's RawStep.__slots__, in its order: the record hooks/_ctracker.c builds and
 * _speedups.c decodes (a macro, so a file that does not use it has no unused array). */
#define RAWSTEP_SLOTS                                                                                  \
    "step", "t_end_ns", "step_ns", "data_ns", "forward_ns", "backward_ns", "optimizer_ns", "eval_ns",  \
        "checkpoint_ns", "phases", "scalars", "skipped", "mem_peak_bytes", "extras", "tail"
#define RAWSTEP_N 15

#endif

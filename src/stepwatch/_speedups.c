/* stepwatch._speedups: the records file's step line, filled in C (and, at the end, the
 * pipeline's enqueue for the training thread).
 *
 * exporters/records.py writes one JSON line per step: ~45 keys in a fixed order, most of them
 * null, a dozen numbers. Python's %-template for a shape of record costs ~3.8 us a line, mostly
 * in float reprs and building the argument tuple; this fills the same template. Measured on one
 * slow machine: 5.2 us a line with the scalars dict through json's encoder and every integer
 * through snprintf, 2.4 us with both written here (the wall-clock time through dtoa is the most
 * of what is left).
 * It is an accelerator only: records.py keeps the pure-Python template, takes it wherever this
 * module is missing, and takes it for any line this returns None for.
 *
 * fill(vals, spec, pieces, enc) -> str | None
 *   vals    tuple of the record's field values, in STEP_FIELDS order (N of them), or the
 *           StepRecord itself once bind_records (below) has bound its class: its slots are read
 *           in place
 *   spec    tuple of N: what field i must hold for this template to apply
 *             None              the value is None (its "null" is already in pieces[i])
 *             float / int       exactly that type: written as its repr (what json writes)
 *             dict              exactly a dict: "{}" when empty; written here when its keys
 *                               are plain ASCII strs and its values exact finite floats, ints,
 *                               bools or None (put_simple_dict); else enc(value)
 *             any other type    exactly that type: enc(value)
 *             a bool or str     exactly that value (a keyed field, already in pieces[i])
 *   pieces  tuple of N + 1 ASCII str: pieces[i] goes before field i's value, pieces[N] last
 *   enc     callable(value) -> ASCII str: json's encoder for one value (records.py _enc)
 * None when the record does not fit spec, a float is not finite (json writes "nan" there), an
 * enc result is not ASCII, or anything raised: the caller then takes its Python path, which
 * writes the same bytes or raises what dumps raises. No exception ever leaves fill.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <string.h>

#include "_cobjects.h"

typedef struct {
    char *buf;
    Py_ssize_t len, cap;
    char small[4096];
} Buf;

static void buf_init(Buf *b) {
    b->buf = b->small;
    b->len = 0;
    b->cap = (Py_ssize_t)sizeof b->small;
}

static int buf_put(Buf *b, const char *s, Py_ssize_t n) {
    if (b->len + n > b->cap) {
        Py_ssize_t cap = b->cap * 2;
        while (cap < b->len + n) cap *= 2;
        char *nb = b->buf == b->small ? PyMem_Malloc(cap) : PyMem_Realloc(b->buf, cap);
        if (!nb) return -1;
        if (b->buf == b->small) memcpy(nb, b->small, b->len);
        b->buf = nb;
        b->cap = cap;
    }
    memcpy(b->buf + b->len, s, n);
    b->len += n;
    return 0;
}

/* An ASCII str's bytes into b; -1 when it is not an ASCII str. */
static int buf_put_ascii(Buf *b, PyObject *s) {
    if (!PyUnicode_CheckExact(s) || !PyUnicode_IS_ASCII(s)) return -1;
    return buf_put(b, (const char *)PyUnicode_1BYTE_DATA(s), PyUnicode_GET_LENGTH(s));
}

static int put_enc(Buf *b, PyObject *enc, PyObject *v) {
    PyObject *s = PyObject_CallOneArg(enc, v);
    if (!s) return -1;
    int rc = buf_put_ascii(b, s);
    Py_DECREF(s);
    return rc;
}

/* x's decimal digits into s (no sign, no NUL); their count. snprintf's "%lld" cost more than
 * the rest of a duration's layout. */
static int u64_digits(char *s, unsigned long long x) {
    char t[24];
    int n = 0;
    do {
        t[n++] = (char)('0' + x % 10);
        x /= 10;
    } while (x);
    for (int i = 0; i < n; i++) s[i] = t[n - 1 - i];
    return n;
}

/* repr(d) for d = k / 10**p, k a positive integer, written from k's digits instead of by dtoa.
 * Two kinds of value in a line are such quotients (record.py): durations, ns / 1e9 (p = 9), and
 * the wall-clock time, whole microseconds / 1e6 (p = 6). Such a d is the double nearest
 * k * 10**-p (IEEE division is correctly rounded; k and 10**p are exact), so k's digits (less
 * trailing zeros) read back as d. They are also the shortest text that does, which is what repr
 * writes, when no other decimal of as many digits or fewer reads back as d:
 * - k < 10**15: distinct decimals of at most 15 significant digits are distinct doubles (DBL_DIG);
 * - p = 6 and 1e9 <= d < 2**33: every decimal of at most 16 significant digits near d is a
 *   multiple of 1e-6 (ten digits before the point), and two that read back as d are at most an
 *   ulp apart, 2**-20 < 1e-6 here: so they are the same one.
 * Only the layout is left to do, as float.__repr__ lays it out ('r' format: an exponent when the
 * point is >= 4 places left of the first digit or > 16 right of it, which these never are). 0 when
 * d is not such a value (dtoa writes it); -1 on error. */
static int put_decimal(Buf *b, double d, int p) {
    double scale;
    if (p == 9) {
        if (!(d > 0.0 && d < 1e6)) return 0;
        scale = 1e9;
    } else { /* p == 6 */
        if (!(d > 0.0 && d < 8589934592.0)) return 0; /* 2**33 */
        scale = 1e6;
    }
    /* d * scale is within 1.5 of k (each rounding costs half an ulp, and an ulp of k is up to 1 here):
     * the nearest integer, else one beside it. */
    long long k = llrint(d * scale);
    if ((double)k / scale != d) {
        if ((double)(k - 1) / scale == d) {
            k--;
        } else if ((double)(k + 1) / scale == d) {
            k++;
        } else {
            return 0;
        }
    }
    if (k <= 0 || (k >= 1000000000000000LL && !(p == 6 && d >= 1e9))) return 0;
    char digits[24];
    int nd = u64_digits(digits, (unsigned long long)k);
    int decpt = nd - p; /* value = 0.<digits> * 10**decpt */
    while (nd > 1 && digits[nd - 1] == '0') nd--;
    char s[48];
    int n = 0;
    if (decpt <= -4) { /* d.ddde-XX */
        s[n++] = digits[0];
        if (nd > 1) {
            s[n++] = '.';
            memcpy(s + n, digits + 1, nd - 1);
            n += nd - 1;
        }
        int e = 1 - decpt; /* 5..9 (decpt >= 1 - p): one digit, written as two as repr does */
        s[n++] = 'e';
        s[n++] = '-';
        s[n++] = (char)('0' + e / 10);
        s[n++] = (char)('0' + e % 10);
    } else if (decpt <= 0) { /* 0.000ddd */
        s[n++] = '0';
        s[n++] = '.';
        for (int i = 0; i < -decpt; i++) s[n++] = '0';
        memcpy(s + n, digits, nd);
        n += nd;
    } else if (decpt >= nd) { /* ddd000.0 */
        memcpy(s + n, digits, nd);
        n += nd;
        for (int i = nd; i < decpt; i++) s[n++] = '0';
        s[n++] = '.';
        s[n++] = '0';
    } else { /* ddd.ddd */
        memcpy(s + n, digits, decpt);
        n += decpt;
        s[n++] = '.';
        memcpy(s + n, digits + decpt, nd - decpt);
        n += nd - decpt;
    }
    return buf_put(b, s, n) == 0 ? 1 : -1;
}

/* float.__repr__ of a finite d (what json writes for an exact float): the duration's and the
 * wall time's fast paths, else dtoa. */
static int put_float(Buf *b, double d) {
    int got = put_decimal(b, d, 9);
    if (!got) got = put_decimal(b, d, 6);
    if (got) return got == 1 ? 0 : -1;
    char *s = PyOS_double_to_string(d, 'r', 0, Py_DTSF_ADD_DOT_0, NULL);
    if (!s) return -1;
    int rc = buf_put(b, s, (Py_ssize_t)strlen(s));
    PyMem_Free(s);
    return rc;
}

/* int.__repr__ of an exact int (json's too); 1 when it does not fit a long long (the caller
 * then takes its slower path), -1 on error. */
static int put_small_int(Buf *b, PyObject *v) {
    int overflow = 0;
    long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
    if (overflow) return 1;
    if (x == -1 && PyErr_Occurred()) return -1;
    char s[24];
    int n = 0;
    unsigned long long u = (unsigned long long)x;
    if (x < 0) {
        s[n++] = '-';
        u = 0ULL - u;
    }
    n += u64_digits(s + n, u);
    return buf_put(b, s, n);
}

/* A dict as json's encoder writes it (``{"k":v,...}``, records.py's separators) when every key
 * is a str json writes as it is (ASCII space..tilde, no quote or backslash) and every value an
 * exact finite float, int, bool or None: most scalars and phases dicts. 1 for any other dict (the
 * caller hands it to enc, which writes it or raises as dumps does), -1 on error. */
static int put_simple_dict(Buf *b, PyObject *v) {
    Py_ssize_t start = b->len, pos = 0;
    PyObject *k, *x;
    int rc = buf_put(b, "{", 1);
    int first = 1;
    while (rc == 0 && PyDict_Next(v, &pos, &k, &x)) {
        if (!PyUnicode_CheckExact(k) || !PyUnicode_IS_ASCII(k)) goto other;
        const char *ks = (const char *)PyUnicode_1BYTE_DATA(k);
        Py_ssize_t kn = PyUnicode_GET_LENGTH(k);
        for (Py_ssize_t i = 0; i < kn; i++) {
            char c = ks[i];
            if (c < ' ' || c > '~' || c == '"' || c == '\\') goto other;
        }
        if (!first && buf_put(b, ",", 1) < 0) return -1;
        first = 0;
        if (buf_put(b, "\"", 1) < 0 || buf_put(b, ks, kn) < 0 || buf_put(b, "\":", 2) < 0) return -1;
        PyTypeObject *t = Py_TYPE(x);
        if (t == &PyFloat_Type) {
            double d = PyFloat_AS_DOUBLE(x);
            if (!isfinite(d)) goto other;
            rc = put_float(b, d);
        } else if (t == &PyLong_Type) {
            rc = put_small_int(b, x);
            if (rc == 1) goto other;
        } else if (x == Py_True) {
            rc = buf_put(b, "true", 4);
        } else if (x == Py_False) {
            rc = buf_put(b, "false", 5);
        } else if (x == Py_None) {
            rc = buf_put(b, "null", 4);
        } else {
            goto other;
        }
    }
    if (rc < 0) return -1;
    return buf_put(b, "}", 1);
other:
    b->len = start; /* what was written of it is taken back */
    return 1;
}

/* One field's value as spec says; 1 when the record does not fit, -1 on error. */
static int put_value(Buf *b, PyObject *v, PyObject *want, PyObject *enc) {
    if (want == Py_None) return v == Py_None ? 0 : 1;
    if (!PyType_Check(want)) { /* a keyed literal: bool or str, already written */
        if (Py_TYPE(v) != Py_TYPE(want)) return 1;
        if (v == want) return 0;
        if (PyUnicode_CheckExact(v)) return PyUnicode_Compare(v, want) == 0 ? 0 : 1;
        return 1;
    }
    if ((PyObject *)Py_TYPE(v) != want) return 1;
    if (want == (PyObject *)&PyFloat_Type) {
        double d = PyFloat_AS_DOUBLE(v);
        if (!isfinite(d)) return 1;
        return put_float(b, d);
    }
    if (want == (PyObject *)&PyLong_Type) {
        int rc = put_small_int(b, v);
        if (rc != 1) return rc;
        PyObject *r = PyObject_Repr(v); /* int.__repr__; may raise past the digits limit */
        if (!r) return -1;
        rc = buf_put_ascii(b, r);
        Py_DECREF(r);
        return rc;
    }
    if (want == (PyObject *)&PyDict_Type) {
        if (PyDict_GET_SIZE(v) == 0) return buf_put(b, "{}", 2);
        int rc = put_simple_dict(b, v);
        if (rc != 1) return rc;
    }
    return put_enc(b, enc, v);
}

/* -- the record: RawStep.to_record in C ------------------------------------------------------ */

/* record.py's RawStep.to_record, for the background thread (one call a step): the StepRecord is
 * allocated and its slots filled here, as its dataclass __init__ would fill them, without the
 * ~46 stores of that __init__'s frame. bind_records(RawStep, StepRecord, names, defaults) checks once
 * that every field of both is a plain object slot and that StepRecord's fields past the 15
 * to_record gives have plain defaults (``defaults``: the tuple of those); until it has,
 * or when it declined, to_record returns None. to_record returns None too, before it has called
 * ``scalar`` (which counts), for anything it leaves to the Python method: another class, an
 * unset slot, a duration that is not an int of at most 63 bits, a checkpoint in the step (its
 * bytes and GB/s). Else the record, or the error ``scalar`` raised. */
static const char *const raw_names[] = {RAWSTEP_SLOTS};
/* Their indices (the same order). */
enum { R_STEP, R_T_END, R_STEP_NS, R_DATA, R_FWD, R_BWD, R_OPT, R_EVAL, R_CKPT, R_PHASES, R_SCALARS, R_SKIPPED,
       R_MEM, R_EXTRAS, R_TAIL, RAW_N };
_Static_assert(RAW_N == RAWSTEP_N, "one index per RawStep slot");
/* StepRecord's first fields, in its order: what to_record gives positionally. */
static const char *const rec_names[] = {"step",   "rank",    "time",      "step_s",   "data_wait_s",
                                        "forward_s", "backward_s", "optimizer_s", "other_s", "eval_s",
                                        "checkpoint_s", "phases", "scalars", "skipped", "mem_peak_bytes"};
#define REC_GIVEN 15
#define REC_MAX 128
static PyTypeObject *raw_type = NULL, *rec_type = NULL;
static Py_ssize_t raw_off[RAW_N], rec_off[REC_MAX], rec_n = 0, rec_tail = -1;
static PyObject *rec_defaults = NULL; /* tuple: the default of each field past REC_GIVEN */

/* bind_records(RawStep, StepRecord, names, defaults) -> bool: whether to_record builds records
 * itself. ``names``: every StepRecord field in order; ``defaults``: the default of each past the
 * first 15 (a plain value, shared by every record: None, a float, a str, a bool). */
static PyObject *bind_records(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    Py_CLEAR(raw_type);
    Py_CLEAR(rec_type);
    Py_CLEAR(rec_defaults);
    rec_n = 0;
    rec_tail = -1;
    if (nargs != 4 || !PyType_Check(args[0]) || !PyType_Check(args[1]) || !PyTuple_CheckExact(args[2]) ||
        !PyTuple_CheckExact(args[3])) {
        Py_RETURN_FALSE;
    }
    PyTypeObject *rt = (PyTypeObject *)args[0], *st = (PyTypeObject *)args[1];
    PyObject *names = args[2], *defaults = args[3];
    Py_ssize_t n = PyTuple_GET_SIZE(names);
    if (n <= REC_GIVEN || n > REC_MAX || PyTuple_GET_SIZE(defaults) != n - REC_GIVEN) Py_RETURN_FALSE;
    for (int i = 0; i < RAW_N; i++) {
        if ((raw_off[i] = plain_slot_offset(rt, raw_names[i])) < 0) Py_RETURN_FALSE;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *name = PyTuple_GET_ITEM(names, i);
        const char *s = PyUnicode_Check(name) ? PyUnicode_AsUTF8(name) : NULL;
        if (s == NULL) {
            PyErr_Clear();
            Py_RETURN_FALSE;
        }
        if (i < REC_GIVEN && strcmp(s, rec_names[i]) != 0) Py_RETURN_FALSE;
        if ((rec_off[i] = plain_slot_offset(st, s)) < 0) Py_RETURN_FALSE;
        if (strcmp(s, "tail") == 0) rec_tail = i;
    }
    if (rec_tail < 0) Py_RETURN_FALSE;
    raw_type = (PyTypeObject *)Py_NewRef(rt);
    rec_type = (PyTypeObject *)Py_NewRef(st);
    rec_defaults = Py_NewRef(defaults);
    rec_n = n;
    Py_RETURN_TRUE;
}

/* An exact int of at most 63 bits; 0 when ``v`` is not one. */
static int get_ns(PyObject *v, long long *out) {
    if (v == NULL || !PyLong_CheckExact(v)) return 0;
    int overflow = 0;
    *out = PyLong_AsLongLongAndOverflow(v, &overflow);
    if (overflow || (*out == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        return 0;
    }
    return 1;
}

#define RAW(r, i) (*(PyObject **)((char *)(r) + raw_off[i]))

/* {k: v / 1e9}, every v an int of at most 63 bits; NULL with no error set when one is not. */
static PyObject *phases_s(PyObject *phases) {
    PyObject *out = PyDict_New();
    if (out == NULL) return NULL;
    Py_ssize_t pos = 0;
    PyObject *k, *v;
    while (PyDict_Next(phases, &pos, &k, &v)) {
        long long ns;
        PyObject *f = NULL;
        if (!get_ns(v, &ns) || (f = PyFloat_FromDouble((double)ns / 1e9)) == NULL ||
            PyDict_SetItem(out, k, f) < 0) {
            Py_XDECREF(f);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(f);
    }
    return out;
}

/* Steals ``value``; the slot is empty (tp_alloc zeroes) or holds what an earlier SET put there. */
static void set_slot(PyObject *obj, Py_ssize_t off, PyObject *value) {
    PyObject **slot = (PyObject **)((char *)obj + off);
    Py_XSETREF(*slot, value);
}

static PyObject *to_record(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (rec_type == NULL || nargs != 5 || !Py_IS_TYPE(args[0], raw_type) || !PyFloat_CheckExact(args[2])) {
        Py_RETURN_NONE;
    }
    PyObject *raw = args[0], *rank = args[1], *scalar = args[4];
    double wall_ref = PyFloat_AS_DOUBLE(args[2]);
    long long perf_ref, t_end, step_ns, data, fwd, bwd, opt, eval, ckpt, other;
    if (!get_ns(args[3], &perf_ref) || !get_ns(RAW(raw, R_T_END), &t_end) || !get_ns(RAW(raw, R_STEP_NS), &step_ns) ||
        !get_ns(RAW(raw, R_DATA), &data) || !get_ns(RAW(raw, R_FWD), &fwd) || !get_ns(RAW(raw, R_BWD), &bwd) ||
        !get_ns(RAW(raw, R_OPT), &opt) || !get_ns(RAW(raw, R_EVAL), &eval) || !get_ns(RAW(raw, R_CKPT), &ckpt) ||
        ckpt != 0) {
        Py_RETURN_NONE;
    }
    long long since;
    if (__builtin_sub_overflow(step_ns, data, &other) || __builtin_sub_overflow(other, fwd, &other) ||
        __builtin_sub_overflow(other, bwd, &other) || __builtin_sub_overflow(other, opt, &other) ||
        __builtin_sub_overflow(t_end, perf_ref, &since)) {
        Py_RETURN_NONE;
    }
    if (other < 0) other = 0;
    /* The wall time, whole microseconds (record.py's to_record, its floor division too); the
     * Python method for a reference outside 0..2**53 us. */
    double ref_us = floor(wall_ref * 1e6);
    if (!(ref_us >= 0.0 && ref_us < 9007199254740992.0)) Py_RETURN_NONE;
    long long since_us = since / 1000;
    if (since % 1000 < 0) since_us--;
    long long wall_us = (long long)ref_us + since_us;
    PyObject *step = RAW(raw, R_STEP), *phases = RAW(raw, R_PHASES), *scalars = RAW(raw, R_SCALARS);
    PyObject *skipped = RAW(raw, R_SKIPPED), *mem = RAW(raw, R_MEM), *tail = RAW(raw, R_TAIL);
    if (step == NULL || skipped == NULL || mem == NULL || tail == NULL || RAW(raw, R_EXTRAS) == NULL ||
        phases == NULL || (phases != Py_None && !PyDict_CheckExact(phases)) || scalars == NULL ||
        !PyDict_CheckExact(scalars)) {
        Py_RETURN_NONE;
    }
    int is_tail = PyObject_IsTrue(tail);
    if (is_tail < 0) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    PyObject *ph = phases != Py_None && PyDict_GET_SIZE(phases) ? phases_s(phases) : PyDict_New(); /* None: no phase ran */
    if (ph == NULL) {
        if (PyErr_Occurred()) return NULL;
        Py_RETURN_NONE; /* a phase that is not an int: the Python method's division */
    }
    /* From here on nothing is left to the Python method: ``scalar`` counts what it converts. */
    PyObject *sc = PyDict_New();
    if (sc == NULL) goto error;
    Py_ssize_t pos = 0;
    PyObject *k, *v;
    while (PyDict_Next(scalars, &pos, &k, &v)) {
        PyObject *f;
        if (PyFloat_CheckExact(v)) {
            f = Py_NewRef(v);
        } else {
            PyObject *a[2] = {k, v};
            Py_INCREF(k);
            Py_INCREF(v); /* the dict may change under the call */
            f = PyObject_Vectorcall(scalar, a, 2, NULL);
            Py_DECREF(k);
            Py_DECREF(v);
            if (f == NULL) goto error;
        }
        int rc = PyDict_SetItem(sc, k, f);
        Py_DECREF(f);
        if (rc < 0) goto error;
    }
    double d[9] = {(double)wall_us / 1e6, (double)step_ns / 1e9, (double)data / 1e9, (double)fwd / 1e9,
                   (double)bwd / 1e9, (double)opt / 1e9, (double)other / 1e9, (double)eval / 1e9, 0.0};
    PyObject *rec = rec_type->tp_alloc(rec_type, 0);
    if (rec == NULL) goto error;
#define SET(i, value) set_slot(rec, rec_off[i], (value))
    SET(0, Py_NewRef(step));
    SET(1, Py_NewRef(rank));
    for (int i = 0; i < 9; i++) {
        PyObject *f = PyFloat_FromDouble(d[i]);
        if (f == NULL) {
            Py_DECREF(rec);
            goto error;
        }
        SET(2 + i, f);
    }
    SET(11, ph);
    SET(12, sc);
    SET(13, Py_NewRef(skipped));
    SET(14, Py_NewRef(mem));
    for (Py_ssize_t i = REC_GIVEN; i < rec_n; i++) SET(i, Py_NewRef(PyTuple_GET_ITEM(rec_defaults, i - REC_GIVEN)));
    if (is_tail) SET(rec_tail, Py_NewRef(Py_True));
#undef SET
    return rec;
error:
    Py_DECREF(ph);
    Py_XDECREF(sc);
    return NULL;
}

static PyObject *fill(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 4 || !PyTuple_CheckExact(args[1]) || !PyTuple_CheckExact(args[2])) Py_RETURN_NONE;
    PyObject *vals = args[0], *spec = args[1], *pieces = args[2], *enc = args[3];
    /* The record itself, its slots read in place (no tuple of its 46 values), or that tuple. */
    int direct = rec_type != NULL && Py_IS_TYPE(vals, rec_type);
    if (!direct && !PyTuple_CheckExact(vals)) Py_RETURN_NONE;
    Py_ssize_t n = direct ? rec_n : PyTuple_GET_SIZE(vals);
    if (PyTuple_GET_SIZE(spec) != n || PyTuple_GET_SIZE(pieces) != n + 1) Py_RETURN_NONE;
    Buf b;
    buf_init(&b);
    int rc = 0;
    for (Py_ssize_t i = 0; i < n && rc == 0; i++) {
        rc = buf_put_ascii(&b, PyTuple_GET_ITEM(pieces, i));
        if (rc != 0) break;
        PyObject *v = direct ? *(PyObject **)((char *)vals + rec_off[i]) : PyTuple_GET_ITEM(vals, i);
        if (v == NULL) { /* an unset slot: the Python path says what is wrong */
            rc = 1;
            break;
        }
        Py_INCREF(v); /* enc runs Python code: the slot may change meanwhile */
        rc = put_value(&b, v, PyTuple_GET_ITEM(spec, i), enc);
        Py_DECREF(v);
    }
    if (rc == 0) rc = buf_put_ascii(&b, PyTuple_GET_ITEM(pieces, n));
    PyObject *out = NULL;
    if (rc == 0) {
        out = PyUnicode_New(b.len, 127);
        if (out) memcpy(PyUnicode_1BYTE_DATA(out), b.buf, b.len);
    }
    if (b.buf != b.small) PyMem_Free(b.buf);
    if (!out) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    return out;
}

/* decimal_repr(d, p) -> str | None: what fill writes for a float that is k / 10**p (p: 9 or 6;
 * tests), None for any other (fill hands those to dtoa, float.__repr__'s own). */
static PyObject *decimal_repr(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "decimal_repr(d, p) takes two arguments");
        return NULL;
    }
    double d = PyFloat_AsDouble(args[0]);
    if (d == -1.0 && PyErr_Occurred()) return NULL;
    long p = PyLong_AsLong(args[1]);
    if (p == -1 && PyErr_Occurred()) return NULL;
    if (p != 9 && p != 6) {
        PyErr_Format(PyExc_ValueError, "decimal_repr: p must be 9 or 6, got %ld", p);
        return NULL;
    }
    Buf b;
    buf_init(&b);
    int rc = put_decimal(&b, d, (int)p);
    if (rc == 0) Py_RETURN_NONE;
    if (rc < 0) return PyErr_NoMemory();
    return PyUnicode_FromStringAndSize(b.buf, b.len);
}

/* -- the pipeline's queue, from the training thread (_pipeline.py's Pipeline.enqueue, in C) ----
 *
 * Enqueue() with pipeline, queue (its _queue, a deque) and cap (its _cap) set: called with each
 * step's RawStep by the tracker at the step's end. The same steps as Pipeline.enqueue, without
 * its Python frame a step: append while the queue holds fewer than cap, wake the pipeline's
 * thread once while it has not opened its exporters (_wake_first), count a drop otherwise. */

typedef struct {
    PyObject_HEAD
    PyObject *pipeline, *queue, *cap;
} Enqueue;

#define ENQ_FIELDS(X) X(pipeline) X(queue) X(cap)

static PyObject *s_append, *s_wake_first, *s_wake, *s_set, *s_dropped;

static PyObject *Enqueue_call(Enqueue *self, PyObject *args, PyObject *kwargs) {
    PyObject *raw;
    if (positional("Enqueue", args, kwargs, 1, &raw) < 0) return NULL;
    if (self->pipeline == NULL || self->queue == NULL || self->cap == NULL) {
        PyErr_SetString(PyExc_AttributeError, "Enqueue: pipeline, queue and cap must be set");
        return NULL;
    }
    Py_ssize_t n = PyObject_Size(self->queue);
    if (n < 0) return NULL;
    PyObject *more = PyLong_FromSsize_t(n);
    if (more == NULL) return NULL;
    int room = PyObject_RichCompareBool(more, self->cap, Py_LT);
    Py_DECREF(more);
    if (room < 0) return NULL;
    if (room) {
        PyObject *r = PyObject_CallMethodOneArg(self->queue, s_append, raw);
        if (r == NULL) return NULL;
        Py_DECREF(r);
        PyObject *first = PyObject_GetAttr(self->pipeline, s_wake_first);
        if (first == NULL) return NULL;
        int t = PyObject_IsTrue(first);
        Py_DECREF(first);
        if (t < 0) return NULL;
        if (t) {
            if (PyObject_SetAttr(self->pipeline, s_wake_first, Py_False) < 0) return NULL;
            PyObject *wake = PyObject_GetAttr(self->pipeline, s_wake);
            if (wake == NULL) return NULL;
            r = PyObject_CallMethodNoArgs(wake, s_set);
            Py_DECREF(wake);
            if (r == NULL) return NULL;
            Py_DECREF(r);
        }
        Py_RETURN_NONE;
    }
    PyObject *d = PyObject_GetAttr(self->pipeline, s_dropped);
    if (d == NULL) return NULL;
    PyObject *one = PyLong_FromLong(1);
    PyObject *d1 = one == NULL ? NULL : PyNumber_InPlaceAdd(d, one);
    Py_XDECREF(one);
    Py_DECREF(d);
    if (d1 == NULL) return NULL;
    int rc = PyObject_SetAttr(self->pipeline, s_dropped, d1);
    Py_DECREF(d1);
    if (rc < 0) return NULL;
    Py_RETURN_NONE;
}

#define ENQ_MEMBER(f) {#f, T_OBJECT_EX, offsetof(Enqueue, f), 0, NULL},
static PyMemberDef Enqueue_members[] = {ENQ_FIELDS(ENQ_MEMBER){NULL}};

OBJECT_TYPE(Enqueue, ENQ_FIELDS, "stepwatch._speedups.Enqueue",
            "Pipeline.enqueue in C, for the training thread (see the module's source).",
            {Py_tp_call, Enqueue_call},)

/* -- a collector read every n-th step (memory/probe.py: MemoryProbe.take's countdown, in C) ----
 *
 * The step tracker calls each collector's take() at every step end. Every.take() returns None
 * at most of them without a Python frame, and calls read() at every `every`-th one (the first
 * step end included, as _left starts at 1). */

typedef struct {
    PyObject_HEAD
    PyObject *name, *read, *every;
    long long left;
} Every;

#define EVERY_FIELDS(X) X(name) X(read) X(every)

static PyObject *Every_take(Every *self, PyObject *unused) {
    if (--self->left > 0) Py_RETURN_NONE;
    if (self->every == NULL || self->read == NULL) {
        PyErr_SetString(PyExc_AttributeError, "Every: 'every' and 'read' must be set");
        return NULL;
    }
    long long n = PyLong_AsLongLong(self->every);
    if (n == -1 && PyErr_Occurred()) return NULL;
    self->left = n;
    return PyObject_CallNoArgs(self->read);
}

static PyMethodDef Every_methods[] = {
    {"take", (PyCFunction)Every_take, METH_NOARGS, "None, or read() at every `every`-th call."},
    {NULL, NULL, 0, NULL},
};

#define EVERY_MEMBER(f) {#f, T_OBJECT_EX, offsetof(Every, f), 0, NULL},
static PyMemberDef Every_members[] = {EVERY_FIELDS(EVERY_MEMBER){"_left", T_LONGLONG, offsetof(Every, left), 0, NULL},
                                      {NULL}};

OBJECT_TYPE(Every, EVERY_FIELDS, "stepwatch._speedups.Every",
            "A collector whose take() calls read() at every `every`-th step end (memory/probe.py).",
            {Py_tp_methods, Every_methods},)

static PyMethodDef methods[] = {
    {"decimal_repr", (PyCFunction)(void (*)(void))decimal_repr, METH_FASTCALL,
     "decimal_repr(d, p) -> str | None: fill's repr of a float that is k / 10**p (p: 9 or 6), else None (tests)."},
    {"fill", (PyCFunction)(void (*)(void))fill, METH_FASTCALL,
     "fill(vals, spec, pieces, enc) -> str | None: one step line (see the module's source)."},
    {"bind_records", (PyCFunction)(void (*)(void))bind_records, METH_FASTCALL,
     "bind_records(RawStep, StepRecord, names, defaults) -> bool: whether to_record builds records itself."},
    {"to_record", (PyCFunction)(void (*)(void))to_record, METH_FASTCALL,
     "to_record(raw, rank, wall_ref, perf_ref_ns, scalar) -> StepRecord | None: RawStep.to_record in C "
     "(None: take the Python method)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "stepwatch._speedups",
                                    "The records file's step line, filled in C.", -1, methods};

PyMODINIT_FUNC PyInit__speedups(void) {
    INTERN(s_append, "append");
    INTERN(s_wake_first, "_wake_first");
    INTERN(s_wake, "_wake");
    INTERN(s_set, "set");
    INTERN(s_dropped, "dropped");
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (add_type(m, &Enqueue_spec, "Enqueue", NULL) < 0 || add_type(m, &Every_spec, "Every", NULL) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

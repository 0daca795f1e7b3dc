/* kvtier-cuda's host planner for the common whole-chunk call, compiled at runtime (see
 * kvtier/cuda/_native.py): nothing is compiled at install time, and the module uses only the
 * Python C API (no torch headers, so no ABI coupling to a torch version).
 *
 * plan_group() does, for one group of a whole-chunk call on the driver path, what
 * kvtier.cuda.plan.prepare followed by plan do in Python: it checks each transfer, copies
 * its slots into the pinned table buffer (checking each is in [0, total_slots)), packs the
 * chunks' rows into staging pieces and writes the run table after the slots. It returns None
 * -- and changes nothing the caller keeps -- whenever anything is not the ordinary case (a -1
 * or out-of-range slot, an empty or released object, a shape or dtype mismatch, slots that are
 * not contiguous int64 on the CPU, a row larger than a staging slot, a table buffer too small,
 * any Python error): the Python path then runs and raises or handles it. So both paths give
 * the same pieces and runs (tests/cuda/test_native.py checks this property).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define RUN_WORDS 8

typedef struct {
    int64_t host_ptr, slot_offset, nbytes;
} Copy;

typedef struct {
    int64_t slot, start, stop, max_rows, max_tokens, cap, nbytes;
    Py_ssize_t copy0, ncopies;
} Piece;

typedef struct {
    int64_t host_ptr, storage, n, slot_index;
} Prep;

static PyObject *s_obj, *s_slots, *s_meta, *s_num_tokens, *s_shape, *s_dtype, *s_tensor, *s_data_ptr,
    *s_arena, *s_is_cpu, *s_is_contiguous, *s_numel;

/* A new reference to obj.name, or NULL (error cleared). */
static PyObject *get(PyObject *obj, PyObject *name) {
    PyObject *v = PyObject_GetAttr(obj, name);
    if (v == NULL) PyErr_Clear();
    return v;
}

/* obj.name() as a C integer; 0 with *ok cleared on any failure. */
static int64_t call_int(PyObject *obj, PyObject *name, int *ok) {
    PyObject *v = PyObject_CallMethodNoArgs(obj, name);
    if (v == NULL) {
        PyErr_Clear();
        *ok = 0;
        return 0;
    }
    long long x = PyLong_AsLongLong(v);
    Py_DECREF(v);
    if (x == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        *ok = 0;
    }
    return (int64_t)x;
}

/* Check transfer t and copy its slots to table[slot_index...]; 1 on success. */
static int prepare_one(PyObject *t, PyObject *shapes, PyObject *dtype, PyObject *int64, uint64_t total,
                       int64_t *table, int64_t table_words, int64_t slot_index, Prep *out) {
    int ok = 0;
    PyObject *obj = NULL, *meta = NULL, *ntok = NULL, *mshape = NULL, *mdtype = NULL, *tensor = NULL,
             *arena = NULL, *sl = NULL, *sdtype = NULL, *is_cpu = NULL, *contig = NULL;
    int good = 1;
    if (!(obj = get(t, s_obj)) || !(meta = get(obj, s_meta)) || !(ntok = get(meta, s_num_tokens))) goto done;
    long long n = PyLong_AsLongLong(ntok);
    if (n == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        goto done;
    }
    if (n <= 0 || slot_index + n > table_words) goto done;
    PyObject *shape = PyDict_GetItemWithError(shapes, ntok); /* borrowed */
    if (shape == NULL) {
        PyErr_Clear();
        goto done;
    }
    if (!(mshape = get(meta, s_shape))) goto done;
    int eq = PyObject_RichCompareBool(mshape, shape, Py_EQ);
    if (eq != 1) {
        PyErr_Clear();
        goto done;
    }
    if (!(mdtype = get(meta, s_dtype)) || mdtype != dtype) goto done;
    if (!(tensor = get(obj, s_tensor))) goto done; /* raises once the handle is released */
    int64_t host_ptr = call_int(tensor, s_data_ptr, &good);
    if (!good || !(arena = get(obj, s_arena))) goto done;
    if (!(sl = get(t, s_slots)) || !(sdtype = get(sl, s_dtype)) || sdtype != int64) goto done;
    if (!(is_cpu = get(sl, s_is_cpu)) || is_cpu != Py_True) goto done;
    if (!(contig = PyObject_CallMethodNoArgs(sl, s_is_contiguous))) {
        PyErr_Clear();
        goto done;
    }
    if (contig != Py_True) goto done;
    int64_t numel = call_int(sl, s_numel, &good);
    int64_t sptr = call_int(sl, s_data_ptr, &good);
    if (!good || numel != n || (sptr == 0)) goto done;
    const int64_t *src = (const int64_t *)(uintptr_t)sptr;
    int64_t *dst = table + slot_index;
    uint64_t bad = 0;
    for (long long j = 0; j < n; j++) {
        int64_t v = src[j];
        bad |= (uint64_t)((uint64_t)v >= total);
        dst[j] = v;
    }
    if (bad) goto done; /* a -1 or an out-of-range slot: the Python path */
    out->host_ptr = host_ptr;
    out->storage = (int64_t)(intptr_t)arena; /* id(arena), as _Prepared.storage */
    out->n = n;
    out->slot_index = slot_index;
    ok = 1;
done:
    Py_XDECREF(obj);
    Py_XDECREF(meta);
    Py_XDECREF(ntok);
    Py_XDECREF(mshape);
    Py_XDECREF(mdtype);
    Py_XDECREF(tensor);
    Py_XDECREF(arena);
    Py_XDECREF(sl);
    Py_XDECREF(sdtype);
    Py_XDECREF(is_cpu);
    Py_XDECREF(contig);
    return ok;
}

/* Growable arrays. */
typedef struct {
    void *data;
    Py_ssize_t len, cap, item;
} Vec;

static void *vec_push(Vec *v) {
    if (v->len == v->cap) {
        Py_ssize_t cap = v->cap ? 2 * v->cap : 8;
        void *d = PyMem_Realloc(v->data, cap * v->item);
        if (d == NULL) return NULL;
        v->data = d;
        v->cap = cap;
    }
    return (char *)v->data + (v->len++) * v->item;
}

static PyObject *plan_group(PyObject *self, PyObject *args) {
    PyObject *transfers, *shapes, *dtype, *int64, *slot_ptrs_obj;
    Py_ssize_t lo, hi;
    long long hd_bytes, rows_per_obj, table_words, slot_bytes, next_slot, first_piece_bytes, last_piece_bytes;
    unsigned long long total, table_addr, slot_base;
    if (!PyArg_ParseTuple(args, "OnnOOOLLKKLLOLKLL", &transfers, &lo, &hi, &shapes, &dtype, &int64, &hd_bytes,
                          &rows_per_obj, &total, &table_addr, &table_words, &slot_bytes, &slot_ptrs_obj,
                          &next_slot, &slot_base, &first_piece_bytes, &last_piece_bytes))
        return NULL;
    if (!PyDict_Check(shapes)) {
        PyErr_SetString(PyExc_TypeError, "shapes must be a dict");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(transfers, "transfers must be a sequence");
    if (seq == NULL) return NULL;
    PyObject *slots_seq = PySequence_Fast(slot_ptrs_obj, "slot_ptrs must be a sequence");
    if (slots_seq == NULL) {
        Py_DECREF(seq);
        return NULL;
    }
    PyObject *result = NULL;
    Prep *prep = NULL;
    int64_t *slot_ptrs = NULL;
    Vec pieces = {NULL, 0, 0, sizeof(Piece)}, copies = {NULL, 0, 0, sizeof(Copy)};
    Py_ssize_t count = hi - lo, num_slots = PySequence_Fast_GET_SIZE(slots_seq);
    int64_t *table = (int64_t *)(uintptr_t)table_addr;
    if (lo < 0 || count <= 0 || hi > PySequence_Fast_GET_SIZE(seq) || num_slots <= 0 || hd_bytes <= 0 ||
        rows_per_obj <= 0 || slot_bytes <= 0 || next_slot < 0 || next_slot >= num_slots || table == NULL)
        goto fallback;
    prep = PyMem_Malloc(count * sizeof(Prep));
    slot_ptrs = PyMem_Malloc(num_slots * sizeof(int64_t));
    if (prep == NULL || slot_ptrs == NULL) goto fallback;
    for (Py_ssize_t s = 0; s < num_slots; s++) {
        slot_ptrs[s] = (int64_t)PyLong_AsUnsignedLongLong(PySequence_Fast_GET_ITEM(slots_seq, s));
        if (PyErr_Occurred()) {
            PyErr_Clear();
            goto fallback;
        }
    }
    /* _prepare: check every transfer, slots into the table buffer. */
    int64_t tokens = 0, left_bytes = 0;
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < count; i++) {
        if (!prepare_one(items[lo + i], shapes, dtype, int64, (uint64_t)total, table, table_words, tokens, &prep[i]))
            goto fallback;
        int64_t rb = prep[i].n * hd_bytes;
        if (rb > slot_bytes) goto fallback; /* _plan grows the staging slots first */
        tokens += prep[i].n;
        left_bytes += rb * rows_per_obj;
    }
    if (!last_piece_bytes) left_bytes = 0;
    /* _plan for whole-chunk segments (i, 0, rows_per_obj, 1, -1). */
    int64_t nruns = 0, used = 0, cap = 0, base = 0;
    Piece *piece = NULL;
    Copy *last = NULL;
    int64_t last_storage = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        Prep *p = &prep[i];
        int64_t rb = p->n * hd_bytes, r = 0, left = rows_per_obj;
        int64_t slot_list = (int64_t)slot_base + 8 * p->slot_index;
        while (left) {
            int64_t fit = (cap - used) / rb;
            if (fit == 0) {
                cap = slot_bytes;
                if (pieces.len == 0 && first_piece_bytes) {
                    int64_t want = first_piece_bytes > rb ? first_piece_bytes : rb;
                    cap = cap < want ? cap : want;
                } else if (last_piece_bytes && last_piece_bytes < left_bytes && left_bytes <= cap + last_piece_bytes) {
                    int64_t want = left_bytes - last_piece_bytes;
                    cap = want > rb ? want : rb;
                }
                if (piece != NULL) {
                    piece->stop = nruns;
                    piece->nbytes = used;
                }
                piece = vec_push(&pieces);
                if (piece == NULL) goto fallback;
                piece->slot = next_slot;
                piece->start = piece->stop = nruns;
                piece->max_rows = piece->max_tokens = piece->nbytes = 0;
                piece->cap = cap;
                piece->copy0 = copies.len;
                piece->ncopies = 0;
                next_slot = (next_slot + 1) % num_slots;
                used = 0;
                base = slot_ptrs[piece->slot];
                last = NULL;
                fit = cap / rb;
            }
            int64_t k = fit < left ? fit : left;
            if (tokens + RUN_WORDS * (nruns + 1) > table_words) goto fallback;
            int64_t *run = table + tokens + RUN_WORDS * nruns;
            run[0] = r;
            run[1] = 1;
            run[2] = k;
            run[3] = base + used;
            run[4] = rb;
            run[5] = slot_list;
            run[6] = p->n;
            run[7] = 0;
            nruns++;
            /* The rows' host range, merged with the previous one when adjacent in one buffer. */
            int64_t nbytes = k * rb, addr = p->host_ptr + r * rb;
            if (last != NULL && last->host_ptr + last->nbytes == addr && last_storage == p->storage) {
                last->nbytes += nbytes;
            } else {
                last = vec_push(&copies);
                if (last == NULL) goto fallback;
                last->host_ptr = addr;
                last->slot_offset = used;
                last->nbytes = nbytes;
                last_storage = p->storage;
                piece->ncopies++;
            }
            used += nbytes;
            if (k > piece->max_rows) piece->max_rows = k;
            if (p->n > piece->max_tokens) piece->max_tokens = p->n;
            left_bytes -= k * rb;
            r += k;
            left -= k;
        }
    }
    if (piece == NULL) goto fallback;
    piece->stop = nruns;
    piece->nbytes = used;
    /* (next_slot, tokens, runs, [(slot, start, stop, max_rows, max_tokens, cap, nbytes,
     *   ((host_ptr, slot_offset, nbytes), ...)), ...]) */
    PyObject *plist = PyList_New(pieces.len);
    if (plist == NULL) goto error;
    for (Py_ssize_t j = 0; j < pieces.len; j++) {
        Piece *pc = (Piece *)pieces.data + j;
        PyObject *ctuple = PyTuple_New(pc->ncopies);
        if (ctuple == NULL) {
            Py_DECREF(plist);
            goto error;
        }
        for (Py_ssize_t c = 0; c < pc->ncopies; c++) {
            Copy *cp = (Copy *)copies.data + pc->copy0 + c;
            PyObject *ct = Py_BuildValue("(LLL)", (long long)cp->host_ptr, (long long)cp->slot_offset,
                                         (long long)cp->nbytes);
            if (ct == NULL) {
                Py_DECREF(ctuple);
                Py_DECREF(plist);
                goto error;
            }
            PyTuple_SET_ITEM(ctuple, c, ct);
        }
        PyObject *pt = Py_BuildValue("(LLLLLLLN)", (long long)pc->slot, (long long)pc->start, (long long)pc->stop,
                                     (long long)pc->max_rows, (long long)pc->max_tokens, (long long)pc->cap,
                                     (long long)pc->nbytes, ctuple);
        if (pt == NULL) {
            Py_DECREF(plist);
            goto error;
        }
        PyList_SET_ITEM(plist, j, pt);
    }
    result = Py_BuildValue("(LLLN)", (long long)next_slot, (long long)tokens, (long long)nruns, plist);
    goto out;
fallback:
    if (PyErr_Occurred()) PyErr_Clear();
    result = Py_None;
    Py_INCREF(result);
    goto out;
error:
    result = NULL;
out:
    PyMem_Free(prep);
    PyMem_Free(slot_ptrs);
    PyMem_Free(pieces.data);
    PyMem_Free(copies.data);
    Py_DECREF(seq);
    Py_DECREF(slots_seq);
    return result;
}

static PyMethodDef methods[] = {
    {"plan_group", plan_group, METH_VARARGS,
     "plan_group(transfers, lo, hi, shapes, dtype, int64, hd_bytes, rows_per_obj, total_slots, table_addr, "
     "table_words, slot_bytes, slot_ptrs, next_slot, slot_base, first_piece_bytes, last_piece_bytes) -> "
     "(next_slot, tokens, runs, pieces) or None (use the Python path)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kvtier_hostplan", NULL, -1, methods};

PyMODINIT_FUNC PyInit__kvtier_hostplan(void) {
#define INTERN(var, text)                                         \
    if ((var = PyUnicode_InternFromString(text)) == NULL) return NULL;
    INTERN(s_obj, "obj");
    INTERN(s_slots, "slots");
    INTERN(s_meta, "meta");
    INTERN(s_num_tokens, "num_tokens");
    INTERN(s_shape, "shape");
    INTERN(s_dtype, "dtype");
    INTERN(s_tensor, "tensor");
    INTERN(s_data_ptr, "data_ptr");
    INTERN(s_arena, "arena");
    INTERN(s_is_cpu, "is_cpu");
    INTERN(s_is_contiguous, "is_contiguous");
    INTERN(s_numel, "numel");
#undef INTERN
    return PyModule_Create(&module);
}

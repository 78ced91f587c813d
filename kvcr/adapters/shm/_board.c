/* kvcr.adapters.shm._board: read a same-host peer's slot board (kvcr/domain/board.py) through its mapping.
 *
 * Why in C: a restore of 32 pages looks up 32 keys; in Python that costs ~3 us a key, as much as the
 * LEASE round trip the board saves. Here it is well under a microsecond a key.
 *
 * The board is written by another process that we do not trust to be well-formed or quiet: every
 * slot number and length read from it is bounds-checked before use, and every record is read
 * between two equal even generation loads (a seqlock); a record that changes under us is skipped.
 *
 * lookup(address, layout, keys) -> (slots, gens, digests): keys is a list of page keys, each 64
 *     lowercase hex characters (anything else: ValueError, so the caller leases instead); per key its
 *     slot (-1: not on the board), the generation it was read at, and its digest (b"" when not found).
 * still(address, layout, slots, gens) -> list[bool]: per slot, whether its generation is unchanged.
 * copy(address, layout, pieces, src_slots, dst_slots, gens) -> list[bool]: copy pages found on the
 *     board into ours, then per page whether its slot's generation is still the one found (False: the
 *     peer reused the slot meanwhile and what landed is not that page). pieces: per component,
 *     (src base, src stride, src count, dst base, dst stride, dst count, piece bytes). Every slot is
 *     checked against its region before anything is copied; the copies run without the GIL.
 *     Why here: the same restore through Python (runs, a posted read, a poll, then still()) cost a
 *     64 KiB x 32 restore ~15 us of a ~150 us copy on the 2-core VM.
 * layout is BoardLayout.as_tuple(): (slots, buckets, gens, keys, digests, lengths, table, nbytes).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define KEY_BYTES 32
#define DIGEST_BYTES 32
#define PROBES 8

typedef struct {
    unsigned long long slots, buckets, gens, keys, digests, lengths, table, nbytes;
} layout_t;

static int parse_layout(PyObject *tuple, layout_t *l)
{
    if (!PyArg_ParseTuple(tuple, "KKKKKKKK;layout must be 8 ints", &l->slots, &l->buckets, &l->gens, &l->keys,
                          &l->digests, &l->lengths, &l->table, &l->nbytes))
        return -1;
    unsigned long long n = l->slots;
    int fits = n > 0 && n < 0xFFFFFFFFULL && l->buckets >= PROBES && (l->buckets & (l->buckets - 1)) == 0 &&
               l->buckets <= (1ULL << 33) && l->gens % 8 == 0 && l->table % 4 == 0 &&
               l->gens + 8 * n <= l->nbytes && l->keys + KEY_BYTES * n <= l->nbytes &&
               l->digests + DIGEST_BYTES * n <= l->nbytes && l->lengths + n <= l->nbytes &&
               l->table + 4 * l->buckets <= l->nbytes;
    if (!fits) {
        PyErr_SetString(PyExc_ValueError, "board layout does not fit its size");
        return -1;
    }
    return 0;
}

static inline uint64_t load_gen(const char *base, const layout_t *l, uint64_t slot)
{
    return __atomic_load_n((const uint64_t *)(base + l->gens + 8 * slot), __ATOMIC_ACQUIRE);
}

/* Key ``hex`` (a page key as the engine names it) as its 32 bytes: 0, or -1 with ValueError when it is
 * not exactly 64 lowercase hex characters (the one spelling a board stores). */
static int key_bytes(PyObject *hex, unsigned char *out)
{
    if (!PyUnicode_Check(hex) || !PyUnicode_IS_COMPACT_ASCII(hex) || PyUnicode_GET_LENGTH(hex) != 2 * KEY_BYTES) {
        PyErr_SetString(PyExc_ValueError, "a board key is 64 lowercase hex characters");
        return -1;
    }
    const char *text = (const char *)PyUnicode_DATA(hex);
    for (int i = 0; i < 2 * KEY_BYTES; i++) {
        char c = text[i];
        int v = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
        if (v < 0) {
            PyErr_SetString(PyExc_ValueError, "a board key is 64 lowercase hex characters");
            return -1;
        }
        out[i / 2] = (unsigned char)(i % 2 ? out[i / 2] | v : v << 4);
    }
    return 0;
}

static PyObject *lookup(PyObject *self, PyObject *args)
{
    unsigned long long address;
    PyObject *layout_obj, *keys;
    layout_t l;
    if (!PyArg_ParseTuple(args, "KO!O!", &address, &PyTuple_Type, &layout_obj, &PyList_Type, &keys))
        return NULL;
    PyObject *slots = NULL, *gens = NULL, *digests = NULL, *result = NULL;
    if (parse_layout(layout_obj, &l) < 0)
        goto done;
    if (address == 0) {
        PyErr_SetString(PyExc_ValueError, "a board lookup needs an address");
        goto done;
    }
    Py_ssize_t n = PyList_GET_SIZE(keys);
    slots = PyList_New(n);
    gens = PyList_New(n);
    digests = PyList_New(n);
    if (slots == NULL || gens == NULL || digests == NULL)
        goto done;
    const char *base = (const char *)(uintptr_t)address;
    const volatile uint32_t *table = (const volatile uint32_t *)(base + l.table);
    const uint64_t mask = l.buckets - 1;
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned char key[KEY_BYTES];
        if (key_bytes(PyList_GET_ITEM(keys, i), key) < 0)
            goto done;
        uint64_t home;
        memcpy(&home, key, 8); /* little endian on every platform kvcr shares boards on */
        long long found = -1;
        uint64_t gen = 0;
        unsigned char digest[DIGEST_BYTES];
        unsigned int dlen = 0;
        for (int p = 0; p < PROBES && found < 0; p++) {
            uint64_t hint = table[(home + (uint64_t)p) & mask];
            if (hint == 0 || hint > l.slots)
                continue;
            uint64_t slot = hint - 1;
            uint64_t g1 = load_gen(base, &l, slot);
            if (g1 == 0 || (g1 & 1))
                continue;
            if (memcmp(base + l.keys + KEY_BYTES * slot, key, KEY_BYTES) != 0)
                continue;
            unsigned int len = *(const volatile unsigned char *)(base + l.lengths + slot);
            if (len > DIGEST_BYTES)
                continue;
            memcpy(digest, base + l.digests + DIGEST_BYTES * slot, len);
            __atomic_thread_fence(__ATOMIC_ACQUIRE);
            if (load_gen(base, &l, slot) != g1)
                continue;
            found = (long long)slot;
            gen = g1;
            dlen = len;
        }
        PyObject *s = PyLong_FromLongLong(found);
        PyObject *g = PyLong_FromUnsignedLongLong(gen);
        PyObject *d = PyBytes_FromStringAndSize((const char *)digest, found < 0 ? 0 : (Py_ssize_t)dlen);
        if (s == NULL || g == NULL || d == NULL) {
            Py_XDECREF(s);
            Py_XDECREF(g);
            Py_XDECREF(d);
            goto done;
        }
        PyList_SET_ITEM(slots, i, s);
        PyList_SET_ITEM(gens, i, g);
        PyList_SET_ITEM(digests, i, d);
    }
    result = PyTuple_Pack(3, slots, gens, digests);
done:
    Py_XDECREF(slots);
    Py_XDECREF(gens);
    Py_XDECREF(digests);
    return result;
}

static PyObject *still(PyObject *self, PyObject *args)
{
    unsigned long long address;
    PyObject *layout_obj, *slots, *gens;
    layout_t l;
    if (!PyArg_ParseTuple(args, "KO!O!O!", &address, &PyTuple_Type, &layout_obj, &PyList_Type, &slots,
                          &PyList_Type, &gens))
        return NULL;
    if (parse_layout(layout_obj, &l) < 0)
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(slots);
    if (address == 0 || PyList_GET_SIZE(gens) != n) {
        PyErr_SetString(PyExc_ValueError, "a board check needs an address and one generation per slot");
        return NULL;
    }
    const char *base = (const char *)(uintptr_t)address;
    __atomic_thread_fence(__ATOMIC_ACQUIRE); /* the copy's loads come before these */
    PyObject *out = PyList_New(n);
    if (out == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        long long slot = PyLong_AsLongLong(PyList_GET_ITEM(slots, i));
        unsigned long long want = PyLong_AsUnsignedLongLong(PyList_GET_ITEM(gens, i));
        if (PyErr_Occurred()) {
            Py_DECREF(out);
            return NULL;
        }
        int same = slot >= 0 && (unsigned long long)slot < l.slots && load_gen(base, &l, (uint64_t)slot) == want;
        PyObject *flag = same ? Py_True : Py_False;
        Py_INCREF(flag);
        PyList_SET_ITEM(out, i, flag);
    }
    return out;
}

typedef struct {
    unsigned long long src, src_stride, src_count, dst, dst_stride, dst_count, bytes;
} piece_t;

/* The n ints of a list, each in [0, bound): 0, or -1 with ValueError naming ``what``. */
static int slots_of(PyObject *list, Py_ssize_t n, unsigned long long bound, long long *out, const char *what)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        long long v = PyLong_AsLongLong(PyList_GET_ITEM(list, i));
        if (v == -1 && PyErr_Occurred())
            return -1;
        if (v < 0 || (unsigned long long)v >= bound) {
            PyErr_Format(PyExc_ValueError, "%s slot %lld is outside its region (%llu slots)", what, v, bound);
            return -1;
        }
        out[i] = v;
    }
    return 0;
}

static PyObject *copy(PyObject *self, PyObject *args)
{
    unsigned long long address;
    PyObject *layout_obj, *pieces_obj, *src_obj, *dst_obj, *gens_obj;
    layout_t l;
    if (!PyArg_ParseTuple(args, "KO!O!O!O!O!", &address, &PyTuple_Type, &layout_obj, &PyList_Type, &pieces_obj,
                          &PyList_Type, &src_obj, &PyList_Type, &dst_obj, &PyList_Type, &gens_obj))
        return NULL;
    if (parse_layout(layout_obj, &l) < 0)
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(src_obj), m = PyList_GET_SIZE(pieces_obj);
    if (address == 0 || PyList_GET_SIZE(dst_obj) != n || PyList_GET_SIZE(gens_obj) != n || m < 1) {
        PyErr_SetString(PyExc_ValueError,
                        "a board copy needs an address, a component and one slot pair and generation per page");
        return NULL;
    }
    piece_t *pieces = PyMem_Malloc(sizeof(piece_t) * (size_t)m);
    long long *src = PyMem_Malloc(sizeof(long long) * (size_t)(2 * n + 1));
    uint64_t *want = PyMem_Malloc(sizeof(uint64_t) * (size_t)(n + 1));
    PyObject *out = NULL;
    if (pieces == NULL || src == NULL || want == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    unsigned long long src_bound = l.slots, dst_bound = (unsigned long long)-1;
    for (Py_ssize_t c = 0; c < m; c++) {
        piece_t *p = &pieces[c];
        if (!PyArg_ParseTuple(PyList_GET_ITEM(pieces_obj, c), "KKKKKKK;a piece is 7 ints", &p->src, &p->src_stride,
                              &p->src_count, &p->dst, &p->dst_stride, &p->dst_count, &p->bytes))
            goto done;
        if (p->src == 0 || p->dst == 0 || p->bytes == 0 || p->src_stride < p->bytes || p->dst_stride < p->bytes) {
            PyErr_SetString(PyExc_ValueError, "a piece needs addresses and strides of at least its size");
            goto done;
        }
        src_bound = p->src_count < src_bound ? p->src_count : src_bound;
        dst_bound = p->dst_count < dst_bound ? p->dst_count : dst_bound;
    }
    long long *dst = src + n;
    if (slots_of(src_obj, n, src_bound, src, "source") < 0 || slots_of(dst_obj, n, dst_bound, dst, "destination") < 0)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        want[i] = PyLong_AsUnsignedLongLong(PyList_GET_ITEM(gens_obj, i));
        if (PyErr_Occurred())
            goto done;
    }
    const char *base = (const char *)(uintptr_t)address;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t c = 0; c < m; c++) {
        const piece_t *p = &pieces[c];
        int dense = p->src_stride == p->bytes && p->dst_stride == p->bytes;
        Py_ssize_t i = 0;
        while (i < n) {
            Py_ssize_t j = i + 1; /* pages i..j-1 follow each other on both sides: one copy when dense */
            while (dense && j < n && src[j] == src[j - 1] + 1 && dst[j] == dst[j - 1] + 1)
                j++;
            memcpy((char *)(uintptr_t)(p->dst + (unsigned long long)dst[i] * p->dst_stride),
                   (const char *)(uintptr_t)(p->src + (unsigned long long)src[i] * p->src_stride),
                   (size_t)(p->bytes * (unsigned long long)(j - i)));
            i = j;
        }
    }
    __atomic_thread_fence(__ATOMIC_ACQUIRE); /* the copy's loads come before the checks */
    for (Py_ssize_t i = 0; i < n; i++)
        want[i] = load_gen(base, &l, (uint64_t)src[i]) == want[i];
    Py_END_ALLOW_THREADS
    out = PyList_New(n);
    if (out == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *flag = want[i] ? Py_True : Py_False;
        Py_INCREF(flag);
        PyList_SET_ITEM(out, i, flag);
    }
done:
    PyMem_Free(pieces);
    PyMem_Free(src);
    PyMem_Free(want);
    return out;
}

static PyMethodDef methods[] = {
    {"copy", copy, METH_VARARGS, "copy(address, layout, pieces, src_slots, dst_slots, gens) -> per page, still"},
    {"lookup", lookup, METH_VARARGS, "lookup(address, layout, keys) -> (slots, gens, digests)"},
    {"still", still, METH_VARARGS, "still(address, layout, slots, gens) -> per slot, generation unchanged"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_board", "Lock-free reads of a same-host peer's slot board.", -1, methods,
};

PyMODINIT_FUNC PyInit__board(void) { return PyModule_Create(&module); }

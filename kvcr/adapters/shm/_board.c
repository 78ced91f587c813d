/* kvcr.adapters.shm._board: read a same-host peer's slot board (kvcr/domain/board.py) through its mapping.
 *
 * Why in C: a restore of 32 pages looks up 32 keys; in Python that costs ~3 us a key, as much as the
 * LEASE round trip the board saves. Here it is well under a microsecond a key.
 *
 * The board is written by another process that we do not trust to be well-formed or quiet: every
 * slot number and length read from it is bounds-checked before use, and every record is read
 * between two equal even generation loads (a seqlock); a record that changes under us is skipped.
 *
 * lookup(address, layout, keys) -> (slots, gens, digests): keys is n * 32 bytes; per key its slot
 *     (-1: not on the board), the generation it was read at, and its digest (b"" when not found).
 * still(address, layout, slots, gens) -> list[bool]: per slot, whether its generation is unchanged.
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

static PyObject *lookup(PyObject *self, PyObject *args)
{
    unsigned long long address;
    PyObject *layout_obj;
    Py_buffer keys;
    layout_t l;
    if (!PyArg_ParseTuple(args, "KO!y*", &address, &PyTuple_Type, &layout_obj, &keys))
        return NULL;
    PyObject *slots = NULL, *gens = NULL, *digests = NULL, *result = NULL;
    if (parse_layout(layout_obj, &l) < 0)
        goto done;
    if (address == 0 || keys.len % KEY_BYTES) {
        PyErr_SetString(PyExc_ValueError, "a board lookup needs an address and whole 32-byte keys");
        goto done;
    }
    Py_ssize_t n = keys.len / KEY_BYTES;
    slots = PyList_New(n);
    gens = PyList_New(n);
    digests = PyList_New(n);
    if (slots == NULL || gens == NULL || digests == NULL)
        goto done;
    const char *base = (const char *)(uintptr_t)address;
    const volatile uint32_t *table = (const volatile uint32_t *)(base + l.table);
    const uint64_t mask = l.buckets - 1;
    for (Py_ssize_t i = 0; i < n; i++) {
        const unsigned char *key = (const unsigned char *)keys.buf + (size_t)i * KEY_BYTES;
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
    PyBuffer_Release(&keys);
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

static PyMethodDef methods[] = {
    {"lookup", lookup, METH_VARARGS, "lookup(address, layout, keys) -> (slots, gens, digests)"},
    {"still", still, METH_VARARGS, "still(address, layout, slots, gens) -> per slot, generation unchanged"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_board", "Lock-free reads of a same-host peer's slot board.", -1, methods,
};

PyMODINIT_FUNC PyInit__board(void) { return PyModule_Create(&module); }

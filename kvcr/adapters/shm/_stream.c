/* kvcr.adapters.shm._stream: copy bytes with non-temporal stores, the GIL released.
 *
 * Why: a large same-host restore copies tens to hundreds of MiB from a peer's arena into host
 * pages that the GPU reads next by DMA, not the CPU. An ordinary copy (glibc's memmove below its
 * non-temporal threshold, which it derives from the last-level cache size the CPU reports) first
 * reads every destination line into the cache and then evicts it again; streaming stores write
 * around the cache. Measured on the 2-core CI VM (which reports a 480 MiB L3, so glibc streams only
 * copies of >= 181 MiB): one 128 MiB copy ran at 6.0 GB/s with memmove and 9.1 GB/s streamed.
 *
 * copy(dst, src, nbytes): dst and src are addresses (ints), as for ctypes.memmove; the caller has
 * checked that both ranges are mapped and do not overlap. Small copies and non-x86 builds use memcpy.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && defined(__SSE2__)
#include <emmintrin.h>
#define KVCR_STREAMS 1
#else
#define KVCR_STREAMS 0
#endif

#define STREAM_BLOCK 64
#define STREAM_MIN 4096 /* below a page, a plain copy: nothing to gain from bypassing the cache */

static void stream_copy(char *dst, const char *src, size_t n)
{
#if KVCR_STREAMS
    if (n >= STREAM_MIN) {
        size_t head = (STREAM_BLOCK - ((uintptr_t)dst & (STREAM_BLOCK - 1))) & (STREAM_BLOCK - 1);
        memcpy(dst, src, head); /* align the destination to a cache line */
        dst += head;
        src += head;
        n -= head;
        size_t blocks = n / STREAM_BLOCK;
        for (size_t i = 0; i < blocks; i++) {
            __m128i a = _mm_loadu_si128((const __m128i *)src);
            __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(src + 32));
            __m128i d = _mm_loadu_si128((const __m128i *)(src + 48));
            _mm_stream_si128((__m128i *)dst, a);
            _mm_stream_si128((__m128i *)(dst + 16), b);
            _mm_stream_si128((__m128i *)(dst + 32), c);
            _mm_stream_si128((__m128i *)(dst + 48), d);
            src += STREAM_BLOCK;
            dst += STREAM_BLOCK;
        }
        _mm_sfence(); /* streamed stores are weakly ordered: make them visible before we return */
        n -= blocks * STREAM_BLOCK;
    }
#endif
    memcpy(dst, src, n);
}

static PyObject *copy(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "copy(dst, src, nbytes) takes 3 arguments (%zd given)", nargs);
        return NULL;
    }
    void *dst = PyLong_AsVoidPtr(args[0]);
    if (dst == NULL && PyErr_Occurred()) {
        return NULL;
    }
    void *src = PyLong_AsVoidPtr(args[1]);
    if (src == NULL && PyErr_Occurred()) {
        return NULL;
    }
    Py_ssize_t n = PyLong_AsSsize_t(args[2]);
    if (n == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (n < 0) {
        PyErr_SetString(PyExc_ValueError, "copy: nbytes must not be negative");
        return NULL;
    }
    if (n > 0 && (dst == NULL || src == NULL)) {
        PyErr_SetString(PyExc_ValueError, "copy: a null address");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    stream_copy((char *)dst, (const char *)src, (size_t)n);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"copy", (PyCFunction)(void (*)(void))copy, METH_FASTCALL,
     "copy(dst, src, nbytes): copy nbytes from address src to address dst with streaming stores."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_stream", "Non-temporal copies for large same-host reads.", -1, methods,
};

PyMODINIT_FUNC PyInit__stream(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "STREAMS", KVCR_STREAMS) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

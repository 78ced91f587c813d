/* kvcr.adapters.shm._stream: copy bytes with non-temporal stores, the GIL released.
 *
 * Why: a large same-host restore copies tens to hundreds of MiB from a peer's arena into host
 * pages that the GPU reads next by DMA, not the CPU. An ordinary copy (glibc's memmove below its
 * non-temporal threshold, which it derives from the last-level cache size the CPU reports) first
 * reads every destination line into the cache and then evicts it again; streaming stores write
 * around the cache. Measured on the 2-core CI VM (which reports a 480 MiB L3, so glibc streams only
 * copies of >= 181 MiB): one 128 MiB copy ran at 5.9-6.1 GB/s with memmove and 9.2-10.0 GB/s here;
 * 256-512 MiB, which glibc streams itself, 8.6-9.6 against 9.3-9.9.
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

#define LINE 64
#define PAGE 4096
#define STREAM_MIN PAGE /* below a page, a plain copy: nothing to gain from bypassing the cache */

#if KVCR_STREAMS
static inline void stream_line(char *dst, const char *src)
{
    __m128i a = _mm_loadu_si128((const __m128i *)src);
    __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
    __m128i c = _mm_loadu_si128((const __m128i *)(src + 32));
    __m128i d = _mm_loadu_si128((const __m128i *)(src + 48));
    _mm_stream_si128((__m128i *)dst, a);
    _mm_stream_si128((__m128i *)(dst + 16), b);
    _mm_stream_si128((__m128i *)(dst + 32), c);
    _mm_stream_si128((__m128i *)(dst + 48), d);
}
#endif

static void stream_copy(char *dst, const char *src, size_t n)
{
#if KVCR_STREAMS
    if (n >= STREAM_MIN) {
        size_t head = (PAGE - ((uintptr_t)dst & (PAGE - 1))) & (PAGE - 1);
        if (head > n) {
            head = n;
        }
        memcpy(dst, src, head); /* align the destination to a page */
        dst += head;
        src += head;
        n -= head;
        /* Four pages at a time, one line of each in turn: four streams in flight keep more of the
         * memory system busy than one (the same idea as glibc's own large-copy loop). Measured on
         * the CI VM: 128 MiB at 9.2-10.0 GB/s, against 7.3-8.2 one page at a time. */
        size_t groups = n / (4 * PAGE);
        for (size_t g = 0; g < groups; g++) {
            for (size_t at = 0; at < PAGE; at += LINE) {
                stream_line(dst + at, src + at);
                stream_line(dst + PAGE + at, src + PAGE + at);
                stream_line(dst + 2 * PAGE + at, src + 2 * PAGE + at);
                stream_line(dst + 3 * PAGE + at, src + 3 * PAGE + at);
            }
            dst += 4 * PAGE;
            src += 4 * PAGE;
        }
        n -= groups * 4 * PAGE;
        size_t lines = n / LINE;
        for (size_t i = 0; i < lines; i++) {
            stream_line(dst, src);
            dst += LINE;
            src += LINE;
        }
        n -= lines * LINE;
        _mm_sfence(); /* streamed stores are weakly ordered: make them visible before we return */
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

/* Packing many small CPU tensors into one flat buffer and back, for tensor fusion (hpdl/comm/fusion.py), and
   summing float ranges of them in place (the shared-memory collectives, hpdl/comm/shm.py).

   Why: torch.cat and torch._foreach_copy_ pay about a third and two thirds of a microsecond per tensor in
   dispatch, which for 200 gradients of 4 KB is 3-6 times the time of the copies themselves. A fusion plan's
   tensors keep their addresses while the plan lives, so the plan hands this module one table of
   (address, bytes) pairs, and each pack or unpack is one loop of memcpy with the GIL released. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* The table: a bytes-like object of int64 pairs (address, bytes), in the order the tensors sit in the buffer. */
static int read_table(PyObject *obj, Py_buffer *view) {
    if (PyObject_GetBuffer(obj, view, PyBUF_SIMPLE) < 0) return -1;
    if (view->len % (2 * sizeof(int64_t)) != 0) {
        PyBuffer_Release(view);
        PyErr_SetString(PyExc_ValueError, "hpdl._copies: the table holds (address, bytes) pairs of int64");
        return -1;
    }
    return 0;
}

static PyObject *copy(PyObject *const *args, Py_ssize_t nargs, int into_flat) {
    Py_buffer view;
    if (nargs != 2 && nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "hpdl._copies: (flat address, table[, start, length]) expected");
        return NULL;
    }
    char *flat = PyLong_AsVoidPtr(args[0]);
    if (flat == NULL && PyErr_Occurred()) return NULL;
    long long start = 0, length = -1; /* bytes of the tensors' concatenation; -1: all of it */
    if (nargs == 4) {
        start = PyLong_AsLongLong(args[2]);
        length = PyLong_AsLongLong(args[3]);
        if ((start == -1 || length == -1) && PyErr_Occurred()) return NULL;
        if (start < 0 || length < 0) {
            PyErr_SetString(PyExc_ValueError, "hpdl._copies: start and length must not be negative");
            return NULL;
        }
    }
    if (read_table(args[1], &view) < 0) return NULL;
    const int64_t *pairs = view.buf;
    Py_ssize_t n = view.len / (Py_ssize_t)(2 * sizeof(int64_t));
    long long total = 0;
    for (Py_ssize_t i = 0; i < n; i++) total += pairs[2 * i + 1];
    if (length < 0) length = total - start;
    if (start + length > total) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "hpdl._copies: the range runs past the tensors' bytes");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS long long at = 0; /* where tensor i starts in the concatenation */
    for (Py_ssize_t i = 0; i < n && length > 0; i++) {
        long long nbytes = pairs[2 * i + 1];
        if (at + nbytes > start) {
            long long skip = start > at ? start - at : 0;
            long long take = nbytes - skip < length ? nbytes - skip : length;
            char *tensor = (char *)(intptr_t)pairs[2 * i] + skip;
            if (into_flat)
                memcpy(flat, tensor, (size_t)take);
            else
                memcpy(tensor, flat, (size_t)take);
            flat += take;
            start += take;
            length -= take;
        }
        at += nbytes;
    }
    Py_END_ALLOW_THREADS PyBuffer_Release(&view);
    Py_RETURN_NONE;
}

/* pack(flat_address, table[, start, length]): the tensors one after the other into the flat buffer; with a
   range, only bytes [start, start + length) of their concatenation (a piece of a fused buffer staged straight
   into shared memory, hpdl/comm/shm.py) */
static PyObject *pack(PyObject *self, PyObject *const *args, Py_ssize_t nargs) { return copy(args, nargs, 1); }

/* unpack(flat_address, table[, start, length]): the flat buffer back into the tensors (or into bytes
   [start, start + length) of their concatenation) */
static PyObject *unpack(PyObject *self, PyObject *const *args, Py_ssize_t nargs) { return copy(args, nargs, 0); }

/* One tensor's part of a reduced range: tensor[i] (op) each source's [i], in the sources' order, then divided
   by `divisor` when it is not 1; the result written back into the tensor and to `out`. Block by block (a few
   kilobytes, in cache), one pass per source over the block: simple loops the compiler vectorises, each element
   combined in the same order as torch's add_ one source after another would (the same bits), and the copy to
   `out` reads the block from cache (a copy of the whole range afterwards reads it from memory again). */
#define REDUCE_BLOCK_BYTES 8192
#define REDUCE_SUM(T)                                                                                            \
    static void reduce_sum_##T(T *tensor, char *const *outs, Py_ssize_t nouts, char *const *sources,            \
                               Py_ssize_t nsources, long long offset, long long count, long long divisor,       \
                               int assign) {                                                                    \
        const long long block = REDUCE_BLOCK_BYTES / (long long)sizeof(T);                                      \
        for (long long first = 0; first < count; first += block) {                                              \
            long long n = count - first < block ? count - first : block;                                        \
            T *part = tensor + first;                                                                           \
            Py_ssize_t k = 0;                                                                                   \
            if (assign && nsources >= 2) { /* the tensor's values are not an operand: the first two sources */  \
                const T *a = (const T *)(sources[0] + offset) + first, *b = (const T *)(sources[1] + offset) + first; \
                for (long long i = 0; i < n; i++) part[i] = a[i] + b[i];                                        \
                k = 2;                                                                                          \
            } else if (assign && nsources == 1) {                                                               \
                memcpy(part, (const T *)(sources[0] + offset) + first, (size_t)n * sizeof(T));                  \
                k = 1;                                                                                          \
            }                                                                                                   \
            for (; k < nsources; k++) {                                                                         \
                const T *source = (const T *)(sources[k] + offset) + first;                                     \
                for (long long i = 0; i < n; i++) part[i] += source[i];                                         \
            }                                                                                                   \
            if (divisor != 1)                                                                                   \
                for (long long i = 0; i < n; i++) part[i] /= (T)divisor;                                       \
            for (Py_ssize_t j = 0; j < nouts; j++)                                                              \
                memcpy((T *)(outs[j] + offset) + first, part, (size_t)n * sizeof(T));                          \
        }                                                                                                       \
    }
REDUCE_SUM(float)
REDUCE_SUM(double)

enum { KIND_FLOAT32_SUM = 0, KIND_FLOAT64_SUM = 1 };

/* reduce(table, start, length, out_address, sources, kind, divisor[, assign]): bytes [start, start + length) of
   the tensors' concatenation summed in place with the same bytes of every source (a tuple of addresses, each
   holding `length` bytes: the other ranks' staged copies of this range, in the order they are combined; with
   `assign` true the tensors' own values are not an operand: they receive the sum of the sources alone),
   divided by `divisor` (an average; 1: a sum), and the result also written to `out_address` (where the other
   ranks copy it from; 0: nowhere else), or to each address of a tuple (with shared buffers on every rank: the
   other ranks' own tensors). The shared-memory allreduce and reduce-scatter (hpdl/comm/shm.py): each rank
   reduces its slice where it lies in its own tensors, with no flat buffer and no torch call per piece. */
static PyObject *reduce(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Py_buffer view;
    if (nargs != 7 && nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "hpdl._copies.reduce: (table, start, length, out address, sources, kind, "
                                         "divisor[, assign]) expected");
        return NULL;
    }
    int assign = nargs == 8 ? PyObject_IsTrue(args[7]) : 0;
    if (assign < 0) return NULL;
    long long start = PyLong_AsLongLong(args[1]), length = PyLong_AsLongLong(args[2]);
    char *outs[64];
    Py_ssize_t nouts = PyTuple_Check(args[3]) ? PyTuple_GET_SIZE(args[3]) : 1;
    if (nouts > 64) {
        PyErr_SetString(PyExc_ValueError, "hpdl._copies.reduce: at most 64 outputs");
        return NULL;
    }
    for (Py_ssize_t j = 0; j < nouts; j++) {
        outs[j] = PyLong_AsVoidPtr(PyTuple_Check(args[3]) ? PyTuple_GET_ITEM(args[3], j) : args[3]);
        if (outs[j] == NULL && PyErr_Occurred()) return NULL;
        if (outs[j] == NULL && PyTuple_Check(args[3])) {
            PyErr_SetString(PyExc_ValueError, "hpdl._copies.reduce: an output address of 0 in the tuple");
            return NULL;
        }
    }
    if (nouts == 1 && outs[0] == NULL) nouts = 0; /* 0: the result stays in the tensors only */
    long kind = PyLong_AsLong(args[5]);
    long long divisor = PyLong_AsLongLong(args[6]);
    if (PyErr_Occurred()) return NULL;
    if (!PyTuple_Check(args[4])) {
        PyErr_SetString(PyExc_TypeError, "hpdl._copies.reduce: sources must be a tuple of addresses");
        return NULL;
    }
    size_t itemsize = kind == KIND_FLOAT32_SUM ? sizeof(float) : sizeof(double);
    if ((kind != KIND_FLOAT32_SUM && kind != KIND_FLOAT64_SUM) || start < 0 || length < 0 || divisor < 1 ||
        start % (long long)itemsize != 0 || length % (long long)itemsize != 0) {
        PyErr_SetString(PyExc_ValueError, "hpdl._copies.reduce: a known kind, whole elements and a divisor >= 1");
        return NULL;
    }
    Py_ssize_t nsources = PyTuple_GET_SIZE(args[4]);
    char *sources[64];
    if (nsources > 64) {
        PyErr_SetString(PyExc_ValueError, "hpdl._copies.reduce: at most 64 sources");
        return NULL;
    }
    for (Py_ssize_t k = 0; k < nsources; k++) {
        sources[k] = PyLong_AsVoidPtr(PyTuple_GET_ITEM(args[4], k));
        if (sources[k] == NULL && PyErr_Occurred()) return NULL;
    }
    if (read_table(args[0], &view) < 0) return NULL;
    const int64_t *pairs = view.buf;
    Py_ssize_t n = view.len / (Py_ssize_t)(2 * sizeof(int64_t));
    long long total = 0;
    for (Py_ssize_t i = 0; i < n; i++) total += pairs[2 * i + 1];
    if (start + length > total) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "hpdl._copies.reduce: the range runs past the tensors' bytes");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS long long at = 0, done = 0; /* done: bytes of the range reduced so far */
    for (Py_ssize_t i = 0; i < n && done < length; i++) {
        long long nbytes = pairs[2 * i + 1];
        if (at + nbytes > start + done) {
            long long skip = start + done - at;
            long long take = nbytes - skip < length - done ? nbytes - skip : length - done;
            char *tensor = (char *)(intptr_t)pairs[2 * i] + skip;
            if (kind == KIND_FLOAT32_SUM)
                reduce_sum_float((float *)tensor, outs, nouts, sources, nsources, done, take / 4, divisor, assign);
            else
                reduce_sum_double((double *)tensor, outs, nouts, sources, nsources, done, take / 8, divisor, assign);
            done += take;
        }
        at += nbytes;
    }
    Py_END_ALLOW_THREADS PyBuffer_Release(&view);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"pack", (PyCFunction)(void (*)(void))pack, METH_FASTCALL, NULL},
    {"unpack", (PyCFunction)(void (*)(void))unpack, METH_FASTCALL, NULL},
    {"reduce", (PyCFunction)(void (*)(void))reduce, METH_FASTCALL, NULL},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "hpdl.comm._copies", NULL, -1, methods};

PyMODINIT_FUNC PyInit__copies(void) { return PyModule_Create(&module); }

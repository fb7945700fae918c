/* Packing many small CPU tensors into one flat buffer and back, for tensor fusion (hpdl/comm/fusion.py).

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
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "hpdl._copies: (flat address, table) expected");
        return NULL;
    }
    char *flat = PyLong_AsVoidPtr(args[0]);
    if (flat == NULL && PyErr_Occurred()) return NULL;
    if (read_table(args[1], &view) < 0) return NULL;
    const int64_t *pairs = view.buf;
    Py_ssize_t n = view.len / (Py_ssize_t)(2 * sizeof(int64_t));
    Py_BEGIN_ALLOW_THREADS for (Py_ssize_t i = 0; i < n; i++) {
        char *tensor = (char *)(intptr_t)pairs[2 * i];
        size_t nbytes = (size_t)pairs[2 * i + 1];
        if (into_flat)
            memcpy(flat, tensor, nbytes);
        else
            memcpy(tensor, flat, nbytes);
        flat += nbytes;
    }
    Py_END_ALLOW_THREADS PyBuffer_Release(&view);
    Py_RETURN_NONE;
}

/* pack(flat_address, table): the tensors one after the other into the flat buffer */
static PyObject *pack(PyObject *self, PyObject *const *args, Py_ssize_t nargs) { return copy(args, nargs, 1); }

/* unpack(flat_address, table): the flat buffer back into the tensors */
static PyObject *unpack(PyObject *self, PyObject *const *args, Py_ssize_t nargs) { return copy(args, nargs, 0); }

static PyMethodDef methods[] = {
    {"pack", (PyCFunction)(void (*)(void))pack, METH_FASTCALL, NULL},
    {"unpack", (PyCFunction)(void (*)(void))unpack, METH_FASTCALL, NULL},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "hpdl.comm._copies", NULL, -1, methods};

PyMODINIT_FUNC PyInit__copies(void) { return PyModule_Create(&module); }

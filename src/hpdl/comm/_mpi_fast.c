/* The MPI calls under hpdl's fast paths (hpdl/comm/mpi_calls.py), compiled against the MPI that mpi4py runs on.

   Why: mpi4py turns every argument into an MPI message in Python objects (a list, a buffer, a Request), about
   a microsecond per call, which is most of a small collective's time. These functions take the handles and
   the address directly, start the nonblocking operation, test it while the GIL is released for at most
   `wait` seconds and return None when it completed, or an mpi4py Request for the caller's bounded wait. They
   check nothing that the caller does not already check: mpi_calls.py decides whether this module matches the
   running MPI (the same predefined handles) before anything calls it. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <limits.h>
#include <mpi.h>
#include <sched.h>
#include <stdint.h>
#include <time.h>

static PyObject *request_fromhandle; /* mpi4py.MPI.Request.fromhandle */
static PyObject *error_class;        /* mpi4py.MPI.Exception */

#define SPIN_SECONDS 20e-6 /* tests at full speed before the wait yields the core between tests */

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Handles as mpi4py gives them: the library's handle (an int in MPICH's ABI, a pointer in Open MPI's) widened to
   a pointer's size with its sign, read as unsigned. */
static intptr_t handle(PyObject *obj) { return (intptr_t)PyLong_AsUnsignedLongLongMask(obj); }

#define HANDLE_VALUE(h) ((size_t)(intptr_t)(h))

static PyObject *mpi_error(int code) {
    PyObject *exc = PyObject_CallFunction(error_class, "i", code);
    if (exc != NULL) {
        PyErr_SetObject(error_class, exc);
        Py_DECREF(exc);
    }
    return NULL;
}

/* The element count of `nbytes` of `datatype`, or -1 with an exception set. */
static int count_of(PyObject *nbytes_obj, MPI_Datatype datatype) {
    Py_ssize_t nbytes = PyLong_AsSsize_t(nbytes_obj);
    int size = 0;
    if (nbytes == -1 && PyErr_Occurred()) return -1;
    MPI_Type_size(datatype, &size);
    if (size <= 0 || nbytes / size > INT_MAX) {
        PyErr_SetString(PyExc_OverflowError, "hpdl._mpi_fast: message too large for an int count");
        return -1;
    }
    return (int)(nbytes / size);
}

/* Test `request` (started by the caller) for up to `wait` seconds with the GIL released: None when it
   completed, else an mpi4py Request for the caller's bounded wait. `received` gets the byte count of a
   completed receive when not NULL. A negative `wait` returns the Request untested. */
static PyObject *finish(int started, MPI_Request request, double wait, int *received) {
    int flag = 0, rc = MPI_SUCCESS;
    MPI_Status status;
    if (started != MPI_SUCCESS) return mpi_error(started);
    if (wait >= 0) {
        rc = MPI_Test(&request, &flag, &status);
        if (rc == MPI_SUCCESS && !flag && wait > 0) {
            Py_BEGIN_ALLOW_THREADS double start = now(), spent = 0;
            while (rc == MPI_SUCCESS && !flag && spent < wait) {
                if (spent > SPIN_SECONDS) sched_yield(); /* the peer may be waiting for this core */
                rc = MPI_Test(&request, &flag, &status);
                spent = now() - start;
            }
            Py_END_ALLOW_THREADS
        }
        if (rc != MPI_SUCCESS) return mpi_error(rc);
        if (flag) {
            if (received != NULL) MPI_Get_count(&status, MPI_BYTE, received);
            Py_RETURN_NONE;
        }
    }
    return PyObject_CallFunction(request_fromhandle, "N", PyLong_FromSize_t(HANDLE_VALUE(request)));
}

#define ARGS(n)                                                                               \
    if (nargs != (n)) {                                                                       \
        PyErr_Format(PyExc_TypeError, "hpdl._mpi_fast: %d arguments expected", (int)(n)); \
        return NULL;                                                                          \
    }

/* allreduce(comm, address, nbytes, datatype, op, wait): in place */
static PyObject *allreduce(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    ARGS(6);
    MPI_Comm comm = (MPI_Comm)handle(args[0]);
    void *address = PyLong_AsVoidPtr(args[1]);
    MPI_Datatype datatype = (MPI_Datatype)handle(args[3]);
    int count = count_of(args[2], datatype);
    double wait = PyFloat_AsDouble(args[5]);
    MPI_Request request;
    if (count < 0 || PyErr_Occurred()) return NULL;
    int rc = MPI_Iallreduce(MPI_IN_PLACE, address, count, datatype, (MPI_Op)handle(args[4]), comm, &request);
    return finish(rc, request, wait, NULL);
}

/* allgather(comm, send_address or 0 for in place, out_address, nbytes per rank, datatype, wait) */
static PyObject *allgather(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    ARGS(6);
    MPI_Comm comm = (MPI_Comm)handle(args[0]);
    void *send = PyLong_AsVoidPtr(args[1]);
    void *out = PyLong_AsVoidPtr(args[2]);
    MPI_Datatype datatype = (MPI_Datatype)handle(args[4]);
    int count = count_of(args[3], datatype);
    double wait = PyFloat_AsDouble(args[5]);
    MPI_Request request;
    int rc;
    if (count < 0 || PyErr_Occurred()) return NULL;
    if (send == NULL)
        rc = MPI_Iallgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, out, count, datatype, comm, &request);
    else
        rc = MPI_Iallgather(send, count, datatype, out, count, datatype, comm, &request);
    return finish(rc, request, wait, NULL);
}

/* reduce_scatter(comm, address, out_address, nbytes per rank, datatype, op, wait) */
static PyObject *reduce_scatter(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    ARGS(7);
    MPI_Comm comm = (MPI_Comm)handle(args[0]);
    void *address = PyLong_AsVoidPtr(args[1]);
    void *out = PyLong_AsVoidPtr(args[2]);
    MPI_Datatype datatype = (MPI_Datatype)handle(args[4]);
    int count = count_of(args[3], datatype);
    double wait = PyFloat_AsDouble(args[6]);
    MPI_Request request;
    if (count < 0 || PyErr_Occurred()) return NULL;
    int rc = MPI_Ireduce_scatter_block(address, out, count, datatype, (MPI_Op)handle(args[5]), comm, &request);
    return finish(rc, request, wait, NULL);
}

/* broadcast(comm, address, nbytes, datatype, root, wait) */
static PyObject *broadcast(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    ARGS(6);
    MPI_Comm comm = (MPI_Comm)handle(args[0]);
    void *address = PyLong_AsVoidPtr(args[1]);
    MPI_Datatype datatype = (MPI_Datatype)handle(args[3]);
    int count = count_of(args[2], datatype);
    int root = (int)PyLong_AsLong(args[4]);
    double wait = PyFloat_AsDouble(args[5]);
    MPI_Request request;
    if (count < 0 || PyErr_Occurred()) return NULL;
    int rc = MPI_Ibcast(address, count, datatype, root, comm, &request);
    return finish(rc, request, wait, NULL);
}

/* send(comm, address, nbytes, datatype, dst, tag, wait) */
static PyObject *send(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    ARGS(7);
    MPI_Comm comm = (MPI_Comm)handle(args[0]);
    void *address = PyLong_AsVoidPtr(args[1]);
    MPI_Datatype datatype = (MPI_Datatype)handle(args[3]);
    int count = count_of(args[2], datatype);
    int dst = (int)PyLong_AsLong(args[4]), tag = (int)PyLong_AsLong(args[5]);
    double wait = PyFloat_AsDouble(args[6]);
    MPI_Request request;
    if (count < 0 || PyErr_Occurred()) return NULL;
    int rc = MPI_Isend(address, count, datatype, dst, tag, comm, &request);
    return finish(rc, request, wait, NULL);
}

/* recv(comm, address, nbytes, datatype, src, tag, wait): the bytes received when complete, else a Request */
static PyObject *recv(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    ARGS(7);
    MPI_Comm comm = (MPI_Comm)handle(args[0]);
    void *address = PyLong_AsVoidPtr(args[1]);
    MPI_Datatype datatype = (MPI_Datatype)handle(args[3]);
    int count = count_of(args[2], datatype);
    int src = (int)PyLong_AsLong(args[4]), tag = (int)PyLong_AsLong(args[5]);
    double wait = PyFloat_AsDouble(args[6]);
    int received = -1;
    MPI_Request request;
    if (count < 0 || PyErr_Occurred()) return NULL;
    int rc = MPI_Irecv(address, count, datatype, src, tag, comm, &request);
    PyObject *result = finish(rc, request, wait, &received);
    if (result == Py_None) {
        Py_DECREF(result);
        return PyLong_FromLong(received);
    }
    return result;
}

/* configure(Request.fromhandle, MPI.Exception): what the module hands back and raises */
static PyObject *configure(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    ARGS(2);
    Py_INCREF(args[0]);
    Py_INCREF(args[1]);
    Py_XSETREF(request_fromhandle, args[0]);
    Py_XSETREF(error_class, args[1]);
    Py_RETURN_NONE;
}

/* The handles this module was compiled with, to compare with the running MPI's before any call. */
static PyObject *compiled_handles(PyObject *self, PyObject *unused) {
    return Py_BuildValue("{s:N,s:N,s:N,s:N,s:N,s:N}", "COMM_WORLD", PyLong_FromSize_t(HANDLE_VALUE(MPI_COMM_WORLD)),
                         "COMM_SELF", PyLong_FromSize_t(HANDLE_VALUE(MPI_COMM_SELF)), "FLOAT",
                         PyLong_FromSize_t(HANDLE_VALUE(MPI_FLOAT)), "INT64_T",
                         PyLong_FromSize_t(HANDLE_VALUE(MPI_INT64_T)), "SUM", PyLong_FromSize_t(HANDLE_VALUE(MPI_SUM)),
                         "MAX", PyLong_FromSize_t(HANDLE_VALUE(MPI_MAX)));
}

static PyObject *initialized(PyObject *self, PyObject *unused) {
    int flag = 0;
    MPI_Initialized(&flag);
    return PyBool_FromLong(flag);
}

static PyMethodDef methods[] = {
    {"allreduce", (PyCFunction)(void (*)(void))allreduce, METH_FASTCALL, NULL},
    {"allgather", (PyCFunction)(void (*)(void))allgather, METH_FASTCALL, NULL},
    {"reduce_scatter", (PyCFunction)(void (*)(void))reduce_scatter, METH_FASTCALL, NULL},
    {"broadcast", (PyCFunction)(void (*)(void))broadcast, METH_FASTCALL, NULL},
    {"send", (PyCFunction)(void (*)(void))send, METH_FASTCALL, NULL},
    {"recv", (PyCFunction)(void (*)(void))recv, METH_FASTCALL, NULL},
    {"configure", (PyCFunction)(void (*)(void))configure, METH_FASTCALL, NULL},
    {"compiled_handles", compiled_handles, METH_NOARGS, NULL},
    {"initialized", initialized, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "hpdl.comm._mpi_fast", NULL, -1, methods};

PyMODINIT_FUNC PyInit__mpi_fast(void) { return PyModule_Create(&module); }

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
    if (nbytes < 0) {
        PyErr_SetString(PyExc_ValueError, "hpdl._mpi_fast: a negative number of bytes");
        return -1;
    }
    int rc = MPI_Type_size(datatype, &size);
    if (rc != MPI_SUCCESS) {
        mpi_error(rc);
        return -1;
    }
    if (size <= 0 || nbytes / size > INT_MAX) {
        PyErr_SetString(PyExc_OverflowError, "hpdl._mpi_fast: message too large for an int count");
        return -1;
    }
    return (int)(nbytes / size);
}

/* Test `request` once, then for up to `wait` seconds with the GIL released (at full speed, then yielding the
   core): MPI's return code; `*flag` says whether it completed. */
static int test_for(MPI_Request *request, double wait, int *flag, MPI_Status *status) {
    int rc = MPI_Test(request, flag, status);
    if (rc == MPI_SUCCESS && !*flag && wait > 0) {
        Py_BEGIN_ALLOW_THREADS double start = now(), spent = 0;
        while (rc == MPI_SUCCESS && !*flag && spent < wait) {
            if (spent > SPIN_SECONDS) sched_yield(); /* the peer may be waiting for this core */
            rc = MPI_Test(request, flag, status);
            spent = now() - start;
        }
        Py_END_ALLOW_THREADS
    }
    return rc;
}

/* An operation still in flight as an mpi4py Request (for the caller's bounded wait). */
static PyObject *as_request(MPI_Request request) {
    return PyObject_CallFunction(request_fromhandle, "N", PyLong_FromSize_t(HANDLE_VALUE(request)));
}

/* Test `request` (started by the caller) for up to `wait` seconds: None when it completed, else an mpi4py
   Request. `received` gets the byte count of a completed receive when not NULL. A negative `wait` returns the
   Request untested. */
static PyObject *finish(int started, MPI_Request request, double wait, int *received) {
    int flag = 0;
    MPI_Status status;
    if (started != MPI_SUCCESS) return mpi_error(started);
    if (wait >= 0) {
        int rc = test_for(&request, wait, &flag, &status);
        if (rc != MPI_SUCCESS) return mpi_error(rc);
        if (flag) {
            if (received != NULL) MPI_Get_count(&status, MPI_BYTE, received);
            Py_RETURN_NONE;
        }
    }
    return as_request(request);
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

/* ------------------------------------------------------------------ the blocking fast paths

   `Fast` holds one communicator's blocking fast paths for allreduce, allgather, reduce_scatter and broadcast:
   the same checks, numbering, progress post and agreement entry as MpiCommunicator's Python fast paths (which
   stay the reference, and which take every call this code does not: async_op, debug, tracing, other dtypes or
   devices, out=None, sizes above the thresholds), without a Python frame. A call it does not take goes, with
   its arguments unchanged, to the Python method. The communicator's changing state (_plain, _seq, _every,
   _ring, the per-operation size limits) is read from its __dict__ on every call, so nothing is cached that
   Python could change. */

#define MAX_DTYPES 24
#define MAX_OPS 4
#define MAX_ROOTS 64

enum { ALLREDUCE, ALLGATHER, REDUCE_SCATTER, BROADCAST, KINDS };

typedef struct {
    PyObject_HEAD PyObject *dict; /* the communicator's __dict__ */
    PyObject *python[KINDS];      /* the Python fast paths, bound */
    PyObject *slow;               /* comm._fast_slow(op, seq, keep, request, code): the bounded wait, or the error */
    PyObject *check;              /* agreement.check bound to the communicator: check(seq) */
    PyObject *tensor_type;
    PyObject *shift80;            /* 1 << 80, the agreement entry's count field for one */
    MPI_Comm comm;
    int rank, size;
    int64_t *board; /* this rank's progress words: sequence number, operation code */
    int64_t progress_code[KINDS];
    int ndtypes;
    PyObject *dtypes[MAX_DTYPES];
    MPI_Datatype types[MAX_DTYPES];
    int itemsize[MAX_DTYPES];
    long long move_code[MAX_DTYPES];
    long long reduce_code[MAX_DTYPES][MAX_OPS];  /* allreduce; 0: not on this path */
    long long scatter_code[MAX_DTYPES][MAX_OPS]; /* reduce_scatter */
    long long root_code[MAX_DTYPES][MAX_ROOTS];  /* broadcast */
    PyObject *op_names[MAX_OPS];
    MPI_Op ops[MAX_OPS];
} Fast;

static PyObject *s_root, *s_plain, *s_seq, *s_every, *s_ring, *s_below[KINDS], *s_dtype, *s_is_cpu, *s_nbytes, *s_shape,
    *s_data_ptr, *s_is_contiguous, *s_op, *s_async_op, *s_out, *s_sizes, *s_kind_names[KINDS];

static int fast_traverse(Fast *self, visitproc visit, void *arg) {
    Py_VISIT(self->dict);
    for (int i = 0; i < KINDS; i++) Py_VISIT(self->python[i]);
    Py_VISIT(self->slow);
    Py_VISIT(self->check);
    return 0;
}

static int fast_clear(Fast *self) {
    Py_CLEAR(self->dict);
    for (int i = 0; i < KINDS; i++) Py_CLEAR(self->python[i]);
    Py_CLEAR(self->slow);
    Py_CLEAR(self->check);
    return 0;
}

static void fast_dealloc(Fast *self) {
    PyObject_GC_UnTrack(self);
    fast_clear(self);
    Py_CLEAR(self->tensor_type);
    Py_CLEAR(self->shift80);
    for (int i = 0; i < self->ndtypes; i++) Py_CLEAR(self->dtypes[i]);
    for (int i = 0; i < MAX_OPS; i++) Py_CLEAR(self->op_names[i]);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Fast(comm, handle, rank, size, board_address, tensor_type, progress_codes, python_methods, slow, check) */
static int fast_init(Fast *self, PyObject *args, PyObject *kwds) {
    PyObject *comm, *handle_obj, *board, *tensor_type, *codes, *methods, *slow, *check;
    int rank, size;
    if (!PyArg_ParseTuple(args, "OOiiOOO!O!OO", &comm, &handle_obj, &rank, &size, &board, &tensor_type, &PyTuple_Type,
                          &codes, &PyTuple_Type, &methods, &slow, &check))
        return -1;
    if (PyTuple_GET_SIZE(codes) != KINDS || PyTuple_GET_SIZE(methods) != KINDS) {
        PyErr_SetString(PyExc_ValueError, "hpdl._mpi_fast.Fast: one code and one method per operation");
        return -1;
    }
    if (self->dict != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "hpdl._mpi_fast.Fast: already initialised");
        return -1;
    }
    self->dict = PyObject_GenericGetDict(comm, NULL);
    if (self->dict == NULL) return -1;
    self->comm = (MPI_Comm)handle(handle_obj);
    self->rank = rank;
    self->size = size;
    self->board = (int64_t *)PyLong_AsVoidPtr(board);
    for (int i = 0; i < KINDS; i++) {
        self->progress_code[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(codes, i));
        Py_INCREF(PyTuple_GET_ITEM(methods, i));
        self->python[i] = PyTuple_GET_ITEM(methods, i);
    }
    Py_INCREF(tensor_type);
    self->tensor_type = tensor_type;
    Py_INCREF(slow);
    self->slow = slow;
    Py_INCREF(check);
    self->check = check;
    PyObject *one = PyLong_FromLong(1), *eighty = PyLong_FromLong(80);
    self->shift80 = (one && eighty) ? PyNumber_Lshift(one, eighty) : NULL;
    Py_XDECREF(one);
    Py_XDECREF(eighty);
    return PyErr_Occurred() || self->shift80 == NULL ? -1 : 0;
}

/* add_op(name, op_handle) -> index */
static PyObject *fast_add_op(Fast *self, PyObject *const *args, Py_ssize_t nargs) {
    ARGS(2);
    for (int i = 0; i < MAX_OPS; i++)
        if (self->op_names[i] == NULL) {
            Py_INCREF(args[0]);
            self->op_names[i] = args[0];
            self->ops[i] = (MPI_Op)handle(args[1]);
            return PyLong_FromLong(i);
        }
    PyErr_SetString(PyExc_ValueError, "hpdl._mpi_fast.Fast: too many ops");
    return NULL;
}

/* add_dtype(dtype, type_handle, itemsize, move_code, reduce_codes, scatter_codes, root_codes): codes by op index
   and by root (0: not on this path) */
static PyObject *fast_add_dtype(Fast *self, PyObject *const *args, Py_ssize_t nargs) {
    ARGS(7);
    if (self->ndtypes == MAX_DTYPES) {
        PyErr_SetString(PyExc_ValueError, "hpdl._mpi_fast.Fast: too many dtypes");
        return NULL;
    }
    int d = self->ndtypes;
    self->types[d] = (MPI_Datatype)handle(args[1]);
    self->itemsize[d] = (int)PyLong_AsLong(args[2]);
    self->move_code[d] = PyLong_AsLongLong(args[3]);
    for (int k = 0; k < 3; k++) {
        PyObject *codes = args[4 + k];
        Py_ssize_t n = PySequence_Size(codes), limit = k == 2 ? MAX_ROOTS : MAX_OPS;
        if (n < 0) return NULL;
        for (Py_ssize_t i = 0; i < n && i < limit; i++) {
            PyObject *item = PySequence_GetItem(codes, i);
            long long code = item == NULL ? 0 : PyLong_AsLongLong(item);
            Py_XDECREF(item);
            if (k == 0) self->reduce_code[d][i] = code;
            else if (k == 1) self->scatter_code[d][i] = code;
            else self->root_code[d][i] = code;
        }
    }
    if (PyErr_Occurred()) return NULL;
    Py_INCREF(args[0]);
    self->dtypes[d] = args[0];
    self->ndtypes++;
    Py_RETURN_NONE;
}

/* The index of `dtype`, or -1. */
static int dtype_index(Fast *self, PyObject *dtype) {
    for (int i = 0; i < self->ndtypes; i++)
        if (self->dtypes[i] == dtype) return i;
    return -1;
}

/* The index of op name `name`, or -1. */
static int op_index(Fast *self, PyObject *name) {
    for (int i = 0; i < MAX_OPS && self->op_names[i] != NULL; i++)
        if (self->op_names[i] == name) return i;
    if (!PyUnicode_Check(name)) return -1;
    for (int i = 0; i < MAX_OPS && self->op_names[i] != NULL; i++)
        if (PyUnicode_Compare(self->op_names[i], name) == 0) return i; /* (two str: no error possible) */
    return -1;
}

/* 1 when `obj` is an exact torch.Tensor on the CPU, contiguous; 0 when not; -1 on error. */
static int plain_cpu_tensor(Fast *self, PyObject *obj) {
    if (Py_TYPE(obj) != (PyTypeObject *)self->tensor_type) return 0;
    PyObject *cpu = PyObject_GetAttr(obj, s_is_cpu);
    if (cpu == NULL) return -1;
    Py_DECREF(cpu);
    if (cpu != Py_True) return 0;
    PyObject *contiguous = PyObject_CallMethodNoArgs(obj, s_is_contiguous);
    if (contiguous == NULL) return -1;
    Py_DECREF(contiguous);
    return contiguous == Py_True;
}

static long long long_attr(PyObject *obj, PyObject *name) {
    PyObject *value = PyObject_GetAttr(obj, name);
    if (value == NULL) return -1;
    long long result = PyLong_AsLongLong(value);
    Py_DECREF(value);
    return result;
}

static long long call_long(PyObject *obj, PyObject *name) {
    PyObject *value = PyObject_CallMethodNoArgs(obj, name);
    if (value == NULL) return -1;
    long long result = PyLong_AsLongLong(value);
    Py_DECREF(value);
    return result;
}

/* Whether the communicator takes fast calls now (_plain) and `nbytes` is below this operation's limit. */
static int open_for(Fast *self, int kind, double nbytes) {
    PyObject *plain = PyDict_GetItem(self->dict, s_plain);
    if (plain != Py_True) return 0;
    PyObject *below = PyDict_GetItem(self->dict, s_below[kind]);
    double limit = below == NULL ? 0 : PyFloat_AsDouble(below);
    if (limit == -1.0 && PyErr_Occurred()) {
        PyErr_Clear(); /* not a number: the Python path reads it and says so */
        return 0;
    }
    return nbytes < limit && nbytes < 2147483648.0; /* an int count, whatever the limit says */
}

/* Number the call, post progress, record its agreement entry (code | bytes << 32 | (extra + 1) << 80) and run
   the check when it is due: the sequence number, or -1 with an exception set. */
static long long begin(Fast *self, int kind, long long code, long long nbytes, long long extra) {
    PyObject *seq_obj = PyDict_GetItem(self->dict, s_seq);
    long long seq = seq_obj == NULL ? -1 : PyLong_AsLongLong(seq_obj);
    if (seq < 0) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "hpdl._mpi_fast: no sequence number");
        return -1;
    }
    seq += 1;
    PyObject *next = PyLong_FromLongLong(seq);
    if (next == NULL || PyDict_SetItem(self->dict, s_seq, next) < 0) {
        Py_XDECREF(next);
        return -1;
    }
    Py_DECREF(next);
    self->board[0] = seq;
    self->board[1] = self->progress_code[kind];
    PyObject *every_obj = PyDict_GetItem(self->dict, s_every);
    long long every = every_obj == NULL ? 0 : PyLong_AsLongLong(every_obj);
    if (every > 0) {
        PyObject *ring = PyDict_GetItem(self->dict, s_ring);
        PyObject *low = PyLong_FromUnsignedLongLong((unsigned long long)code | (unsigned long long)nbytes << 32);
        PyObject *count = extra == 0 ? (Py_INCREF(self->shift80), self->shift80) : NULL;
        if (count == NULL && low != NULL) {
            PyObject *e = PyLong_FromLongLong(extra + 1), *shift = PyLong_FromLong(80);
            count = (e && shift) ? PyNumber_Lshift(e, shift) : NULL;
            Py_XDECREF(e);
            Py_XDECREF(shift);
        }
        PyObject *entry = (low && count) ? PyNumber_Or(low, count) : NULL;
        Py_XDECREF(low);
        Py_XDECREF(count);
        if (entry == NULL || ring == NULL || !PyList_Check(ring) || PyList_GET_SIZE(ring) < every) {
            Py_XDECREF(entry);
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "hpdl._mpi_fast: no agreement ring");
            return -1;
        }
        PyList_SetItem(ring, (Py_ssize_t)(seq % every), entry); /* steals entry */
        if (seq % every == 0) {
            PyObject *done = PyObject_CallFunction(self->check, "L", seq);
            if (done == NULL) return -1;
            Py_DECREF(done);
        }
    }
    return seq;
}

/* After the MPI call started with `rc`: wait up to WAIT seconds; then the result (a new reference to `result`),
   or the bounded wait / error through comm._fast_slow. */
#define WAIT_SECONDS 2e-3 /* mpi_backend._WAIT: the Python fast paths' own */
static PyObject *complete(Fast *self, int kind, long long seq, int rc, MPI_Request request, PyObject *keep,
                          PyObject *result) {
    int flag = 0;
    if (rc == MPI_SUCCESS) rc = test_for(&request, WAIT_SECONDS, &flag, MPI_STATUS_IGNORE);
    if (rc == MPI_SUCCESS && flag) {
        Py_INCREF(result);
        return result;
    }
    PyObject *request_obj = Py_None;
    if (rc == MPI_SUCCESS) {
        request_obj = as_request(request);
        if (request_obj == NULL) return NULL;
    } else
        Py_INCREF(request_obj);
    PyObject *done = PyObject_CallFunction(self->slow, "OLONi", s_kind_names[kind], seq, keep, request_obj, rc);
    if (done == NULL) return NULL;
    Py_DECREF(done);
    Py_INCREF(result);
    return result;
}

#define READY                                                                                   \
    if (self->dict == NULL) {                                                                   \
        PyErr_SetString(PyExc_RuntimeError, "hpdl._mpi_fast.Fast: not initialised, or cleared"); \
        return NULL;                                                                            \
    }

/* The Python fast path with the caller's arguments unchanged. */
static PyObject *python(Fast *self, int kind, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    return PyObject_Vectorcall(self->python[kind], args, nargs, kwnames);
}

/* Keyword arguments by name; 0 when a name is not one of `names` (the Python method then says what is wrong). */
static int keywords(PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames, PyObject **names, PyObject **values,
                    int count) {
    if (kwnames == NULL) return 1;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(kwnames); i++) {
        PyObject *name = PyTuple_GET_ITEM(kwnames, i);
        int found = 0;
        for (int k = 0; k < count; k++)
            if (name == names[k] || (PyUnicode_Check(name) && PyUnicode_Compare(name, names[k]) == 0)) {
                values[k] = args[nargs + i];
                found = 1;
            }
        if (!found) return 0;
    }
    return 1;
}

/* allreduce(tensor, op="sum", *, async_op=False) */
static PyObject *fast_allreduce(Fast *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    READY;
    PyObject *names[2] = {s_op, s_async_op}, *values[2] = {NULL, NULL};
    if (nargs < 1 || nargs > 2 || !keywords(args, nargs, kwnames, names, values, 2) || (nargs == 2 && values[0]))
        return python(self, ALLREDUCE, args, nargs, kwnames);
    PyObject *tensor = args[0], *op = nargs == 2 ? args[1] : values[0];
    if ((values[1] != NULL && values[1] != Py_False) || PyDict_GetItem(self->dict, s_plain) != Py_True)
        return python(self, ALLREDUCE, args, nargs, kwnames);
    int plain = plain_cpu_tensor(self, tensor);
    if (plain <= 0) return plain < 0 ? NULL : python(self, ALLREDUCE, args, nargs, kwnames);
    PyObject *dtype = PyObject_GetAttr(tensor, s_dtype);
    if (dtype == NULL) return NULL;
    int d = dtype_index(self, dtype), o = op == NULL ? 0 : op_index(self, op);
    Py_DECREF(dtype);
    if (d < 0 || o < 0 || self->reduce_code[d][o] == 0) return python(self, ALLREDUCE, args, nargs, kwnames);
    long long nbytes = long_attr(tensor, s_nbytes);
    if (nbytes < 0) return NULL;
    if (!open_for(self, ALLREDUCE, (double)nbytes)) return python(self, ALLREDUCE, args, nargs, kwnames);
    long long seq = begin(self, ALLREDUCE, self->reduce_code[d][o], nbytes, 0);
    if (seq < 0) return NULL;
    long long address = call_long(tensor, s_data_ptr);
    if (address == -1 && PyErr_Occurred()) return NULL;
    MPI_Request request;
    int rc = MPI_Iallreduce(MPI_IN_PLACE, (void *)(intptr_t)address, (int)(nbytes / self->itemsize[d]),
                            self->types[d], self->ops[o], self->comm, &request);
    return complete(self, ALLREDUCE, seq, rc, request, tensor, tensor);
}

/* broadcast(tensor, root=0, *, async_op=False) */
static PyObject *fast_broadcast(Fast *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    READY;
    PyObject *names[2] = {s_root, s_async_op}, *values[2] = {NULL, NULL};
    if (nargs < 1 || nargs > 2 || !keywords(args, nargs, kwnames, names, values, 2) || (nargs == 2 && values[0]))
        return python(self, BROADCAST, args, nargs, kwnames);
    PyObject *tensor = args[0], *root_obj = nargs == 2 ? args[1] : values[0];
    if ((values[1] != NULL && values[1] != Py_False) || PyDict_GetItem(self->dict, s_plain) != Py_True)
        return python(self, BROADCAST, args, nargs, kwnames);
    long root = 0;
    if (root_obj != NULL) {
        int overflow = 0;
        if (PyLong_CheckExact(root_obj)) root = PyLong_AsLongAndOverflow(root_obj, &overflow);
        if (!PyLong_CheckExact(root_obj) || overflow) return python(self, BROADCAST, args, nargs, kwnames);
    }
    if (root < 0 || root >= self->size || root >= MAX_ROOTS) return python(self, BROADCAST, args, nargs, kwnames);
    int plain = plain_cpu_tensor(self, tensor);
    if (plain <= 0) return plain < 0 ? NULL : python(self, BROADCAST, args, nargs, kwnames);
    PyObject *dtype = PyObject_GetAttr(tensor, s_dtype);
    if (dtype == NULL) return NULL;
    int d = dtype_index(self, dtype);
    Py_DECREF(dtype);
    if (d < 0 || self->root_code[d][root] == 0) return python(self, BROADCAST, args, nargs, kwnames);
    long long nbytes = long_attr(tensor, s_nbytes);
    if (nbytes < 0) return NULL;
    if (!open_for(self, BROADCAST, (double)nbytes)) return python(self, BROADCAST, args, nargs, kwnames);
    long long seq = begin(self, BROADCAST, self->root_code[d][root], nbytes, 0);
    if (seq < 0) return NULL;
    long long address = call_long(tensor, s_data_ptr);
    if (address == -1 && PyErr_Occurred()) return NULL;
    MPI_Request request;
    int rc = MPI_Ibcast((void *)(intptr_t)address, (int)(nbytes / self->itemsize[d]), self->types[d], (int)root,
                        self->comm, &request);
    return complete(self, BROADCAST, seq, rc, request, tensor, tensor);
}

/* The dims of a tensor's shape (a torch.Size: a tuple), as a new reference, or NULL with an exception. */
static PyObject *shape_of(PyObject *tensor) {
    PyObject *shape = PyObject_GetAttr(tensor, s_shape);
    if (shape != NULL && !PyTuple_Check(shape)) {
        Py_DECREF(shape);
        PyErr_SetString(PyExc_TypeError, "hpdl._mpi_fast: a tensor's shape is not a tuple");
        return NULL;
    }
    return shape;
}

/* Whether shapes `a` and `b` have the same number of dims and the same dims after the first. */
static int same_tail(PyObject *a, PyObject *b) {
    Py_ssize_t n = PyTuple_GET_SIZE(a);
    if (PyTuple_GET_SIZE(b) != n) return 0;
    for (Py_ssize_t i = 1; i < n; i++)
        if (PyLong_AsLongLong(PyTuple_GET_ITEM(a, i)) != PyLong_AsLongLong(PyTuple_GET_ITEM(b, i))) return 0;
    return 1;
}

/* allgather(tensor, *, sizes=None, out=None, async_op=False): equal sizes, `out` given */
static PyObject *fast_allgather(Fast *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    READY;
    PyObject *names[3] = {s_sizes, s_out, s_async_op}, *values[3] = {NULL, NULL, NULL};
    if (nargs != 1 || !keywords(args, nargs, kwnames, names, values, 3)) return python(self, ALLGATHER, args, nargs, kwnames);
    PyObject *tensor = args[0], *sizes = values[0], *out = values[1], *result = NULL;
    if ((values[2] != NULL && values[2] != Py_False) || sizes == NULL || out == NULL ||
        !(PyList_CheckExact(sizes) || PyTuple_CheckExact(sizes)) || PySequence_Fast_GET_SIZE(sizes) != self->size ||
        PyDict_GetItem(self->dict, s_plain) != Py_True)
        return python(self, ALLGATHER, args, nargs, kwnames);
    int plain = plain_cpu_tensor(self, tensor);
    if (plain > 0) plain = plain_cpu_tensor(self, out);
    if (plain <= 0) return plain < 0 ? NULL : python(self, ALLGATHER, args, nargs, kwnames);
    PyObject *dtype = PyObject_GetAttr(tensor, s_dtype), *out_dtype = dtype ? PyObject_GetAttr(out, s_dtype) : NULL;
    int d = dtype == NULL ? -1 : dtype_index(self, dtype), same_dtype = dtype != NULL && dtype == out_dtype;
    Py_XDECREF(dtype);
    Py_XDECREF(out_dtype);
    if (out_dtype == NULL) return NULL;
    PyObject *shape = shape_of(tensor), *whole = shape ? shape_of(out) : NULL;
    if (whole == NULL) goto done;
    long long rows = PyTuple_GET_SIZE(shape) ? PyLong_AsLongLong(PyTuple_GET_ITEM(shape, 0)) : -1;
    int fits = d >= 0 && same_dtype && rows >= 0 && same_tail(shape, whole) &&
               PyLong_AsLongLong(PyTuple_GET_ITEM(whole, 0)) == rows * self->size;
    /* (`sizes` read only now, after the calls into torch, within its current length: a torch function mode
       could have changed it) */
    for (Py_ssize_t r = 0; fits && r < self->size; r++) {
        int overflow = 0;
        PyObject *n = r < PySequence_Fast_GET_SIZE(sizes) ? PySequence_Fast_GET_ITEM(sizes, r) : NULL;
        fits = n != NULL && PyLong_CheckExact(n) && PyLong_AsLongLongAndOverflow(n, &overflow) == rows && !overflow;
    }
    if (PyErr_Occurred()) goto done;
    if (!fits) {
        result = python(self, ALLGATHER, args, nargs, kwnames);
        goto done;
    }
    long long nbytes = long_attr(tensor, s_nbytes);
    long long mine = call_long(tensor, s_data_ptr), at = call_long(out, s_data_ptr);
    if (PyErr_Occurred()) goto done;
    int in_place = nbytes > 0 && mine == at + nbytes * self->rank;
    if ((mine == at && nbytes > 0 && !in_place) || !open_for(self, ALLGATHER, (double)nbytes * self->size)) {
        result = python(self, ALLGATHER, args, nargs, kwnames); /* (the first: the general path says what is wrong) */
        goto done;
    }
    long long row = rows ? nbytes / rows : self->itemsize[d];
    for (Py_ssize_t i = 1; !rows && i < PyTuple_GET_SIZE(shape); i++) row *= PyLong_AsLongLong(PyTuple_GET_ITEM(shape, i));
    long long seq = begin(self, ALLGATHER, self->move_code[d], row, rows * self->size);
    if (seq < 0) goto done;
    MPI_Request request;
    int count = (int)(nbytes / self->itemsize[d]), rc;
    if (in_place)
        rc = MPI_Iallgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, (void *)(intptr_t)at, count, self->types[d], self->comm,
                            &request);
    else
        rc = MPI_Iallgather((void *)(intptr_t)mine, count, self->types[d], (void *)(intptr_t)at, count, self->types[d],
                            self->comm, &request);
    PyObject *keep = PyTuple_Pack(2, tensor, out);
    if (keep != NULL) result = complete(self, ALLGATHER, seq, rc, request, keep, out);
    Py_XDECREF(keep);
done:
    Py_XDECREF(shape);
    Py_XDECREF(whole);
    return result;
}

/* reduce_scatter(tensor, op="sum", *, out=None, async_op=False): `out` given */
static PyObject *fast_reduce_scatter(Fast *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    READY;
    PyObject *names[3] = {s_op, s_out, s_async_op}, *values[3] = {NULL, NULL, NULL};
    if (nargs < 1 || nargs > 2 || !keywords(args, nargs, kwnames, names, values, 3) || (nargs == 2 && values[0]))
        return python(self, REDUCE_SCATTER, args, nargs, kwnames);
    PyObject *tensor = args[0], *op = nargs == 2 ? args[1] : values[0], *out = values[1], *result = NULL;
    if ((values[2] != NULL && values[2] != Py_False) || out == NULL || PyDict_GetItem(self->dict, s_plain) != Py_True)
        return python(self, REDUCE_SCATTER, args, nargs, kwnames);
    int plain = plain_cpu_tensor(self, tensor);
    if (plain > 0) plain = plain_cpu_tensor(self, out);
    if (plain <= 0) return plain < 0 ? NULL : python(self, REDUCE_SCATTER, args, nargs, kwnames);
    PyObject *dtype = PyObject_GetAttr(tensor, s_dtype), *out_dtype = dtype ? PyObject_GetAttr(out, s_dtype) : NULL;
    int d = dtype == NULL ? -1 : dtype_index(self, dtype), same_dtype = dtype != NULL && dtype == out_dtype;
    Py_XDECREF(dtype);
    Py_XDECREF(out_dtype);
    if (out_dtype == NULL) return NULL;
    int o = op == NULL ? 0 : op_index(self, op);
    PyObject *shape = shape_of(tensor), *block = shape ? shape_of(out) : NULL;
    if (block == NULL) goto done;
    long long rows = PyTuple_GET_SIZE(shape) ? PyLong_AsLongLong(PyTuple_GET_ITEM(shape, 0)) : -1;
    long long block_rows = PyTuple_GET_SIZE(block) ? PyLong_AsLongLong(PyTuple_GET_ITEM(block, 0)) : -1;
    int fits = d >= 0 && o >= 0 && self->scatter_code[d][o] != 0 && same_dtype && rows >= 0 &&
               rows % self->size == 0 && block_rows * self->size == rows && same_tail(shape, block);
    if (PyErr_Occurred()) goto done;
    long long nbytes = fits ? long_attr(tensor, s_nbytes) : 0;
    long long mine = fits ? call_long(tensor, s_data_ptr) : 0, at = fits ? call_long(out, s_data_ptr) : 0;
    if (PyErr_Occurred()) goto done;
    if (!fits || (at == mine && block_rows) || !open_for(self, REDUCE_SCATTER, (double)nbytes)) {
        result = python(self, REDUCE_SCATTER, args, nargs, kwnames);
        goto done;
    }
    long long seq = begin(self, REDUCE_SCATTER, self->scatter_code[d][o], nbytes, 0);
    if (seq < 0) goto done;
    MPI_Request request;
    int rc = MPI_Ireduce_scatter_block((void *)(intptr_t)mine, (void *)(intptr_t)at,
                                       (int)(nbytes / self->size / self->itemsize[d]), self->types[d], self->ops[o],
                                       self->comm, &request);
    PyObject *keep = PyTuple_Pack(2, tensor, out);
    if (keep != NULL) result = complete(self, REDUCE_SCATTER, seq, rc, request, keep, out);
    Py_XDECREF(keep);
done:
    Py_XDECREF(shape);
    Py_XDECREF(block);
    return result;
}

static PyMethodDef fast_methods[] = {
    {"allreduce", (PyCFunction)(void (*)(void))fast_allreduce, METH_FASTCALL | METH_KEYWORDS,
     "allreduce($self, tensor, op='sum', *, async_op=False)\n--\n\n"
     "MpiCommunicator.allreduce, its blocking fast path compiled (the same semantics: see there)."},
    {"allgather", (PyCFunction)(void (*)(void))fast_allgather, METH_FASTCALL | METH_KEYWORDS,
     "allgather($self, tensor, *, sizes=None, out=None, async_op=False)\n--\n\n"
     "Communicator.allgather, its blocking fast path compiled (the same semantics: see there)."},
    {"reduce_scatter", (PyCFunction)(void (*)(void))fast_reduce_scatter, METH_FASTCALL | METH_KEYWORDS,
     "reduce_scatter($self, tensor, op='sum', *, out=None, async_op=False)\n--\n\n"
     "Communicator.reduce_scatter, its blocking fast path compiled (the same semantics: see there)."},
    {"broadcast", (PyCFunction)(void (*)(void))fast_broadcast, METH_FASTCALL | METH_KEYWORDS,
     "broadcast($self, tensor, root=0, *, async_op=False)\n--\n\n"
     "Communicator.broadcast, its blocking fast path compiled (the same semantics: see there)."},
    {"add_op", (PyCFunction)(void (*)(void))fast_add_op, METH_FASTCALL, NULL},
    {"add_dtype", (PyCFunction)(void (*)(void))fast_add_dtype, METH_FASTCALL, NULL},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject FastType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "hpdl.comm._mpi_fast.Fast",
    .tp_basicsize = sizeof(Fast),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)fast_init,
    .tp_dealloc = (destructor)fast_dealloc,
    .tp_traverse = (traverseproc)fast_traverse,
    .tp_clear = (inquiry)fast_clear,
    .tp_methods = fast_methods,
};

static int intern_names(void) {
    const char *below[KINDS] = {"_fast_allreduce_below", "_fast_allgather_below", "_fast_reduce_scatter_below",
                                "_fast_broadcast_below"};
    const char *kinds[KINDS] = {"allreduce", "allgather", "reduce_scatter", "broadcast"};
    for (int i = 0; i < KINDS; i++) {
        if ((s_below[i] = PyUnicode_InternFromString(below[i])) == NULL) return -1;
        if ((s_kind_names[i] = PyUnicode_InternFromString(kinds[i])) == NULL) return -1;
    }
    return ((s_root = PyUnicode_InternFromString("root")) && (s_plain = PyUnicode_InternFromString("_plain")) && (s_seq = PyUnicode_InternFromString("_seq")) &&
            (s_every = PyUnicode_InternFromString("_every")) && (s_ring = PyUnicode_InternFromString("_ring")) &&
            (s_dtype = PyUnicode_InternFromString("dtype")) && (s_is_cpu = PyUnicode_InternFromString("is_cpu")) &&
            (s_nbytes = PyUnicode_InternFromString("nbytes")) && (s_shape = PyUnicode_InternFromString("shape")) &&
            (s_data_ptr = PyUnicode_InternFromString("data_ptr")) &&
            (s_is_contiguous = PyUnicode_InternFromString("is_contiguous")) &&
            (s_op = PyUnicode_InternFromString("op")) && (s_async_op = PyUnicode_InternFromString("async_op")) &&
            (s_out = PyUnicode_InternFromString("out")) && (s_sizes = PyUnicode_InternFromString("sizes")))
               ? 0
               : -1;
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

PyMODINIT_FUNC PyInit__mpi_fast(void) {
    if (intern_names() < 0 || PyType_Ready(&FastType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    Py_INCREF(&FastType);
    if (PyModule_AddObject(m, "Fast", (PyObject *)&FastType) < 0) {
        Py_DECREF(&FastType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

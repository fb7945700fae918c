/* The MPI calls under hpdl's fast paths (hpdl/comm/mpi_calls.py), compiled against the MPI that mpi4py runs on.

   Why: mpi4py turns every argument into an MPI message in Python objects (a list, a buffer, a Request), about
   a microsecond per call, which is most of a small collective's time. These functions take the handles and
   the address directly, start the nonblocking operation, test it while the GIL is released for at most
   `wait` seconds and return None when it completed, or an mpi4py Request for the caller's bounded wait. They
   check nothing that the caller does not already check: mpi_calls.py decides whether this module matches the
   running MPI (the same predefined handles) before anything calls it. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <limits.h>
#include <mpi.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static PyObject *request_fromhandle; /* mpi4py.MPI.Request.fromhandle */
static PyObject *error_class;        /* mpi4py.MPI.Exception */

/* Tests at full speed before the wait yields the core between tests. Short: with more ranks than free cores (a lab's
   4 ranks on a 2-core laptop) a rank that spins holds the core its partner needs to answer. 4 ranks on 2 cores, a 4 B
   allreduce back to back: 35.8 us with 20 us of spinning, 14-15 us with 2, 12 us with none (mpi4py's blocking call
   10-12 us); on 2 ranks, 4 B to 4 MiB, no difference beyond the noise. */
#define SPIN_SECONDS 2e-6
#define HOLD_TESTS 64      /* tests before a wait releases the GIL (a few us: a small message's answer) */

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

/* ------------------------------------------------------------------ pairs

   On a communicator of two ranks a small collective is one message each way: MPICH's nonblocking collectives
   (which the bounded wait needs) cost 0.4-0.7 us more than their blocking twins below 16 KiB, and a pair of
   Isend/Irecv costs less than either (2-rank VM, C loop: a 4-byte allreduce 0.51 us as messages, 0.54 us
   MPI_Allreduce, 0.91 us MPI_Iallreduce; a 4 KiB one 1.71 / 3.21 / 2.85 us). `Pair` holds the messages' own
   communicator (a duplicate, so that no user message can match them); its calls mirror the module's (each
   collective's messages tagged with its number in the pair's own count, which both ranks keep in step: a
   message of one collective never completes another, also where a receive is posted only after a probe),
   start both messages, test them for up to `wait` seconds and return None when done or a `Pending` (its
   `Test()` for the caller's bounded wait). The reduction is `reduce_local` (a float sum compiled here, else
   MPI_Reduce_local) with the same MPI op, on operands every predefined op takes commutatively: both ranks compute
   the same bits.

   A message of the wrong length (ranks that passed different sizes) is caught on the spot: the receiver of a
   shorter one sees its length, the receiver of a longer one MPI's truncation; `mismatch(kind, mine, got)`
   (got -1: longer) raises the caller's error. */

enum { ALLREDUCE, ALLGATHER, REDUCE_SCATTER, BROADCAST, KINDS };
static PyObject *s_kind_names[KINDS];

typedef struct {
    MPI_Request recv, send; /* MPI_REQUEST_NULL once complete (or not posted) */
    int kind;
    long long expected; /* bytes the receive must bring; -1: nothing received */
    long long received; /* bytes it brought; -1: more than expected (truncated) */
    int error;          /* an MPI error other than truncation, else MPI_SUCCESS */
    void *scratch;      /* where the peer's operand arrives (allreduce, reduce_scatter); see `owned` */
    int owned;          /* whether `scratch` is this exchange's own (freed with it), not the Pair's */
    void *target;       /* reduced into: the allreduce's buffer, the reduce_scatter's output */
    const void *own;    /* reduce_scatter: this rank's block of the input, copied to `target` before reducing */
    int count;
    MPI_Datatype type;
    MPI_Op op;
    int probing;    /* the receive is posted only once a matched probe has told the message's length */
    void *recv_at;  /* (probing) where it lands when it fits */
    void *overflow; /* (probing) a longer message's own buffer, freed with the exchange */
    MPI_Comm comm;
    int peer, tag, rank, probe;
    int step, steps;          /* an allreduce on 2^steps ranks: recursive doubling, partner rank ^ 2^step */
    long long bad_received;   /* the first step's message of the wrong length (its bytes; -1 longer), or -2 */
    int bad_peer;
} Exchange;

typedef struct {
    PyObject_HEAD MPI_Comm comm;
    int rank, size;     /* size: 2, or (allreduce only) a larger power of two */
    int probe;          /* receive after a matched probe: Open MPI 5.0.11 writes a longer message past the buffer */
    long long tag_span; /* tags count this pair's collectives modulo MPI_TAG_UB + 1 */
    unsigned long long started; /* collectives started: both ranks start the same ones in the same order */
    void *scratch;
    size_t scratch_size;
    PyObject *mismatch;
    PyObject *comm_obj; /* the mpi4py communicator: freed when the pair and every collective in flight are gone
                           (a receive that waits for its probe needs the communicator) */
} Pair;

typedef struct {
    PyObject_HEAD Exchange x;
    int finished;
    Pair *pair; /* (kept alive: its communicator, its mismatch) */
} Pending;

static PyTypeObject PendingType;

static void exchange_init(Exchange *x, int kind) {
    memset(x, 0, sizeof(*x));
    x->recv = x->send = MPI_REQUEST_NULL;
    x->kind = kind;
    x->expected = -1;
    x->error = MPI_SUCCESS;
    x->steps = 1;
    x->bad_received = -2;
}

#define SCRATCH_KEPT (1 << 20) /* bytes: a larger scratch buffer is the exchange's own, freed when it completes */

/* The scratch buffer of `x`: the pair's (kept between calls; the exchange takes it along if it outlives the call
   that started it), or, above SCRATCH_KEPT, the exchange's own. */
static void *pair_scratch(Pair *pair, Exchange *x, size_t nbytes) {
    if (nbytes > SCRATCH_KEPT) {
        x->owned = 1;
        x->scratch = malloc(nbytes);
        if (x->scratch == NULL) PyErr_NoMemory();
        return x->scratch;
    }
    if (pair->scratch == NULL || pair->scratch_size < nbytes) {
        free(pair->scratch);
        pair->scratch_size = nbytes < 4096 ? 4096 : nbytes;
        pair->scratch = malloc(pair->scratch_size);
        if (pair->scratch == NULL) {
            pair->scratch_size = 0;
            PyErr_NoMemory();
        }
    }
    return x->scratch = pair->scratch;
}

/* The pair's reduction, `inout` (op)= `in`: a float or double sum as a loop the compiler vectorises (MPICH 5.0.2's
   MPI_Reduce_local adds one element at a time: 1 MiB of float32 in 84 us, against 13 us for torch's add), every
   other op and type MPI's own. A sum of two operands is one IEEE addition per element either way: the same bits. */
#define SUM_INTO(T)                                                                    \
    static void sum_into_##T(const T *restrict in, T *restrict inout, int count) {    \
        for (int i = 0; i < count; i++) inout[i] += in[i];                             \
    }
SUM_INTO(float)
SUM_INTO(double)

static int reduce_local(const void *in, void *inout, int count, MPI_Datatype type, MPI_Op op) {
    if (op == MPI_SUM && type == MPI_FLOAT)
        sum_into_float(in, inout, count);
    else if (op == MPI_SUM && type == MPI_DOUBLE)
        sum_into_double(in, inout, count);
    else
        return MPI_Reduce_local(in, inout, count, type, op);
    return MPI_SUCCESS;
}

static int is_truncation(int rc) {
    int cls = rc;
    MPI_Error_class(rc, &cls);
    return cls == MPI_ERR_TRUNCATE;
}

/* Test both messages once: 1 when both are complete. */
static int exchange_test_step(Exchange *x) {
    int flag = 0;
    if (x->probing) {
        MPI_Message message;
        MPI_Status status;
        int rc = MPI_Improbe(x->peer, x->tag, x->comm, &flag, &message, &status);
        if (rc != MPI_SUCCESS || flag) x->probing = 0;
        if (rc != MPI_SUCCESS && x->error == MPI_SUCCESS) x->error = rc;
        if (rc == MPI_SUCCESS && flag) {
            int bytes = 0;
            void *into = x->recv_at;
            MPI_Get_count(&status, MPI_BYTE, &bytes);
            if (bytes > x->expected) into = x->overflow = malloc((size_t)bytes);
            rc = bytes > x->expected && into == NULL ? MPI_ERR_NO_MEM : MPI_Imrecv(into, bytes, MPI_BYTE, &message,
                                                                                   &x->recv);
            if (rc != MPI_SUCCESS && x->error == MPI_SUCCESS) x->error = rc;
        }
    }
    if (x->recv != MPI_REQUEST_NULL) {
        MPI_Status status;
        int rc = MPI_Test(&x->recv, &flag, &status);
        if (rc != MPI_SUCCESS) {
            x->recv = MPI_REQUEST_NULL; /* (a failed request is freed by MPI: nothing can write any more) */
            if (is_truncation(rc))
                x->received = -1;
            else if (x->error == MPI_SUCCESS)
                x->error = rc;
        } else if (flag) {
            int bytes = 0;
            MPI_Get_count(&status, MPI_BYTE, &bytes);
            x->received = bytes;
        }
    }
    if (x->send != MPI_REQUEST_NULL) {
        int rc = MPI_Test(&x->send, &flag, MPI_STATUS_IGNORE);
        if (rc != MPI_SUCCESS) {
            x->send = MPI_REQUEST_NULL;
            if (x->error == MPI_SUCCESS) x->error = rc;
        }
    }
    return !x->probing && x->recv == MPI_REQUEST_NULL && x->send == MPI_REQUEST_NULL;
}

/* Post one step's messages: the receive (at once, or after its probe), then the send. MPI's return code. */
static int exchange_post(Exchange *x, void *recv_at, const void *send_from, int send_count, int to_peer,
                         int from_peer) {
    int rc = MPI_SUCCESS;
    if (from_peer && x->probe) {
        x->probing = 1;
        x->recv_at = recv_at;
    } else if (from_peer) {
        int element = 0;
        MPI_Type_size(x->type, &element);
        rc = MPI_Irecv(recv_at, (int)(x->expected / (element ? element : 1)), x->type, x->peer, x->tag, x->comm,
                       &x->recv);
    }
    if (rc == MPI_SUCCESS && to_peer) {
        rc = MPI_Isend(send_from, send_count, x->type, x->peer, x->tag, x->comm, &x->send);
        if (rc != MPI_SUCCESS && x->recv != MPI_REQUEST_NULL) { /* nothing may arrive in the scratch later */
            MPI_Cancel(&x->recv);
            MPI_Wait(&x->recv, MPI_STATUS_IGNORE);
        }
    }
    return rc;
}

/* Test the exchange once: 1 when complete. An allreduce on more than two ranks reduces each step's message as
   it completes and starts the next step; a message of the wrong length is remembered (the first), and the
   steps go on with this rank's own values, so that every rank finishes the collective (the caller raises). */
static int exchange_test(Exchange *x) {
    for (;;) {
        int done = exchange_test_step(x);
        if (!done || x->step + 1 >= x->steps || x->error != MPI_SUCCESS) return done;
        if (x->received != x->expected && x->bad_received == -2) {
            x->bad_received = x->received;
            x->bad_peer = x->peer;
        } else if (x->received == x->expected && x->count) {
            int rc = reduce_local(x->scratch, x->target, x->count, x->type, x->op);
            if (rc != MPI_SUCCESS) x->error = rc;
        }
        free(x->overflow);
        x->overflow = NULL;
        x->step++;
        x->peer = x->rank ^ (1 << x->step);
        int rc = exchange_post(x, x->scratch, x->target, x->count, 1, 1);
        if (rc != MPI_SUCCESS && x->error == MPI_SUCCESS) x->error = rc;
    }
}

/* Test for up to `wait` seconds, the GIL released after the first test: 1 when complete. */
static int exchange_wait(Exchange *x, double wait) {
    int done = exchange_test(x);
    for (int i = 0; !done && wait > 0 && i < HOLD_TESTS; i++) done = exchange_test(x);
    if (!done && wait > 0) {
        Py_BEGIN_ALLOW_THREADS double start = now(), spent = 0;
        while (!done && spent < wait) {
            if (spent > SPIN_SECONDS) sched_yield();
            done = exchange_test(x);
            spent = now() - start;
        }
        Py_END_ALLOW_THREADS
    }
    return done;
}

/* After completion: check the length, reduce. 0, or -1 with the caller's error raised. */
static int exchange_finish(Exchange *x, PyObject *mismatch) {
    if (x->error != MPI_SUCCESS) {
        mpi_error(x->error);
        return -1;
    }
    if (x->expected >= 0 && (x->bad_received != -2 || x->received != x->expected)) {
        int first = x->bad_received != -2;
        PyObject *done = PyObject_CallFunction(mismatch, "OLLi", s_kind_names[x->kind], x->expected,
                                               first ? x->bad_received : x->received, first ? x->bad_peer : x->peer);
        Py_XDECREF(done);
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "hpdl._mpi_fast: a message of the wrong length");
        return -1;
    }
    if (x->kind == REDUCE_SCATTER && x->target != x->own)
        memmove(x->target, x->own, (size_t)x->expected);
    if (x->kind == ALLREDUCE || x->kind == REDUCE_SCATTER) {
        int rc = x->count ? reduce_local(x->scratch, x->target, x->count, x->type, x->op) : MPI_SUCCESS;
        if (rc != MPI_SUCCESS) {
            mpi_error(rc);
            return -1;
        }
    }
    return 0;
}

static void exchange_release(Exchange *x) {
    if (x->recv == MPI_REQUEST_NULL) free(x->overflow); /* (still receiving: MPI may write; kept) */
    x->overflow = NULL;
    if (x->owned && x->recv == MPI_REQUEST_NULL) free(x->scratch);
    x->scratch = NULL;
    x->owned = 0;
}

/* Start the messages of collective `kind` (the caller filled the exchange's operands): the receive first. */
static int exchange_start(Pair *pair, Exchange *x, void *recv_at, const void *send_from, int send_count, int to_peer,
                          int from_peer) {
    x->comm = pair->comm;
    x->rank = pair->rank;
    x->peer = pair->rank ^ 1;
    x->probe = pair->probe;
    x->tag = (int)(pair->started++ % (unsigned long long)pair->tag_span);
    return exchange_post(x, recv_at, send_from, send_count, to_peer, from_peer);
}

/* None when the exchange completed within `wait` seconds (finished), else a Pending that owns it; NULL on error. */
static PyObject *exchange_outcome(Pair *pair, Exchange *x, int started, double wait) {
    if (started != MPI_SUCCESS) {
        exchange_release(x);
        return mpi_error(started);
    }
    if (wait >= 0 && exchange_wait(x, wait)) {
        int rc = exchange_finish(x, pair->mismatch);
        exchange_release(x);
        if (rc < 0) return NULL;
        Py_RETURN_NONE;
    }
    Pending *pending = PyObject_New(Pending, &PendingType);
    if (pending == NULL) return NULL;
    pending->x = *x;
    if (!x->owned && x->scratch != NULL && x->scratch == pair->scratch) { /* it takes the pair's scratch along */
        pending->x.owned = 1;
        pair->scratch = NULL;
        pair->scratch_size = 0;
    }
    pending->finished = 0;
    Py_INCREF(pair);
    pending->pair = pair;
    return (PyObject *)pending;
}

static PyObject *pending_test(Pending *self, PyObject *unused) {
    if (self->finished) Py_RETURN_TRUE;
    if (!exchange_test(&self->x)) Py_RETURN_FALSE;
    self->finished = 1; /* (an error is raised once; the handle is then done) */
    int rc = exchange_finish(&self->x, self->pair->mismatch);
    exchange_release(&self->x);
    if (rc < 0) return NULL;
    Py_RETURN_TRUE;
}

static void pending_dealloc(Pending *self) {
    if (!self->finished && !self->x.probing) exchange_test_step(&self->x); /* the last look: completed messages
                                                                                 free their buffers (nothing newly
                                                                                 posted) */
    exchange_release(&self->x);
    Py_CLEAR(self->pair);
    PyObject_Free(self);
}

static PyMethodDef pending_methods[] = {
    {"Test", (PyCFunction)pending_test, METH_NOARGS,
     "Test()\n--\n\nWhether both messages completed (then the result is in place; a wrong length raises)."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject PendingType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "hpdl.comm._mpi_fast.Pending",
    .tp_basicsize = sizeof(Pending),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_dealloc = (destructor)pending_dealloc,
    .tp_methods = pending_methods,
    .tp_doc = "A pair's collective still in flight: Test() until True (the caller's bounded wait).",
};

/* The kinds' starts: fill the exchange, post the messages. */
static int pair_allreduce(Pair *pair, Exchange *x, void *address, long long nbytes, int count, MPI_Datatype type,
                          MPI_Op op) {
    exchange_init(x, ALLREDUCE);
    for (int n = pair->size; n > 2; n >>= 1) x->steps++;
    x->expected = nbytes;
    x->count = count;
    x->type = type;
    x->op = op;
    x->target = address;
    if (pair_scratch(pair, x, (size_t)nbytes) == NULL) return -1;
    return exchange_start(pair, x, x->scratch, address, count, 1, 1);
}

static int pair_allgather(Pair *pair, Exchange *x, const void *send, char *out, long long nbytes, int count,
                          MPI_Datatype type) {
    char *mine = out + nbytes * pair->rank, *theirs = out + nbytes * (1 - pair->rank);
    exchange_init(x, ALLGATHER);
    x->expected = nbytes;
    x->type = type;
    if (send == NULL || send == mine || !nbytes) return exchange_start(pair, x, theirs, mine, count, 1, 1);
    const char *from = send;
    if (from + nbytes > out && from < out + 2 * nbytes) { /* the input overlaps the output: copy, then send */
        memmove(mine, send, (size_t)nbytes);
        return exchange_start(pair, x, theirs, mine, count, 1, 1);
    }
    /* Sent from the input itself, and copied into place while the message travels (2 ranks, back to back, each
       way: 64 KiB 16.5 -> 8.1 us, 1 MiB 231-257 -> 181-204 us, against copying first and sending the copy). */
    int rc = exchange_start(pair, x, theirs, send, count, 1, 1);
    memmove(mine, send, (size_t)nbytes);
    return rc;
}

static int pair_reduce_scatter(Pair *pair, Exchange *x, const char *address, void *out, long long nbytes, int count,
                               MPI_Datatype type, MPI_Op op) {
    const char *at = out;
    exchange_init(x, REDUCE_SCATTER);
    x->expected = nbytes;
    x->count = count;
    x->type = type;
    x->op = op;
    x->target = out;
    x->own = address + nbytes * pair->rank;
    if (at + nbytes <= address || at >= address + 2 * nbytes) {
        /* an output apart from the input: the peer's block arrives in it and this rank's is reduced into it (no
           scratch, no copy) */
        x->scratch = (void *)x->own;
        x->own = out;
        return exchange_start(pair, x, out, address + nbytes * (1 - pair->rank), count, 1, 1);
    }
    if (pair_scratch(pair, x, (size_t)nbytes) == NULL) return -1;
    return exchange_start(pair, x, x->scratch, address + nbytes * (1 - pair->rank), count, 1, 1);
}

static int pair_broadcast(Pair *pair, Exchange *x, void *address, long long nbytes, int count, MPI_Datatype type,
                          int root) {
    exchange_init(x, BROADCAST);
    x->type = type;
    if (root != pair->rank) x->expected = nbytes;
    return exchange_start(pair, x, address, address, count, root == pair->rank, root != pair->rank);
}

/* Pair(comm, rank, size, tag_span, mismatch, probe): `comm` an mpi4py communicator of its own (a duplicate), which
   the pair frees; `size` 2, or a larger power of two (then only its allreduce may be called) */
static int pair_init(Pair *self, PyObject *args, PyObject *kwds) {
    PyObject *comm, *mismatch;
    int rank, size, probe;
    long long span;
    if (!PyArg_ParseTuple(args, "OiiLOp", &comm, &rank, &size, &span, &mismatch, &probe)) return -1;
    if (size < 2 || (size & (size - 1)) || rank < 0 || rank >= size || span < 1) {
        PyErr_SetString(PyExc_ValueError,
                        "hpdl._mpi_fast.Pair: a rank of a power-of-two size from 2, and a positive tag span");
        return -1;
    }
    if (self->comm_obj != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "hpdl._mpi_fast.Pair: already initialised");
        return -1;
    }
    PyObject *handle_obj = PyObject_GetAttrString(comm, "handle");
    if (handle_obj == NULL) return -1;
    self->comm = (MPI_Comm)handle(handle_obj);
    Py_DECREF(handle_obj);
    Py_INCREF(comm);
    self->comm_obj = comm;
    self->rank = rank;
    self->size = size;
    self->probe = probe;
    self->tag_span = span;
    Py_INCREF(mismatch);
    Py_XSETREF(self->mismatch, mismatch);
    return PyErr_Occurred() ? -1 : 0;
}

static void pair_dealloc(Pair *self) {
    int finalized = 1;
    MPI_Finalized(&finalized);
    if (self->comm_obj != NULL && !finalized) {
        PyObject *type, *value, *traceback;
        PyErr_Fetch(&type, &value, &traceback);
        PyObject *done = PyObject_CallMethod(self->comm_obj, "Free", NULL);
        if (done == NULL) PyErr_Clear(); /* (a communicator MPI already freed: nothing left to do) */
        Py_XDECREF(done);
        PyErr_Restore(type, value, traceback);
    }
    Py_CLEAR(self->comm_obj);
    free(self->scratch);
    Py_CLEAR(self->mismatch);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

#define PAIR_READY                                                                           \
    if (self->mismatch == NULL) {                                                            \
        PyErr_SetString(PyExc_RuntimeError, "hpdl._mpi_fast.Pair: not initialised");        \
        return NULL;                                                                         \
    }

/* allreduce(address, nbytes, datatype, op, wait) */
static PyObject *pair_allreduce_py(Pair *self, PyObject *const *args, Py_ssize_t nargs) {
    ARGS(5);
    PAIR_READY;
    void *address = PyLong_AsVoidPtr(args[0]);
    MPI_Datatype type = (MPI_Datatype)handle(args[2]);
    int count = count_of(args[1], type);
    double wait = PyFloat_AsDouble(args[4]);
    Exchange x;
    if (count < 0 || PyErr_Occurred()) return NULL;
    int rc = pair_allreduce(self, &x, address, PyLong_AsLongLong(args[1]), count, type, (MPI_Op)handle(args[3]));
    return rc < 0 ? NULL : exchange_outcome(self, &x, rc, wait);
}

/* allgather(send_address or 0 for in place, out_address, nbytes per rank, datatype, wait) */
static PyObject *pair_allgather_py(Pair *self, PyObject *const *args, Py_ssize_t nargs) {
    ARGS(5);
    PAIR_READY;
    void *send = PyLong_AsVoidPtr(args[0]), *out = PyLong_AsVoidPtr(args[1]);
    MPI_Datatype type = (MPI_Datatype)handle(args[3]);
    int count = count_of(args[2], type);
    double wait = PyFloat_AsDouble(args[4]);
    Exchange x;
    if (count < 0 || PyErr_Occurred()) return NULL;
    int rc = pair_allgather(self, &x, send, out, PyLong_AsLongLong(args[2]), count, type);
    return exchange_outcome(self, &x, rc, wait);
}

/* reduce_scatter(address, out_address, nbytes per rank, datatype, op, wait) */
static PyObject *pair_reduce_scatter_py(Pair *self, PyObject *const *args, Py_ssize_t nargs) {
    ARGS(6);
    PAIR_READY;
    void *address = PyLong_AsVoidPtr(args[0]), *out = PyLong_AsVoidPtr(args[1]);
    MPI_Datatype type = (MPI_Datatype)handle(args[3]);
    int count = count_of(args[2], type);
    double wait = PyFloat_AsDouble(args[5]);
    Exchange x;
    if (count < 0 || PyErr_Occurred()) return NULL;
    int rc = pair_reduce_scatter(self, &x, address, out, PyLong_AsLongLong(args[2]), count, type,
                                 (MPI_Op)handle(args[4]));
    return rc < 0 ? NULL : exchange_outcome(self, &x, rc, wait);
}

/* broadcast(address, nbytes, datatype, root, wait) */
static PyObject *pair_broadcast_py(Pair *self, PyObject *const *args, Py_ssize_t nargs) {
    ARGS(5);
    PAIR_READY;
    void *address = PyLong_AsVoidPtr(args[0]);
    MPI_Datatype type = (MPI_Datatype)handle(args[2]);
    int count = count_of(args[1], type);
    int root = (int)PyLong_AsLong(args[3]);
    double wait = PyFloat_AsDouble(args[4]);
    Exchange x;
    if (count < 0 || PyErr_Occurred()) return NULL;
    int rc = pair_broadcast(self, &x, address, PyLong_AsLongLong(args[1]), count, type, root);
    return exchange_outcome(self, &x, rc, wait);
}

static PyMethodDef pair_methods[] = {
    {"allreduce", (PyCFunction)(void (*)(void))pair_allreduce_py, METH_FASTCALL,
     "allreduce(address, nbytes, datatype, op, wait): in place; None when done, else a Pending"},
    {"allgather", (PyCFunction)(void (*)(void))pair_allgather_py, METH_FASTCALL,
     "allgather(send_address or 0 (in place), out_address, nbytes per rank, datatype, wait)"},
    {"reduce_scatter", (PyCFunction)(void (*)(void))pair_reduce_scatter_py, METH_FASTCALL,
     "reduce_scatter(address, out_address, nbytes per rank, datatype, op, wait)"},
    {"broadcast", (PyCFunction)(void (*)(void))pair_broadcast_py, METH_FASTCALL,
     "broadcast(address, nbytes, datatype, root, wait)"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject PairType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "hpdl.comm._mpi_fast.Pair",
    .tp_basicsize = sizeof(Pair),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)pair_init,
    .tp_dealloc = (destructor)pair_dealloc,
    .tp_methods = pair_methods,
    .tp_doc = "Pair(comm, rank, size, tag_span, mismatch, probe): a two-rank communicator's collectives as "
              "messages (see hpdl/comm/pairs.py).",
};

/* ------------------------------------------------------------------ the shared state

   `State` is what the blocking fast paths below and the communicator's Python share, by contract: one object per
   communicator (MpiCommunicator._state), whose fields both sides read and write by these names. Python's side of
   the contract, with what each field means and who writes it, is hpdl/comm/fast_state.py (FIELDS, and a Python
   class with the same fields for a process without this module); tests/test_compiled.py checks that the two list
   the same fields and that the compiled paths take calls. A field renamed on one side only is an AttributeError
   at the communicator's start, not a silent slow path. */

typedef struct {
    PyObject_HEAD long long seq; /* the communicator's collectives so far (its last sequence number) */
    long long every;             /* the agreement check's period (0: off) */
    PyObject *ring;              /* the agreement ring: a list of `every` ints (agreement.Ledger.ring) */
    PyObject *pair;              /* the two-rank messages' Pair, or None */
    char plain;                  /* fast calls allowed: neither debug nor tracing nor closed */
    double fast_below[KINDS];    /* per operation, the bytes from which a call leaves the fast path */
    double pair_below[KINDS];    /* per operation, the bytes each way below which it travels as the pair's messages */
} State;

static int state_traverse(State *self, visitproc visit, void *arg) {
    Py_VISIT(self->ring);
    Py_VISIT(self->pair);
    return 0;
}

static int state_clear(State *self) {
    Py_CLEAR(self->ring);
    Py_CLEAR(self->pair);
    return 0;
}

static void state_dealloc(State *self) {
    PyObject_GC_UnTrack(self);
    state_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

#define BELOW(name, array, kind) {name, T_DOUBLE, offsetof(State, array) + (kind) * sizeof(double), 0, NULL}
static PyMemberDef state_members[] = {
    {"seq", T_LONGLONG, offsetof(State, seq), 0, NULL},
    {"every", T_LONGLONG, offsetof(State, every), 0, NULL},
    {"ring", T_OBJECT, offsetof(State, ring), 0, NULL},
    {"pair", T_OBJECT, offsetof(State, pair), 0, NULL},
    {"plain", T_BOOL, offsetof(State, plain), 0, NULL},
    BELOW("fast_allreduce_below", fast_below, ALLREDUCE),
    BELOW("fast_allgather_below", fast_below, ALLGATHER),
    BELOW("fast_reduce_scatter_below", fast_below, REDUCE_SCATTER),
    BELOW("fast_broadcast_below", fast_below, BROADCAST),
    BELOW("pair_allreduce_below", pair_below, ALLREDUCE),
    BELOW("pair_allgather_below", pair_below, ALLGATHER),
    BELOW("pair_reduce_scatter_below", pair_below, REDUCE_SCATTER),
    BELOW("pair_broadcast_below", pair_below, BROADCAST),
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject StateType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "hpdl.comm._mpi_fast.State",
    .tp_basicsize = sizeof(State),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_dealloc = (destructor)state_dealloc,
    .tp_traverse = (traverseproc)state_traverse,
    .tp_clear = (inquiry)state_clear,
    .tp_members = state_members,
    .tp_doc = "State(): what a communicator's compiled and Python fast paths share (see hpdl/comm/fast_state.py).",
};

/* ------------------------------------------------------------------ the agreement entry

   One collective as one int for the agreement check's ring: code | bytes << 32 | (extra + 1) << 80. The only
   place in C that encodes it; Python's is hpdl.comm.agreement.entry (tests/test_compiled.py compares the two
   through `agreement_entry` below). */

static PyObject *shift80; /* 1 << 80: the count field of extra 0, the common case */

static PyObject *entry_of(long long code, long long nbytes, long long extra) {
    PyObject *low = NULL, *count = NULL;
    if (nbytes >= 0 && nbytes < (1LL << 32)) /* (the fast paths' sizes: below 2 GiB) */
        low = PyLong_FromUnsignedLongLong((unsigned long long)code | (unsigned long long)nbytes << 32);
    else {
        PyObject *n = PyLong_FromLongLong(nbytes), *shift = PyLong_FromLong(32), *c = PyLong_FromLongLong(code);
        PyObject *high = (n && shift) ? PyNumber_Lshift(n, shift) : NULL;
        low = (high && c) ? PyNumber_Or(high, c) : NULL;
        Py_XDECREF(n);
        Py_XDECREF(shift);
        Py_XDECREF(c);
        Py_XDECREF(high);
    }
    if (low != NULL && extra == 0) {
        Py_INCREF(shift80);
        count = shift80;
    } else if (low != NULL) {
        PyObject *e = PyLong_FromLongLong(extra + 1), *shift = PyLong_FromLong(80);
        count = (e && shift) ? PyNumber_Lshift(e, shift) : NULL;
        Py_XDECREF(e);
        Py_XDECREF(shift);
    }
    PyObject *entry = (low && count) ? PyNumber_Or(low, count) : NULL;
    Py_XDECREF(low);
    Py_XDECREF(count);
    return entry;
}

/* agreement_entry(code, nbytes, extra): the entry as this module writes it (for the test that compares) */
static PyObject *agreement_entry(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    ARGS(3);
    long long code = PyLong_AsLongLong(args[0]), nbytes = PyLong_AsLongLong(args[1]), extra = PyLong_AsLongLong(args[2]);
    if (PyErr_Occurred()) return NULL;
    return entry_of(code, nbytes, extra);
}

/* ------------------------------------------------------------------ the blocking fast paths

   `Fast` holds one communicator's blocking fast paths for allreduce, allgather, reduce_scatter and broadcast:
   the same checks, numbering, progress post and agreement entry as MpiCommunicator's Python fast paths
   (hpdl/comm/mpi_fast_paths.py, which stay the reference, and which take every call this code does not:
   async_op, debug, tracing, other dtypes or devices, out=None, sizes above the thresholds), without a Python
   frame. A call it does not take goes, with its arguments unchanged, to the Python method. The communicator's
   changing state (plain, seq, every, ring, the per-operation size limits, the pair) is read from its `State` on
   every call, so nothing is cached that Python could change. `taken()` counts the calls it took, per operation:
   the test that the compiled path still takes calls reads it. */

#define MAX_DTYPES 24
#define MAX_OPS 4
#define MAX_ROOTS 64

typedef struct {
    PyObject_HEAD State *state; /* what the communicator's Python shares with this code (see State) */
    PyObject *python[KINDS];    /* the Python fast paths, bound */
    PyObject *slow;               /* comm._fast_slow(op, seq, keep, request, code): the bounded wait, or the error */
    PyObject *check;              /* agreement.check bound to the communicator: check(seq) */
    PyObject *tensor_type;
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
    long long entry_key[KINDS][3]; /* per operation, the last agreement entry's (code, bytes, extra) */
    PyObject *entry[KINDS];        /* and the entry: a loop's calls repeat it (three big-int operations less) */
    unsigned long long taken[KINDS]; /* calls this code took, per operation */
    PyObject *peer_python[2];        /* send, recv: the Python fast paths, bound (add_peer_paths; else NULL) */
    PyObject *peer_finish;           /* comm._peer_finish: a send's or recv's bounded wait, or its error */
    unsigned long long peer_taken[2];
} Fast;

static PyObject *s_root, *s_tag, *s_dtype, *s_is_cpu, *s_nbytes, *s_shape, *s_data_ptr, *s_is_contiguous, *s_op, *s_async_op,
    *s_out, *s_sizes;

static int fast_traverse(Fast *self, visitproc visit, void *arg) {
    Py_VISIT(self->state);
    for (int i = 0; i < KINDS; i++) Py_VISIT(self->python[i]);
    Py_VISIT(self->slow);
    Py_VISIT(self->check);
    for (int i = 0; i < 2; i++) Py_VISIT(self->peer_python[i]);
    Py_VISIT(self->peer_finish);
    return 0;
}

static int fast_clear(Fast *self) {
    Py_CLEAR(self->state);
    for (int i = 0; i < KINDS; i++) Py_CLEAR(self->python[i]);
    Py_CLEAR(self->slow);
    Py_CLEAR(self->check);
    for (int i = 0; i < 2; i++) Py_CLEAR(self->peer_python[i]);
    Py_CLEAR(self->peer_finish);
    return 0;
}

static void fast_dealloc(Fast *self) {
    PyObject_GC_UnTrack(self);
    fast_clear(self);
    Py_CLEAR(self->tensor_type);
    for (int i = 0; i < self->ndtypes; i++) Py_CLEAR(self->dtypes[i]);
    for (int i = 0; i < MAX_OPS; i++) Py_CLEAR(self->op_names[i]);
    for (int i = 0; i < KINDS; i++) Py_CLEAR(self->entry[i]);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Fast(state, handle, rank, size, board_address, tensor_type, progress_codes, python_methods, slow, check) */
static int fast_init(Fast *self, PyObject *args, PyObject *kwds) {
    PyObject *state, *handle_obj, *board, *tensor_type, *codes, *methods, *slow, *check;
    int rank, size;
    if (!PyArg_ParseTuple(args, "O!OiiOOO!O!OO", &StateType, &state, &handle_obj, &rank, &size, &board, &tensor_type,
                          &PyTuple_Type, &codes, &PyTuple_Type, &methods, &slow, &check))
        return -1;
    if (PyTuple_GET_SIZE(codes) != KINDS || PyTuple_GET_SIZE(methods) != KINDS) {
        PyErr_SetString(PyExc_ValueError, "hpdl._mpi_fast.Fast: one code and one method per operation");
        return -1;
    }
    if (self->state != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "hpdl._mpi_fast.Fast: already initialised");
        return -1;
    }
    Py_INCREF(state);
    self->state = (State *)state;
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
    return PyErr_Occurred() ? -1 : 0;
}

/* taken() -> {operation: calls}: the calls this code took (not handed to the Python method) */
static PyObject *fast_taken(Fast *self, PyObject *unused) {
    PyObject *out = PyDict_New();
    for (int i = 0; out != NULL && i < KINDS; i++) {
        PyObject *n = PyLong_FromUnsignedLongLong(self->taken[i]);
        if (n == NULL || PyDict_SetItem(out, s_kind_names[i], n) < 0) Py_CLEAR(out);
        Py_XDECREF(n);
    }
    for (int i = 0; out != NULL && i < 2; i++) {
        PyObject *n = PyLong_FromUnsignedLongLong(self->peer_taken[i]);
        if (n == NULL || PyDict_SetItemString(out, i ? "recv" : "send", n) < 0) Py_CLEAR(out);
        Py_XDECREF(n);
    }
    return out;
}

/* add_peer_paths(send, recv or None, finish): take blocking sends (and receives, where `recv` is given) too;
   `send`/`recv` the Python fast paths (every call not taken goes there), `finish(kind, peer, tag, tensor, request,
   code, got)` the bounded wait of one still running after the short wait, or its error. */
static PyObject *fast_add_peer_paths(Fast *self, PyObject *const *args, Py_ssize_t nargs) {
    ARGS(3);
    for (int i = 0; i < 2; i++) {
        PyObject *method = args[i] == Py_None ? NULL : args[i];
        Py_XINCREF(method);
        Py_XSETREF(self->peer_python[i], method);
    }
    Py_INCREF(args[2]);
    Py_XSETREF(self->peer_finish, args[2]);
    Py_RETURN_NONE;
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

/* Whether the communicator takes fast calls now (plain) and `nbytes` is below this operation's limit. */
static int open_for(Fast *self, int kind, double nbytes) {
    return self->state->plain && nbytes < self->state->fast_below[kind] && nbytes < 2147483648.0; /* an int count,
                                                                                                     whatever the limit says */
}

/* Number the call, post progress, record its agreement entry (entry_of) and run the check when it is due: the
   sequence number, or -1 with an exception set. */
static long long begin(Fast *self, int kind, long long code, long long nbytes, long long extra) {
    State *state = self->state;
    long long seq = ++state->seq;
    self->board[0] = seq;
    self->board[1] = self->progress_code[kind];
    long long every = state->every;
    if (every > 0) {
        PyObject *ring = state->ring;
        if (ring == NULL || !PyList_Check(ring) || PyList_GET_SIZE(ring) < every) {
            PyErr_SetString(PyExc_RuntimeError, "hpdl._mpi_fast: no agreement ring");
            return -1;
        }
        long long *key = self->entry_key[kind];
        if (self->entry[kind] == NULL || key[0] != code || key[1] != nbytes || key[2] != extra) {
            PyObject *entry = entry_of(code, nbytes, extra);
            if (entry == NULL) return -1;
            key[0] = code;
            key[1] = nbytes;
            key[2] = extra;
            Py_XSETREF(self->entry[kind], entry);
        }
        Py_INCREF(self->entry[kind]);
        PyList_SetItem(ring, (Py_ssize_t)(seq % every), self->entry[kind]); /* steals the new reference */
        if (seq % every == 0) {
            PyObject *done = PyObject_CallFunction(self->check, "L", seq);
            if (done == NULL) return -1;
            Py_DECREF(done);
        }
    }
    self->taken[kind]++;
    return seq;
}

/* After the MPI call started with `rc`: wait up to WAIT seconds; then the result (a new reference to `result`),
   or the bounded wait / error through comm._fast_slow. */
#define WAIT_SECONDS 2e-3 /* mpi_fast_paths._WAIT: the Python fast paths' own */
/* What the slow path keeps alive while MPI works: `a`, or (a, b) when `b` is given (built only then: a tuple per
   call would cost an allocation and the garbage collector's visits). */
static PyObject *keep_of(PyObject *a, PyObject *b) {
    if (b == NULL) {
        Py_INCREF(a);
        return a;
    }
    return PyTuple_Pack(2, a, b);
}

/* The bounded wait of an operation still running (`request_obj`, stolen: a Request or Pending), or the error of
   MPI code `rc` (`request_obj` None), through comm._fast_slow; then the result (a new reference). */
static PyObject *slow_path(Fast *self, int kind, long long seq, PyObject *request_obj, int rc, PyObject *keep_a,
                           PyObject *keep_b, PyObject *result) {
    PyObject *keep = keep_of(keep_a, keep_b);
    if (keep == NULL) {
        Py_DECREF(request_obj);
        return NULL;
    }
    PyObject *done = PyObject_CallFunction(self->slow, "OLNNi", s_kind_names[kind], seq, keep, request_obj, rc);
    if (done == NULL) return NULL;
    Py_DECREF(done);
    Py_INCREF(result);
    return result;
}

static PyObject *complete(Fast *self, int kind, long long seq, int rc, MPI_Request request, PyObject *keep_a,
                          PyObject *keep_b, PyObject *result) {
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
    return slow_path(self, kind, seq, request_obj, rc, keep_a, keep_b, result);
}

/* The communicator's Pair when it takes a message of `nbytes` of this kind (each way: the allreduce's buffer, an
   allgather's or reduce_scatter's block, the broadcast's buffer; the Python paths compare the same), else NULL. */
static Pair *pair_for(Fast *self, int kind, long long nbytes) {
    PyObject *pair = self->state->pair;
    if (pair == NULL || Py_TYPE(pair) != &PairType) return NULL;
    return (double)nbytes < self->state->pair_below[kind] ? (Pair *)pair : NULL;
}

/* A pair's exchange after its start (`rc`: MPI's, or -1 with an error set): as `complete`. */
static PyObject *pair_complete(Fast *self, Pair *pair, int kind, long long seq, int rc, Exchange *x,
                               PyObject *keep_a, PyObject *keep_b, PyObject *result) {
    PyObject *request_obj = Py_None;
    if (rc < 0) return NULL;
    if (rc == MPI_SUCCESS && exchange_wait(x, WAIT_SECONDS)) {
        rc = x->error;
        if (rc == MPI_SUCCESS) {
            int finished = exchange_finish(x, pair->mismatch);
            exchange_release(x);
            if (finished < 0) return NULL;
            Py_INCREF(result);
            return result;
        }
        exchange_release(x);
        Py_INCREF(request_obj);
    } else if (rc == MPI_SUCCESS) {
        request_obj = exchange_outcome(pair, x, rc, -1.0); /* a Pending */
        if (request_obj == NULL) return NULL;
    } else {
        exchange_release(x);
        Py_INCREF(request_obj);
    }
    return slow_path(self, kind, seq, request_obj, rc, keep_a, keep_b, result);
}

#define READY                                                                                   \
    if (self->state == NULL) {                                                                  \
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
    if ((values[1] != NULL && values[1] != Py_False) || !self->state->plain)
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
    Pair *pair = pair_for(self, ALLREDUCE, nbytes);
    if (pair != NULL) {
        Exchange x;
        int rc = pair_allreduce(pair, &x, (void *)(intptr_t)address, nbytes, (int)(nbytes / self->itemsize[d]),
                                self->types[d], self->ops[o]);
        return pair_complete(self, pair, ALLREDUCE, seq, rc, &x, tensor, NULL, tensor);
    }
    MPI_Request request;
    int rc = MPI_Iallreduce(MPI_IN_PLACE, (void *)(intptr_t)address, (int)(nbytes / self->itemsize[d]),
                            self->types[d], self->ops[o], self->comm, &request);
    return complete(self, ALLREDUCE, seq, rc, request, tensor, NULL, tensor);
}

/* broadcast(tensor, root=0, *, async_op=False) */
static PyObject *fast_broadcast(Fast *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    READY;
    PyObject *names[2] = {s_root, s_async_op}, *values[2] = {NULL, NULL};
    if (nargs < 1 || nargs > 2 || !keywords(args, nargs, kwnames, names, values, 2) || (nargs == 2 && values[0]))
        return python(self, BROADCAST, args, nargs, kwnames);
    PyObject *tensor = args[0], *root_obj = nargs == 2 ? args[1] : values[0];
    if ((values[1] != NULL && values[1] != Py_False) || !self->state->plain)
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
    Pair *pair = pair_for(self, BROADCAST, nbytes);
    if (pair != NULL) {
        Exchange x;
        int rc = pair_broadcast(pair, &x, (void *)(intptr_t)address, nbytes, (int)(nbytes / self->itemsize[d]),
                                self->types[d], (int)root);
        return pair_complete(self, pair, BROADCAST, seq, rc, &x, tensor, NULL, tensor);
    }
    MPI_Request request;
    int rc = MPI_Ibcast((void *)(intptr_t)address, (int)(nbytes / self->itemsize[d]), self->types[d], (int)root,
                        self->comm, &request);
    return complete(self, BROADCAST, seq, rc, request, tensor, NULL, tensor);
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
    PyObject *tensor = args[0], *sizes = values[0] == Py_None ? NULL : values[0], *out = values[1], *result = NULL;
    /* (no `sizes` with `out`: every rank's dim 0 is taken to equal this rank's, as the general path takes it) */
    if ((values[2] != NULL && values[2] != Py_False) || out == NULL ||
        (sizes != NULL && (!(PyList_CheckExact(sizes) || PyTuple_CheckExact(sizes)) ||
                           PySequence_Fast_GET_SIZE(sizes) != self->size)) ||
        !self->state->plain)
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
    for (Py_ssize_t r = 0; fits && sizes != NULL && r < self->size; r++) {
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
    int count = (int)(nbytes / self->itemsize[d]), rc;
    Pair *pair = pair_for(self, ALLGATHER, nbytes);
    if (pair != NULL) {
        Exchange x;
        rc = pair_allgather(pair, &x, in_place ? NULL : (void *)(intptr_t)mine, (char *)(intptr_t)at, nbytes, count,
                            self->types[d]);
        result = pair_complete(self, pair, ALLGATHER, seq, rc, &x, tensor, out, out);
        goto done;
    }
    MPI_Request request;
    if (in_place)
        rc = MPI_Iallgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, (void *)(intptr_t)at, count, self->types[d], self->comm,
                            &request);
    else
        rc = MPI_Iallgather((void *)(intptr_t)mine, count, self->types[d], (void *)(intptr_t)at, count, self->types[d],
                            self->comm, &request);
    result = complete(self, ALLGATHER, seq, rc, request, tensor, out, out);
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
    if ((values[2] != NULL && values[2] != Py_False) || out == NULL || !self->state->plain)
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
    Pair *pair = pair_for(self, REDUCE_SCATTER, nbytes / self->size);
    if (pair != NULL) {
        Exchange x;
        int rc = pair_reduce_scatter(pair, &x, (const char *)(intptr_t)mine, (void *)(intptr_t)at, nbytes / 2,
                                     (int)(nbytes / 2 / self->itemsize[d]), self->types[d], self->ops[o]);
        result = pair_complete(self, pair, REDUCE_SCATTER, seq, rc, &x, tensor, out, out);
        goto done;
    }
    MPI_Request request;
    int rc = MPI_Ireduce_scatter_block((void *)(intptr_t)mine, (void *)(intptr_t)at,
                                       (int)(nbytes / self->size / self->itemsize[d]), self->types[d], self->ops[o],
                                       self->comm, &request);
    result = complete(self, REDUCE_SCATTER, seq, rc, request, tensor, out, out);
done:
    Py_XDECREF(shape);
    Py_XDECREF(block);
    return result;
}

/* send(tensor, dst, *, tag=0, async_op=False) and recv(tensor, src, *, tag=0, async_op=False), blocking, to or from
   another rank of this communicator: the Python fast paths' (no sequence number, progress post or agreement entry:
   point-to-point calls have none), the message started and tested here for the short wait. */
static PyObject *fast_peer(Fast *self, int recv, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    READY;
    PyObject *python_path = self->peer_python[recv];
    if (python_path == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "hpdl._mpi_fast.Fast: no Python path for this call");
        return NULL;
    }
    PyObject *names[2] = {s_tag, s_async_op}, *values[2] = {NULL, NULL};
    if (nargs != 2 || !keywords(args, nargs, kwnames, names, values, 2) || !PyLong_CheckExact(args[1]) ||
        (values[0] != NULL && !PyLong_CheckExact(values[0])) || (values[1] != NULL && values[1] != Py_False) ||
        !self->state->plain)
        return PyObject_Vectorcall(python_path, args, nargsf, kwnames);
    PyObject *tensor = args[0];
    int overflow = 0;
    long peer = PyLong_AsLongAndOverflow(args[1], &overflow), tag = 0;
    if (!overflow && values[0] != NULL) tag = PyLong_AsLongAndOverflow(values[0], &overflow);
    if (PyErr_Occurred()) return NULL;
    if (overflow || peer < 0 || peer >= self->size || peer == self->rank || tag < INT_MIN || tag > INT_MAX)
        return PyObject_Vectorcall(python_path, args, nargsf, kwnames);
    int plain = plain_cpu_tensor(self, tensor);
    if (plain <= 0) return plain < 0 ? NULL : PyObject_Vectorcall(python_path, args, nargsf, kwnames);
    PyObject *dtype = PyObject_GetAttr(tensor, s_dtype);
    if (dtype == NULL) return NULL;
    int d = dtype_index(self, dtype);
    Py_DECREF(dtype);
    long long nbytes = d < 0 ? 0 : long_attr(tensor, s_nbytes);
    if (nbytes < 0) return NULL;
    if (d < 0 || nbytes >= 2147483648LL) return PyObject_Vectorcall(python_path, args, nargsf, kwnames);
    long long address = call_long(tensor, s_data_ptr);
    if (address == -1 && PyErr_Occurred()) return NULL;
    self->peer_taken[recv]++;
    MPI_Request request;
    MPI_Status status;
    int count = (int)(nbytes / self->itemsize[d]), flag = 0, got = -1;
    int rc = recv ? MPI_Irecv((void *)(intptr_t)address, count, self->types[d], (int)peer, (int)tag, self->comm, &request)
                  : MPI_Isend((void *)(intptr_t)address, count, self->types[d], (int)peer, (int)tag, self->comm, &request);
    if (rc == MPI_SUCCESS) rc = test_for(&request, WAIT_SECONDS, &flag, &status);
    if (rc == MPI_SUCCESS && flag && recv) MPI_Get_count(&status, MPI_BYTE, &got);
    if (rc == MPI_SUCCESS && flag && (!recv || got == nbytes)) {
        Py_INCREF(tensor);
        return tensor;
    }
    PyObject *request_obj = Py_None;
    if (rc == MPI_SUCCESS && !flag) {
        request_obj = as_request(request);
        if (request_obj == NULL) return NULL;
    } else
        Py_INCREF(request_obj);
    return PyObject_CallFunction(self->peer_finish, "sllONii", recv ? "recv" : "send", peer, tag, tensor, request_obj,
                                 rc, got);
}

static PyObject *fast_send(Fast *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    return fast_peer(self, 0, args, nargsf, kwnames);
}

static PyObject *fast_recv(Fast *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    return fast_peer(self, 1, args, nargsf, kwnames);
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
    {"taken", (PyCFunction)fast_taken, METH_NOARGS, "taken()\n--\n\nThe calls this object took, per operation."},
    {"add_peer_paths", (PyCFunction)(void (*)(void))fast_add_peer_paths, METH_FASTCALL, NULL},
    {"send", (PyCFunction)(void (*)(void))fast_send, METH_FASTCALL | METH_KEYWORDS,
     "send($self, tensor, dst, *, tag=0, async_op=False)\n--\n\n"
     "MpiCommunicator.send, its blocking fast path compiled (the same semantics: see there)."},
    {"recv", (PyCFunction)(void (*)(void))fast_recv, METH_FASTCALL | METH_KEYWORDS,
     "recv($self, tensor, src, *, tag=0, async_op=False)\n--\n\n"
     "MpiCommunicator.recv, its blocking fast path compiled (the same semantics: see there)."},
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
    const char *kinds[KINDS] = {"allreduce", "allgather", "reduce_scatter", "broadcast"};
    for (int i = 0; i < KINDS; i++)
        if ((s_kind_names[i] = PyUnicode_InternFromString(kinds[i])) == NULL) return -1;
    PyObject *one = PyLong_FromLong(1), *eighty = PyLong_FromLong(80);
    shift80 = (one && eighty) ? PyNumber_Lshift(one, eighty) : NULL;
    Py_XDECREF(one);
    Py_XDECREF(eighty);
    return (shift80 && (s_root = PyUnicode_InternFromString("root")) &&
            (s_tag = PyUnicode_InternFromString("tag")) && (s_dtype = PyUnicode_InternFromString("dtype")) &&
            (s_is_cpu = PyUnicode_InternFromString("is_cpu")) && (s_nbytes = PyUnicode_InternFromString("nbytes")) &&
            (s_shape = PyUnicode_InternFromString("shape")) && (s_data_ptr = PyUnicode_InternFromString("data_ptr")) &&
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
    {"agreement_entry", (PyCFunction)(void (*)(void))agreement_entry, METH_FASTCALL, NULL},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "hpdl.comm._mpi_fast", NULL, -1, methods};

PyMODINIT_FUNC PyInit__mpi_fast(void) {
    if (intern_names() < 0 || PyType_Ready(&FastType) < 0 || PyType_Ready(&PairType) < 0 ||
        PyType_Ready(&PendingType) < 0 || PyType_Ready(&StateType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    Py_INCREF(&FastType);
    if (PyModule_AddObject(m, "Fast", (PyObject *)&FastType) < 0) {
        Py_DECREF(&FastType);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&PairType);
    if (PyModule_AddObject(m, "Pair", (PyObject *)&PairType) < 0) {
        Py_DECREF(&PairType);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&StateType);
    if (PyModule_AddObject(m, "State", (PyObject *)&StateType) < 0) {
        Py_DECREF(&StateType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

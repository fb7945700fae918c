"""One rank of a test pool (see rankpool.py): run bodies sent by the pytest process until told to exit."""

import faulthandler
import gc
import os
import pickle
import sys
import traceback
from multiprocessing.connection import Client

gc.disable()  # (until hpdl.init is done: see main)
import hpdl  # noqa: E402


def main() -> None:
    faulthandler.enable()  # a rank that crashes (a signal, not an exception) leaves its stack in the pool's output
    host, port, key = sys.argv[1], int(sys.argv[2]), bytes.fromhex(sys.argv[3])
    comm = hpdl.init()
    # Every later full collection would walk torch's and hpdl's module objects again (their import ran a few
    # more): they are set aside, and the bodies' own objects are collected as usual.
    gc.freeze()
    gc.enable()
    print(f"rank worker {comm.rank}: initialised ({comm.backend})", file=sys.stderr, flush=True)
    conn = Client((host, port), authkey=key)
    conn.send(comm.rank)
    print(f"rank worker {comm.rank}: connected", file=sys.stderr, flush=True)
    while True:
        kind, body, args = pickle.loads(conn.recv_bytes())
        if kind == "exit":
            break
        saved = (comm.debug, comm.timeout)
        try:
            conn.send_bytes(pickle.dumps(("ok", body(comm, *args))))
        except BaseException as exc:  # every failure goes home to the test
            conn.send_bytes(pickle.dumps(("err", (type(exc).__name__, str(exc), traceback.format_exc()))))
        finally:
            comm.debug, comm.timeout = saved
    conn.close()
    hpdl.finalize()
    _leave()


def _leave() -> None:
    """Finalize MPI and exit at once: tearing down an interpreter that holds every test's leftovers takes
    seconds per rank (measured 2-14 s at the end of the suite), and nothing is left to tear down for."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()

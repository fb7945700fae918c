"""The mpi:// transport, tested the way distributed tests its own comms, with tcp:// as the control.

One `mpiexec -n 2` launch of this file runs every body on both transports
(rank 0 listens, rank 1 connects) and writes what each side observed as
JSON; the tests below assert it, the same assertions for mpi:// and tcp://.
Last, rank 1 kills its own progress thread with work pending on it (see
`transport_failure`). Frames are chunked at 1 MiB in that run (HPDL_DASK_MPI_CHUNK) so that the
chunking above MPI's count limit is exercised without 2 GiB messages, and MPICH's single-copy
transfers are off (MPIR_CVAR_CH4_CMA_ENABLE=0, as where ptrace is restricted) so that every
receive that needs its sender's MPI calls goes through the push the transport then asks for; the
other Dask tests run with them on.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np
import pytest

PROTOCOLS = ("tcp", "mpi")
LISTEN = {"tcp": "tcp://127.0.0.1", "mpi": "mpi://"}
CHUNK = 1 << 20
LARGE = 5 * CHUNK + 123  # several chunks and a remainder
INLINE = 1 << 20  # one MPI message (below HPDL_DASK_MPI_INLINE), larger than MPICH's eager cells
MESSAGES, COMMS = 20, 24
RUN_TIMEOUT = 150


# --------------------------------------------------------------------------- bodies (run under mpiexec)
class Body:
    """A test in two halves: `handler` serves on rank 0, `client` connects from rank 1; both note observations."""

    def __init__(self) -> None:
        self.server: dict[str, Any] = {}

    async def handler(self, comm: Any) -> None:
        raise NotImplementedError

    async def client(self, address: str) -> dict[str, Any]:
        raise NotImplementedError


async def echo(comm: Any) -> None:
    from distributed.comm import CommClosedError

    try:
        while True:
            await comm.write(await comm.read())
    except CommClosedError:
        pass


class PingPong(Body):
    async def handler(self, comm: Any) -> None:
        await echo(comm)

    async def client(self, address: str) -> dict[str, Any]:
        from distributed.comm import connect
        from distributed.protocol import to_serialize

        comm = await connect(address, timeout=10)
        same = []
        for n in (0, 1, 1000, 70_000, INLINE, LARGE):
            payload = os.urandom(n)
            await comm.write({"op": "ping", "data": payload})
            same.append((await comm.read())["data"] == payload)
        array = np.arange(LARGE // 8, dtype=np.float64).reshape(-1, 7)  # a NumPy buffer, serialised out of band
        await comm.write({"x": to_serialize(array)})
        back = (await comm.read())["x"]
        await comm.close()
        return {"bytes_equal": same, "array_equal": bool(np.array_equal(back, array)), "closed": comm.closed()}


class Concurrent(Body):
    async def handler(self, comm: Any) -> None:
        self.server["comms"] = self.server.get("comms", 0) + 1
        await echo(comm)

    async def client(self, address: str) -> dict[str, Any]:
        from distributed.comm import connect

        async def one(i: int) -> list[int]:
            comm = await connect(address, timeout=20)
            for j in range(MESSAGES):  # several writes in flight before the reads
                await comm.write({"i": i, "j": j, "pad": b"x" * (i * 997)})
            got = [(await comm.read())["j"] for _ in range(MESSAGES)]
            await comm.close()
            return got

        results = await asyncio.gather(*(one(i) for i in range(COMMS)))
        return {"in_order": all(r == list(range(MESSAGES)) for r in results), "comms": len(results)}


class Frames(Body):
    """Empty messages, empty and large frames, and a message with many frames."""

    async def handler(self, comm: Any) -> None:
        await echo(comm)

    async def client(self, address: str) -> dict[str, Any]:
        from distributed.comm import connect
        from distributed.protocol import to_serialize

        comm = await connect(address, timeout=10)
        checks = {}
        await comm.write({})
        checks["empty_dict"] = await comm.read() == {}
        await comm.write(b"")
        checks["empty_bytes"] = await comm.read() == b""
        await comm.write({"e": to_serialize(np.empty(0)), "z": to_serialize(np.zeros((3, 0)))})
        got = await comm.read()
        checks["empty_arrays"] = got["e"].shape == (0,) and got["z"].shape == (3, 0)
        arrays = [np.full(k * 50_000, k, dtype=np.int32) for k in range(12)]
        await comm.write([to_serialize(a) for a in arrays])
        checks["many_frames"] = all(np.array_equal(a, b) for a, b in zip(arrays, await comm.read()))
        big = np.random.default_rng(0).integers(0, 255, 3 * LARGE, dtype=np.uint8)
        await comm.write({"big": to_serialize(big), "small": b"s"})
        got = await comm.read()
        checks["large_frame"] = bool(np.array_equal(got["big"], big)) and got["small"] == b"s"
        await comm.close()
        return checks


class ClientCloses(Body):
    async def handler(self, comm: Any) -> None:
        from distributed.comm import CommClosedError

        self.server["first"] = await comm.read()
        try:
            await asyncio.wait_for(comm.read(), 20)
            self.server["read_after_close"] = "returned"
        except CommClosedError:
            self.server["read_after_close"] = "CommClosedError"
        except asyncio.TimeoutError:
            self.server["read_after_close"] = "hung"
        self.server["closed"] = comm.closed()

    async def client(self, address: str) -> dict[str, Any]:
        from distributed.comm import connect

        comm = await connect(address, timeout=10)
        await comm.write("hello")
        await comm.close()
        return {"closed": comm.closed()}


class ServerCloses(Body):
    async def handler(self, comm: Any) -> None:
        await comm.write("bye")
        await comm.close()
        self.server["closed"] = comm.closed()

    async def client(self, address: str) -> dict[str, Any]:
        from distributed.comm import CommClosedError, connect

        comm = await connect(address, timeout=10)
        out: dict[str, Any] = {"first": await comm.read()}
        try:
            await asyncio.wait_for(comm.read(), 20)
            out["read_after_close"] = "returned"
        except CommClosedError:
            out["read_after_close"] = "CommClosedError"
        except asyncio.TimeoutError:
            out["read_after_close"] = "hung"
        out["closed"] = comm.closed()
        try:
            await comm.write("more")
            out["write_after_close"] = "accepted"
        except CommClosedError:
            out["write_after_close"] = "CommClosedError"
        return out


class Timeout(Body):
    """A read that gets no answer times out; the comm is then aborted, and a fresh comm still works."""

    async def handler(self, comm: Any) -> None:
        from distributed.comm import CommClosedError

        try:
            while True:
                msg = await comm.read()
                if msg == "answer me":
                    await comm.write("answered")
        except CommClosedError:
            pass

    async def client(self, address: str) -> dict[str, Any]:
        from distributed.comm import connect

        comm = await connect(address, timeout=10)
        await comm.write("ignore me")
        start = time.monotonic()
        try:
            await asyncio.wait_for(comm.read(), 0.5)
            outcome = "returned"
        except asyncio.TimeoutError:
            outcome = "TimeoutError"
        waited = time.monotonic() - start
        fresh = await connect(address, timeout=10)
        await fresh.write("answer me")
        answer = await fresh.read()
        await fresh.close()
        return {"outcome": outcome, "waited": waited, "closed_after": comm.closed(), "fresh": answer}


class ConnectErrors(Body):
    """No listener at the address: connect fails with OSError within its timeout (Dask retries until then)."""

    def __init__(self) -> None:
        super().__init__()

    async def handler(self, comm: Any) -> None:
        await echo(comm)

    async def client(self, address: str) -> dict[str, Any]:
        from distributed.comm import connect

        scheme, _, loc = address.partition("://")
        host, _, port = loc.rpartition(":")
        missing = f"{scheme}://{host}:{int(port) + 7919 if scheme == 'tcp' else 999}"
        out: dict[str, Any] = {}
        start = time.monotonic()
        try:
            await connect(missing, timeout=1.0)
            out["missing"] = "connected"
        except OSError as error:
            out["missing"] = "OSError"
            out["message"] = str(error)
        out["waited"] = time.monotonic() - start
        comm = await connect(address, timeout=10)  # the listener itself still works
        await comm.write(1)
        out["still_works"] = await comm.read() == 1
        await comm.close()
        if scheme == "mpi":  # only mpi://: a rank outside the job is refused with a clear error at once
            try:
                await connect("mpi://7:1", timeout=1.0)
                out["outside"] = "connected"
            except Exception as error:  # noqa: BLE001 - the type and text are asserted
                out["outside"] = f"{type(error).__name__}: {error}"
        return out


class ListenerStop(Body):
    async def handler(self, comm: Any) -> None:
        await echo(comm)

    async def client(self, address: str) -> dict[str, Any]:
        return {}


BODIES = {
    "ping_pong": PingPong,
    "concurrent": Concurrent,
    "frames": Frames,
    "client_closes": ClientCloses,
    "server_closes": ServerCloses,
    "timeout": Timeout,
    "connect_errors": ConnectErrors,
}


async def run_body(protocol: str, body_name: str, world: Any, call: Any) -> dict[str, Any]:
    from distributed.comm import listen

    from hpdl.dask.connection import get_hub

    loop = asyncio.get_running_loop()
    body = BODIES[body_name]()
    out: dict[str, Any] = {}
    if world.rank == 0:
        listener = await listen(LISTEN[protocol], body.handler)  # awaiting a listener starts it
        await loop.run_in_executor(None, call, lambda: world.bcast(listener.contact_address, root=0))
        await get_hub().wait_request(world.Ibarrier)  # the client is done (a barrier that keeps the transport going)
        await asyncio.sleep(0.2)  # let the server's handlers see the last close
        listener.stop()
        out = body.server
    else:
        address = await loop.run_in_executor(None, call, lambda: world.bcast(None, root=0))
        try:
            out = await asyncio.wait_for(body.client(address), 60)
        except BaseException as error:  # noqa: BLE001 - reported to pytest
            out = {"error": f"{type(error).__name__}: {error}"}
        await get_hub().wait_request(world.Ibarrier)
    return out


def _outcome(error: BaseException) -> str:
    cause = f" <- {type(error.__cause__).__name__}" if error.__cause__ is not None else ""
    return f"{type(error).__name__}{cause}: {error}"


async def transport_failure() -> dict[str, Any]:
    """Kill this rank's progress thread while a read, a connect, a request and a send wait on it: each must fail
    (not hang), and so must every later use. A connection to this same rank carries the traffic (its reader fails
    with the transport, though nothing of it crosses MPI). Rank 0 holds its progress thread meanwhile: its refusal
    of the connect cannot overtake the failure (it did, once in ~50 runs)."""
    from distributed.comm import connect, listen
    from mpi4py import MPI

    from hpdl.dask.connection import get_hub

    hub = get_hub()
    loop = asyncio.get_running_loop()
    listener = await listen("mpi://", echo)
    comm = await connect(listener.contact_address, timeout=10)
    await comm.write("ping")
    out: dict[str, Any] = {"echo": await comm.read()}
    reading = asyncio.ensure_future(comm.read())  # no reply will come
    await asyncio.sleep(0.05)
    gate = threading.Event()
    hub.progress.submit(lambda: gate.wait(10))  # hold the thread until everything below is queued behind it
    connecting = asyncio.ensure_future(hub.connect(0, "1"))  # rank 0's answer needs this rank's transport
    box = np.zeros(1)
    requesting = asyncio.ensure_future(hub.wait_request(lambda: MPI.COMM_SELF.Irecv(box, source=0, tag=5)))
    await asyncio.sleep(0.05)  # both coroutines have queued their operations

    def fail() -> None:
        raise RuntimeError("injected failure")

    hub.progress.submit(fail)
    gate.set()
    for name, waiter in (("read", reading), ("connect", connecting), ("request", requesting)):
        try:
            await asyncio.wait_for(waiter, 10)
            out[name] = "completed"
        except asyncio.TimeoutError:
            out[name] = "hung"
        except Exception as error:  # noqa: BLE001 - the type and text are asserted
            out[name] = _outcome(error)
    try:  # a send on a connection of the dead transport (sends run on the event loop's thread)
        await hub.send(comm._channel, [memoryview(b"never sent")], loop)
        out["send"] = "completed"
    except Exception as error:  # noqa: BLE001 - the type and text are asserted
        out["send"] = _outcome(error)
    MPI.COMM_SELF.Send(np.ones(1), dest=0, tag=5)  # complete the orphaned receive before MPI finalises
    out["closed"] = comm.closed()
    try:
        hub.progress.submit(lambda: None)
        out["later"] = "accepted"
    except Exception as error:  # noqa: BLE001
        out["later"] = _outcome(error)
    try:
        await connect(listener.contact_address, timeout=2)
        out["reconnect"] = "connected"
    except Exception as error:  # noqa: BLE001
        out["reconnect"] = _outcome(error)
    listener.stop()
    return out


async def within_one_process() -> dict[str, Any]:
    """A connection from a rank to its own listener (a worker's shuffle sends to itself): echoed messages of every
    size, a NumPy frame changed by its writer right after the write (the reader must get what was written: a copy,
    as from a socket), closes from each side; and no MPI message for any of it (the hub's count to itself)."""
    from distributed.comm import CommClosedError, connect, listen
    from distributed.protocol import to_serialize

    from hpdl.dask.connection import get_hub

    hub = get_hub()
    sent_before = hub._sent.get(hub.rank, 0)
    listener = await listen("mpi://", echo)
    comm = await connect(listener.contact_address, timeout=10)
    same = []
    for n in (0, 1, 70_000, INLINE, LARGE):
        payload = os.urandom(n)
        await comm.write({"data": payload})
        same.append((await comm.read())["data"] == payload)
    array = np.arange(LARGE // 8, dtype=np.float64)
    await comm.write({"x": to_serialize(array)})
    array[:] = -1.0  # the write is done: the writer may reuse its buffer
    back = (await comm.read())["x"]
    await comm.close()
    server_closes = await connect(listener.contact_address, timeout=10)
    own = hub._channels.get((hub.rank, server_closes._channel.cid, False))
    assert own is not None
    hub.close(own)  # the listener's end closes: this end's reader gets EOF, as from a socket
    try:
        await asyncio.wait_for(server_closes.read(), 10)
        reply_after_close = "read"
    except CommClosedError:
        reply_after_close = "CommClosedError"
    listener.stop()
    await asyncio.sleep(0.05)
    left = [key for key in hub._channels if key[0] == hub.rank]
    return {
        "bytes_equal": same,
        "array_as_written": bool(np.array_equal(back, np.arange(LARGE // 8, dtype=np.float64))),
        "server_closes": reply_after_close,
        "channels_left": left,
        "mpi_messages_to_itself": hub._sent.get(hub.rank, 0) - sent_before,
    }


def wait_then_heat(progress: Any) -> dict[str, Any]:
    """Watch a receive that no one has sent as a wait, count the progress thread's ticks, heat it, complete it."""
    from mpi4py import MPI

    ticks: list[bool] = []
    next_delay = progress.backoff.next_delay
    progress.backoff.next_delay = lambda in_flight, cap=0.0: (ticks.append(in_flight), next_delay(in_flight, cap))[1]
    box, done = np.zeros(1), threading.Event()
    progress.watch([MPI.COMM_SELF.Irecv(box, source=0, tag=6)], done.set, keep=box, hot=False, key="peer")
    time.sleep(0.3)
    cold, ticks[:] = list(ticks), []
    progress.heat("peer")
    time.sleep(0.05)
    hot = list(ticks)
    MPI.COMM_SELF.Send(np.ones(1), dest=0, tag=6)
    completed = done.wait(10)
    progress.backoff.next_delay = next_delay
    return {"cold_ticks": len(cold), "cold_in_flight": any(cold), "hot_in_flight": any(hot), "completed": completed}


def script_main(path: str) -> None:
    from mpi4py import MPI

    import hpdl.dask.transport  # noqa: F401 - registers mpi:// (an entry point may be shadowed on PYTHONPATH)
    from hpdl.dask.connection import get_hub

    world = MPI.COMM_WORLD
    call = get_hub().progress.call  # every MPI call of this script from the transport's thread

    async def everything() -> dict[str, Any]:
        results: dict[str, Any] = {}
        for protocol in PROTOCOLS:
            for name in BODIES:
                results[f"{protocol}/{name}"] = await run_body(protocol, name, world, call)
        return results

    mine = asyncio.run(everything())
    mine["_pushed"] = sorted(get_hub()._pushed)
    mine["_within"] = asyncio.run(within_one_process())
    mine["_waits"] = wait_then_heat(get_hub().progress)
    both = call(lambda: world.gather(mine, root=0))
    if world.rank == 0:
        merged = {key: {"server": both[0][key], "client": both[1][key]} for key in both[0]}
        merged["_thread_level"] = {"multiple": MPI.Query_thread() == MPI.THREAD_MULTIPLE}
        with open(path, "w") as handle:
            json.dump(merged, handle)
    if world.rank == 0:  # rank 1's connect below must still wait for rank 0's answer when its transport dies
        release = hold_progress_thread(get_hub().progress)
    world.Barrier()
    if world.rank == 1:  # this kills the rank's transport
        failure = asyncio.run(transport_failure())
        with open(path + ".failure", "w") as handle:
            json.dump(failure, handle)
    world.Barrier()
    if world.rank == 0:
        release.set()  # rank 0 refuses the connect now, to a transport that no longer reads
    stalled = stalled_sender(world)  # last: this kills rank 0's transport
    if world.rank == 0:
        with open(path + ".stalled", "w") as handle:
            json.dump(stalled, handle)


def hold_progress_thread(progress: Any) -> threading.Event:
    """Park a rank's progress thread (nothing it receives is answered) until the returned event is set."""
    running, release = threading.Event(), threading.Event()
    progress.submit(lambda: (running.set(), release.wait(60)))
    assert running.wait(30), "the progress thread did not take the hold"
    return release


def stalled_sender(world: Any) -> dict[str, Any]:
    """Rank 1 (its transport dead: no thread of it calls MPI) starts a 1 MiB message to rank 0 and then makes no MPI
    call for 1 s, so the message stops half-way (no single-copy transfers in this run): rank 0's receive must give
    up after RECEIVE_SECONDS (0.3 s here) with an error naming rank 1, and end rank 0's transport, not hang it."""
    from mpi4py import MPI

    from hpdl.dask import connection

    hub = connection._hub
    assert hub is not None
    out: dict[str, Any] = {}
    connection.RECEIVE_SECONDS = 0.3
    world.Barrier()  # rank 0's transport idle, waiting
    if world.rank == 1:
        payload = np.zeros(1 << 20, dtype=np.uint8)
        request = hub.comm.Isend([payload, MPI.BYTE], dest=0, tag=hub.tag)
        time.sleep(1.0)
    else:
        start = time.monotonic()
        while hub.progress.error is None and time.monotonic() - start < 30:
            time.sleep(0.05)
        out = {
            "error": _outcome(hub.progress.error) if hub.progress.error else None,
            "seconds": time.monotonic() - start,
        }
    world.Barrier()
    if world.rank == 1:  # moving again: the message completes into the buffer the transport kept
        request.Wait()
    else:
        MPI.Request.Waitall([abandoned for abandoned, _ in hub._abandoned])
    return out


# --------------------------------------------------------------------------- pytest side
@pytest.fixture(scope="module")
def observed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from hpdl.runtime.spawn import job_environment, mpiexec_argv

    path = tmp_path_factory.mktemp("dask_transport") / "observed.json"
    env = job_environment("mpi", 2)
    env.update(OMP_NUM_THREADS="1", HPDL_DASK_MPI_CHUNK=str(CHUNK), MPIR_CVAR_CH4_CMA_ENABLE="0")
    command = [*mpiexec_argv(2), sys.executable, __file__, str(path)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    observed = dict(json.loads(path.read_text()))
    observed["_failure"] = json.loads(path.with_name(path.name + ".failure").read_text())
    observed["_stalled"] = json.loads(path.with_name(path.name + ".stalled").read_text())
    return observed


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_ping_pong(observed: dict[str, Any], protocol: str) -> None:
    client = observed[f"{protocol}/ping_pong"]["client"]
    assert client == {"bytes_equal": [True] * 6, "array_equal": True, "closed": True}


def test_a_receiver_that_needs_its_sender_asks_for_a_push(observed: dict[str, Any]) -> None:
    """Without single-copy transfers a 1 MiB message cannot arrive until its sender's MPI moves the rest: each side
    learnt that from the other's receive (a PUSH ring), and the messages above arrived whole."""
    assert observed["_pushed"] == {"server": [1], "client": [0]}


def test_a_wait_is_not_polled_hot_until_heated(observed: dict[str, Any]) -> None:
    """A watched wait (a receive no one has sent yet) leaves the progress thread at its back-off pace, where hot
    polling would wake it every 10 us and take the GIL from the event loops; `heat` makes it hot; it completes."""
    for side in ("server", "client"):
        waits = observed["_waits"][side]
        assert waits["completed"] is True
        assert waits["cold_in_flight"] is False and waits["cold_ticks"] < 400  # 0.3 s at 1 ms, after the ramp
        assert waits["hot_in_flight"] is True


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_many_concurrent_messages(observed: dict[str, Any], protocol: str) -> None:
    result = observed[f"{protocol}/concurrent"]
    assert result["client"] == {"in_order": True, "comms": COMMS}
    assert result["server"]["comms"] == COMMS


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_empty_and_large_frames(observed: dict[str, Any], protocol: str) -> None:
    checks = observed[f"{protocol}/frames"]["client"]
    assert checks == dict.fromkeys(["empty_dict", "empty_bytes", "empty_arrays", "many_frames", "large_frame"], True)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_close_from_client_side(observed: dict[str, Any], protocol: str) -> None:
    result = observed[f"{protocol}/client_closes"]
    assert result["client"] == {"closed": True}
    assert result["server"] == {"first": "hello", "read_after_close": "CommClosedError", "closed": True}


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_close_from_server_side(observed: dict[str, Any], protocol: str) -> None:
    result = observed[f"{protocol}/server_closes"]
    assert result["server"] == {"closed": True}
    assert result["client"] == {
        "first": "bye",
        "read_after_close": "CommClosedError",
        "closed": True,
        "write_after_close": "CommClosedError",
    }


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_read_timeout(observed: dict[str, Any], protocol: str) -> None:
    client = observed[f"{protocol}/timeout"]["client"]
    assert client["outcome"] == "TimeoutError" and 0.4 < client["waited"] < 5
    assert client["closed_after"] is True  # a cancelled read aborts the comm, as over TCP
    assert client["fresh"] == "answered"


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_connection_errors(observed: dict[str, Any], protocol: str) -> None:
    client = observed[f"{protocol}/connect_errors"]["client"]
    assert client["missing"] == "OSError" and "Timed out" in client["message"]
    assert client["waited"] < 10
    assert client["still_works"] is True


def test_rank_outside_the_job_is_a_clear_error(observed: dict[str, Any]) -> None:
    outside = observed["mpi/connect_errors"]["client"]["outside"]
    assert outside.startswith("MPITransportError") and "not in this MPI job" in outside and "tcp://" in outside


def test_mpi_thread_level(observed: dict[str, Any]) -> None:
    assert observed["_thread_level"]["multiple"] is True  # what mpi4py asks of MPICH by default


def test_a_connection_within_one_process_copies_its_frames_and_uses_no_mpi(observed: dict[str, Any]) -> None:
    for side in ("server", "client"):  # each rank ran it
        assert observed["_within"][side] == {
            "bytes_equal": [True] * 5,
            "array_as_written": True,
            "server_closes": "CommClosedError",
            "channels_left": [],
            "mpi_messages_to_itself": 0,
        }


def test_a_failed_progress_thread_fails_every_waiter(observed: dict[str, Any]) -> None:
    out = observed["_failure"]
    assert out["echo"] == "ping"
    assert out["read"].startswith("CommClosedError <- TransportFailed") and "injected failure" in out["read"]
    for waiter in ("connect", "request", "send", "later"):  # pending, watched, queued, and after the failure
        assert out[waiter].startswith("TransportFailed <- RuntimeError"), (waiter, out[waiter])
        assert "injected failure" in out[waiter]
    assert out["closed"] is True
    assert out["reconnect"].startswith("MPITransportError") and "progress thread failed" in out["reconnect"]


def test_a_sender_that_stops_mid_message_is_a_clear_error_not_a_hang(observed: dict[str, Any]) -> None:
    out = observed["_stalled"]
    assert out["error"] is not None and out["seconds"] < 10, out
    assert out["error"].startswith("MPITransportError") and "from rank 1 has not finished arriving" in out["error"]


# --------------------------------------------------------------------------- units (one process, no MPI)
def test_chunks_cover_a_frame_exactly() -> None:
    from hpdl.dask.frames import INT_MAX, chunks

    assert list(chunks(0, 10)) == []
    assert list(chunks(25, 10)) == [(0, 10), (10, 20), (20, 25)]
    assert list(chunks(2 * INT_MAX + 5, INT_MAX)) == [
        (0, INT_MAX),
        (INT_MAX, 2 * INT_MAX),
        (2 * INT_MAX, 2 * INT_MAX + 5),
    ]


def test_inline_message_round_trip() -> None:
    from hpdl.dask.frames import Kind, pack_inline, unpack

    frames = [memoryview(b"abc"), memoryview(b""), memoryview(np.arange(5, dtype=np.int16).tobytes())]
    kind, cid, side, sizes, views = unpack(pack_inline(42, 1, frames))
    assert (kind, cid, side, sizes) == (Kind.INLINE, 42, 1, [3, 0, 10])
    assert [bytes(v) for v in views] == [bytes(f) for f in frames]


def test_bad_settings_are_clear_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    from hpdl.dask.connection import parse_location
    from hpdl.dask.frames import chunk_bytes
    from hpdl.dask.progress import Backoff

    monkeypatch.setenv("HPDL_DASK_MPI_CHUNK", str(2**31))
    with pytest.raises(ValueError, match="HPDL_DASK_MPI_CHUNK"):
        chunk_bytes()
    with pytest.raises(ValueError, match="mpi://<rank>:<id>"):
        parse_location("localhost:8786")
    with pytest.raises(ValueError, match="first"):
        Backoff(first=0.0)


def test_backoff_sleeps_only_when_idle() -> None:
    from hpdl.dask.progress import Backoff

    b = Backoff(first=1e-5, cap=1e-3, hot=10.0, spin=0.0)
    assert b.next_delay(in_flight=True) == 1e-5  # requests in flight: keep polling, with the shortest sleeps
    delays = [b.next_delay(in_flight=False) for _ in range(10)]
    assert delays[0] == 1e-5 and delays == sorted(delays) and delays[-1] == 1e-3
    b.activity()
    assert b.next_delay(in_flight=False) == 1e-5  # reset on activity
    spinning = Backoff(spin=10.0)
    assert spinning.next_delay(in_flight=False) == 0.0  # just after activity: poll without sleeping


def test_idle_progress_thread_does_not_spin() -> None:
    """Measured, not assumed: an idle progress thread uses a few per cent of a core at most."""
    import resource

    from hpdl.dask.progress import Progress

    progress = Progress(name="test-idle-progress")
    try:
        time.sleep(0.3)  # past the spin window
        before = resource.getrusage(resource.RUSAGE_SELF)
        start = time.monotonic()
        time.sleep(1.0)
        after = resource.getrusage(resource.RUSAGE_SELF)
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        assert cpu / (time.monotonic() - start) < 0.15
    finally:
        progress.stop()


HEAP_SCRIPT = """
import ctypes, sys
import numpy as np
from hpdl.runtime.memory import keep_freed_memory
assert keep_freed_memory() == (sys.argv[1] != "0")
sbrk = ctypes.CDLL(None).sbrk
sbrk.restype = ctypes.c_void_p
sbrk.argtypes = [ctypes.c_long]
block = np.empty(16 << 20, dtype=np.uint8)  # a 16 MiB message's copy
block.fill(1)
on_heap = block.ctypes.data < sbrk(0)  # else a mapping of its own (glibc: 128 KiB and more, at first)
top = sbrk(0)
del block
print(on_heap, sbrk(0) == top)  # freed: kept for the next message, or handed back to the system
"""


def test_the_transport_keeps_freed_memory_for_the_next_messages() -> None:
    """hpdl.runtime.memory: a message's copy comes from the heap and stays there when freed (fresh pages cost 0.3-8 ms
    per MiB on these VMs; docs/dask.md), where glibc's defaults map it alone and unmap it at once."""
    seen = {}
    for keep in ("0", str(256 << 20)):
        env = dict(os.environ, HPDL_MALLOC_KEEP=keep)
        done = subprocess.run([sys.executable, "-c", HEAP_SCRIPT, keep], env=env, capture_output=True, text=True,
                              timeout=60)  # fmt: skip
        assert done.returncode == 0, done.stderr
        seen[keep] = done.stdout.split()
    assert seen["0"][0] == "False"  # mapped on its own, unmapped when freed
    assert seen[str(256 << 20)] == ["True", "True"]


if __name__ == "__main__":
    script_main(sys.argv[1])

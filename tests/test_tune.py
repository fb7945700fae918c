"""`hpdl tune`: the shared-memory thresholds measured on this machine, their file, and hpdl.init reading it.

The choice rule and the file are checked on their own; the measurement and the agreement at start-up on real
ranks (the pools of test_shared_memory.py: this file belongs to its group), and the command once end to end.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from collective_data import SHM_FORCED as FORCED
from hpdl.comm import shm, shm_probe, tuning
from hpdl.errors import TuneFileError

NEVER = shm.NEVER
KIB, MIB = 1024, 1024 * 1024
MPI_NAME = "MPICH 5.0.2"


def test_choose_takes_the_smallest_size_from_which_shared_memory_always_won():
    assert tuning.choose([(1 * MIB, 1.3), (2 * MIB, 0.9), (4 * MIB, 0.5)]) == 2 * MIB
    assert tuning.choose([(1 * MIB, 0.5), (2 * MIB, 1.2), (4 * MIB, 0.5)]) == 4 * MIB  # a loss in between
    assert tuning.choose([(1 * MIB, 0.5), (2 * MIB, 0.5), (4 * MIB, 1.01)]) == NEVER  # lost at the largest
    assert tuning.choose([(1 * MIB, 0.5), (4 * MIB, 0.97)]) == NEVER  # a tie stays with MPI
    assert tuning.choose([(1 * MIB, 0.5), (4 * MIB, float("nan"))]) == NEVER


def test_zero_copy_is_used_wherever_copying_in_wins():
    rows = [
        {"bytes": 1 * MIB, "zero-copy": 1.2, "copied": 0.9},
        {"bytes": 2 * MIB, "zero-copy": 1.1, "copied": 0.8},
        {"bytes": 4 * MIB, "zero-copy": 0.5, "copied": 0.8},
    ]
    assert shm_probe.thresholds({"allreduce": rows}) == {"allreduce": (1 * MIB, 1 * MIB)}


def _tuned(local_size, **ops):
    thresholds = {**shm.DEFAULT_THRESHOLDS, **ops}
    return tuning.new(MPI_NAME, local_size, thresholds, {"allreduce": []})


def test_file_round_trip_merges_node_sizes_and_writes_never_as_null(tmp_path):
    where = str(tmp_path / "sub" / "t.json")
    tuning.write(where, _tuned(2, allreduce=(64 * KIB, NEVER)))
    tuning.write(where, _tuned(4, allreduce=(1 * MIB, 4 * MIB)))
    found = tuning.read(where)
    assert found is not None and found.mpi == MPI_NAME and set(found.per_node) == {2, 4}
    assert found.per_node[2]["allreduce"] == (64 * KIB, NEVER)
    assert found.per_node[4]["allreduce"] == (1 * MIB, 4 * MIB)
    assert json.loads(open(where).read())["ranks_per_node"]["2"]["allreduce"] == [64 * KIB, None]
    umask = os.umask(0)
    os.umask(umask)
    assert os.stat(where).st_mode & 0o777 == 0o644 & ~umask  # others who share the file can read it
    timings = {"allreduce": [{"bytes": 64 * KIB}], "broadcast": [{"bytes": 1 * MIB}]}
    tuning.write(where, tuning.new(MPI_NAME, 2, dict(shm.DEFAULT_THRESHOLDS), timings))
    tuning.write(where, tuning.new(MPI_NAME, 2, dict(shm.DEFAULT_THRESHOLDS), {"broadcast": [{"bytes": 4}]}))
    kept = tuning.read(where).measured
    assert kept["2"] == {"allreduce": [{"bytes": 64 * KIB}], "broadcast": [{"bytes": 4}]}  # `--ops broadcast`
    tuning.write(where, tuning.new("Open MPI v5.0.5", 2, dict(shm.DEFAULT_THRESHOLDS), {}))
    assert set(tuning.read(where).per_node) == {2}  # another MPI library: the old entries do not apply
    assert tuning.read(str(tmp_path / "missing.json")) is None


@pytest.mark.parametrize(
    "text,what",
    [
        ("{", "unreadable"),
        ('{"format": 99}', "not an hpdl tuning file"),
        ('{"format": 1, "mpi": "x", "host": "h", "written": "w", "ranks_per_node": {"2": {}}}', "malformed"),
        (
            '{"format": 1, "mpi": "x", "host": "h", "written": "w", "ranks_per_node": {"2": {"allreduce": [9, 1], '
            '"reduce_scatter": [1, 1], "allgather": [1, 1], "broadcast": [1, 1]}}}',
            "zero-copy <= ordinary",
        ),
        (
            '{"format": 1, "mpi": "x", "host": "h", "written": "w", "ranks_per_node": {"2": {"allreduce": '
            '[Infinity, 1], "reduce_scatter": [1, 1], "allgather": [1, 1], "broadcast": [1, 1]}}}',
            "malformed",
        ),
    ],
)
def test_a_bad_file_is_an_error_that_names_it_and_says_what_to_do(tmp_path, text, what):
    where = tmp_path / "t.json"
    where.write_text(text)
    with pytest.raises(TuneFileError, match=what) as caught:
        tuning.read(str(where))
    assert str(where) in str(caught.value) and "hpdl tune" in str(caught.value) and "=off" in str(caught.value)


def test_parameters_of_several_blocks_add_up_per_rank_and_flops_per_block():
    from hpdl.plan.profile import _busiest

    blocks = [([5.0, 1.0, 1.0], [10.0, 9.0, 8.0]), ([1.0, 3.0], [10.0, 1.0])]  # (FLOPs, parameters) per branch
    # tp=2, by parameters: block 1 puts branch 0 alone on rank 0 (10 | 17), block 2 branch 0 on rank 0 (10 | 1)
    assert _busiest(blocks, 38.0, 1, 2)[1] == pytest.approx(20 / 38)  # rank 0 holds 10 + 10, rank 1 17 + 1
    assert _busiest(blocks, 11.0, 0, 2)[1] == pytest.approx((5 + 3) / 11)  # each block waits for its slowest rank


def test_thresholds_for_says_where_they_come_from():
    found = _tuned(2, allreduce=(64 * KIB, 1 * MIB))
    chosen, source = tuning.thresholds_for(found, 2, MPI_NAME)
    assert chosen["allreduce"] == (64 * KIB, 1 * MIB) and source.startswith("tuned")
    chosen, source = tuning.thresholds_for(found, 4, MPI_NAME)
    assert chosen == shm.DEFAULT_THRESHOLDS and "hpdl tune -n 4" in source
    chosen, source = tuning.thresholds_for(found, 2, "Open MPI v5.0.5")
    assert chosen == shm.DEFAULT_THRESHOLDS and "measured with MPICH" in source
    assert tuning.thresholds_for(None, 2, MPI_NAME) == (shm.DEFAULT_THRESHOLDS, "built-in")
    chosen, source = tuning.thresholds_for(found, 0, MPI_NAME)  # 0: nodes hold different numbers of ranks
    assert chosen == shm.DEFAULT_THRESHOLDS and "different numbers of ranks" in source


def test_the_environment_overrides_a_measured_threshold(monkeypatch):
    monkeypatch.delenv("HPDL_SHM_MIN_ALLREDUCE", raising=False)
    assert shm.thresholds("allreduce", (1, 2)) == (1, 2)
    monkeypatch.setenv("HPDL_SHM_MIN_ALLREDUCE", "4096")
    assert shm.thresholds("allreduce", (1, 2)) == (4096, 4096)


def test_path_follows_the_environment(monkeypatch):
    monkeypatch.setenv(tuning.ENV, "off")
    assert tuning.path() is None
    monkeypatch.setenv(tuning.ENV, "/some/file.json")
    assert tuning.path() == "/some/file.json"
    monkeypatch.delenv(tuning.ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", "/cache")
    assert tuning.path() == "/cache/hpdl/shm-thresholds.json"


# ---------------------------------------------------------------- on real ranks
def measure_and_check(comm):
    """Measure two sizes of every operation; the communicator's own thresholds are back afterwards."""
    before = dict(comm._shm_thresholds)
    results = shm_probe.measure(comm, [64 * KIB, 1 * MIB], rounds=2)
    after = dict(comm._shm_thresholds)
    x = torch.full((1000,), float(comm.rank + 1))
    comm.allreduce(x)
    return results, before == after, float(x[0])


def test_measure_times_every_path_and_restores_the_thresholds(ranks):
    for results, restored, total in ranks("mpi", 2, FORCED).run(measure_and_check):
        assert restored and total == 3.0
        assert set(results) == set(shm_probe.OPS)
        for rows in results.values():
            assert [row["bytes"] for row in rows] == [64 * KIB, 1 * MIB]
            for row in rows:
                assert row["mpi_us"] > 0 and row["zero-copy"] > 0 and row["copied"] > 0


def agree_and_build(comm, where, corrupt):
    """Rank 0 alone reads the file (another rank's copy may differ or be missing); a communicator built on its
    answer uses it, its fast path stopping at the ordinary threshold until shared buffers exist."""
    from hpdl.comm.mpi_backend import MpiCommunicator

    if comm.rank != 0:
        where = where + ".not-here"
    try:
        found = tuning.agree(comm.mpi_comm, 30.0, where=where)
    except TuneFileError as exc:
        return "error", str(exc)
    assert not corrupt
    made = MpiCommunicator(comm.mpi_comm.Dup(), timeout=30.0, debug=False, tuning=found)
    try:
        gates = [made._fast_allreduce_below]
        x = torch.full((64 * 1024,), float(comm.rank + 1))  # 256 KiB, above both thresholds: copied in
        made.allreduce(x)
        status = made.shm_status
        made.shared_buffer(16)
        gates.append(made._fast_allreduce_below)
        return made.shm_thresholds_source, made._shm_thresholds["allreduce"], gates, status, float(x.sum())
    finally:
        made.close()


def test_rank_zeros_file_is_every_ranks_answer(ranks, tmp_path):
    where = str(tmp_path / "t.json")
    thresholds = {**shm.DEFAULT_THRESHOLDS, "allreduce": (64 * KIB, 128 * KIB)}
    tuning.write(where, tuning.Tuning("", _mpi_library(), "h", "w", {2: thresholds}))
    for source, pair, gates, status, total in ranks("mpi", 2).run(agree_and_build, where, False):
        assert source.startswith(f"tuned ({where}") and pair == (64 * KIB, 128 * KIB)
        assert gates == [128 * KIB, 64 * KIB] and status.startswith("on"), status
        assert total == 3.0 * 64 * 1024
    with open(where, "w") as fh:
        fh.write("{")
    for kind, message in ranks("mpi", 2).run(agree_and_build, where, True):
        assert kind == "error" and where in message and "hpdl tune" in message


def node_sizes(comm):
    return [tuning.uniform_node_size(comm.mpi_comm, n, 30.0) for n in (2, comm.rank + 1)]


def test_ranks_agree_whether_every_node_holds_as_many_ranks(ranks):
    assert ranks("mpi", 2).run(node_sizes) == [[2, 0], [2, 0]]


def _mpi_library():
    from hpdl.comm.mpi_backend import library_version

    return library_version()


SHOW = """
import hpdl
comm = hpdl.init()
print("rank", comm.rank, comm.shm_thresholds_source, comm._shm_thresholds["allreduce"], flush=True)
hpdl.finalize()
"""


def test_hpdl_tune_writes_what_hpdl_init_then_uses(tmp_path):
    where = tmp_path / "tuned.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("HPDL_TUNE_FILE", None)
    command = [sys.executable, "-m", "hpdl.cli.main", "tune", "-n", "2", "--quick", "--ops", "allreduce", "broadcast"]
    done = subprocess.run([*command, "--out", str(where)], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "zero-copy / MPI" in done.stdout and f"wrote {where}" in done.stdout
    found = tuning.read(str(where))
    assert found is not None and set(found.per_node) == {2} and found.mpi == _mpi_library()
    assert [row["bytes"] for row in found.measured["2"]["allreduce"]] == [256 * KIB, 2 * MIB, 16 * MIB]
    # not measured: built in, on two ranks messages (shared buffers still take the engine for a reduce_scatter)
    assert found.per_node[2]["reduce_scatter"] == (shm.TWO_RANKS_SHARED["reduce_scatter"], shm.NEVER)
    assert found.per_node[2]["allgather"] == (shm.NEVER, shm.NEVER)
    script = tmp_path / "show.py"
    script.write_text(SHOW)
    env["HPDL_TUNE_FILE"] = str(where)
    shown = subprocess.run(
        [sys.executable, "-m", "hpdl.cli.main", "launch", "-n", "2", str(script)],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert shown.returncode == 0, shown.stdout + shown.stderr
    lines = sorted(line for line in shown.stdout.splitlines() if line.startswith("rank"))
    expected = f"tuned ({where}, {found.host}, {found.written}) {found.per_node[2]['allreduce']}"
    assert lines == [f"rank 0 {expected}", f"rank 1 {expected}"]
    info = subprocess.run(
        [sys.executable, "-m", "hpdl.cli.main", "info", "--json"], capture_output=True, text=True, timeout=60, env=env
    )
    shown_by_info = json.loads(info.stdout)["shm thresholds, 2 ranks per node"]
    assert shown_by_info.startswith("allreduce ") and f"tuned ({where}" in shown_by_info

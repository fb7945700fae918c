"""`hpdl launch` and job-wide failure handling, through real launches (a few seconds each)."""

from __future__ import annotations

import ast
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

JOB = os.path.join(os.path.dirname(__file__), "scripts", "job.py")
TORCH_ENV_JOB = os.path.join(os.path.dirname(__file__), "scripts", "torch_env_job.py")
"""A script that calls only torch's own `init_process_group("gloo")`, as under torchrun."""
HPDL = [sys.executable, "-m", "hpdl.cli.main"]


def launch(*args: str, env: dict | None = None, timeout: float = 150) -> tuple[int, str, float]:
    """Exit code, output, and the seconds from the first rank's start to the job's end.

    Counting from the ranks' start (job.py prints it) keeps start-up, which a busy machine
    can stretch to many seconds, out of the bounds that tell a stopped job from a hung one.
    """
    done = subprocess.run(
        HPDL + ["launch", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})),
    )
    ended = time.time()
    output = done.stdout + done.stderr
    assert_no_segment_left(output)
    starts = [float(m) for m in re.findall(r" started at (\d+\.\d+)", output)]
    return done.returncode, output, ended - min(starts, default=ended)


def line_of(text: str, after: str = "") -> int:
    """The number of job.py's first line holding `text` (after the first line holding `after`)."""
    lines = open(JOB).read().splitlines()
    start = next(i for i, line in enumerate(lines) if after in line)
    return next(i + 1 for i, line in enumerate(lines) if i >= start and text in line)


def assert_no_segment_left(output: str) -> None:
    """However the job ended, the shared-memory files of its MPI node segment are gone (job.py names them)."""
    for prefix in re.findall(r"^segment (\S+)$", output, re.MULTILINE):
        left = [name for name in os.listdir("/dev/shm") if name.startswith(prefix)]
        assert not left, (left, output)


FAILURE_NOISE = ("Abort(", "Exception ignored", "KeyboardInterrupt", "Return code", "run_rank.py", "<frozen runpy>")
"""What a failing job's output under `hpdl launch` used to hold beside its one traceback."""


@pytest.mark.parametrize("backend", ["mpi", "torch"])
def test_a_failing_four_rank_job_prints_one_traceback_and_one_line_for_each_other_rank(backend):
    code, output, elapsed = launch("-n", "4", "--backend", backend, JOB, "fail4")
    assert code == 1, output
    report = [line for line in output.splitlines() if not re.match(r"(rank \d of 4 on|segment )", line)]
    first = "hpdl: rank 2 failed: ValueError: bad batch on rank 2"
    raised = line_of('raise ValueError(f"bad batch')
    assert report[:3] == [first, "Traceback (most recent call last):", f'  File "{JOB}", line {raised}, in <module>'], (
        output
    )
    waits = f"({line_of('comm.barrier()', after='fail4')}|{line_of('time.sleep(0.05)', after='fail4')})"
    stopped = [line for line in report if line.startswith("hpdl: rank ") and line != first]
    assert sorted(re.sub(r"job\.py:\d+ ", "job.py:N ", line) for line in stopped) == [
        f"hpdl: rank {rank} stopped at {JOB}:N in <module>: rank 2: ValueError: bad batch on rank 2"
        for rank in (0, 1, 3)
    ], output
    assert all(re.search(f"job\\.py:{waits} in", line) for line in stopped), output
    assert report[3:5] == [
        '    raise ValueError(f"bad batch on rank {comm.rank}")',
        "ValueError: bad batch on rank 2",
    ], output
    assert len(report) == 5 + 3, output  # the header, the traceback (4 lines), one line for each other rank
    assert not [noise for noise in FAILURE_NOISE if noise in output], output
    assert elapsed < 40, output


def test_a_rank_killed_from_outside_is_named_and_the_others_say_where_they_stopped():
    code, output, _ = launch("-n", "2", JOB, "killed")
    assert code == 128 + signal.SIGKILL, output
    assert "hpdl launch: rank 1 was killed by SIGKILL" in output, output
    where = rf"at {re.escape(JOB)}:\d+ in <module>"
    assert re.search(rf"hpdl: rank 0 stopped by the launcher {where}: another rank ended without a report", output), (
        output
    )
    assert not [noise for noise in FAILURE_NOISE if noise in output], output


def _default_sigint() -> None:
    """The launcher as a terminal starts it: a suite run in the background of a non-interactive shell (CI's or a
    developer's `make test &`) inherits SIGINT ignored, which the launcher rightly keeps ignoring."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("sent", [signal.SIGINT, signal.SIGTERM])
def test_a_launcher_stopped_by_a_signal_stops_every_rank_and_leaves_no_shared_memory(sent):
    job = subprocess.Popen(
        HPDL + ["launch", "-n", "2", JOB, "sleep"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        preexec_fn=_default_sigint,
    )
    assert job.stdout is not None
    lines = []
    for line in job.stdout:  # until both ranks are in the script
        lines.append(line)
        if sum("sleeping" in seen for seen in lines) == 2:
            break
    job.send_signal(sent)
    output = "".join(lines) + job.stdout.read()
    assert job.wait(timeout=60) == 130, output
    assert "hpdl launch: interrupted; stopping every rank" in output, output
    for rank in (0, 1):
        sleeping = f"({line_of('time.sleep(60)') - 1}|{line_of('time.sleep(60)')})"  # its print, or its sleep
        assert re.search(rf"hpdl: rank {rank} interrupted at {re.escape(JOB)}:{sleeping} in <module>", output), output
    assert not [noise for noise in FAILURE_NOISE if noise in output], output
    assert_no_segment_left(output)


def test_a_bad_setting_is_one_line_before_any_rank_starts():
    done = subprocess.run(
        HPDL + ["launch", "-n", "2", JOB, "ok"],
        capture_output=True,
        text=True,
        env=dict(os.environ, HPDL_TIMEOUT="abc"),
    )
    assert done.returncode == 2, done
    assert done.stdout == "" and done.stderr == "hpdl launch: HPDL_TIMEOUT='abc' must be a number of seconds\n", done


@pytest.mark.parametrize("backend", ["mpi", "torch"])
def test_successful_job_exits_zero_with_tagged_output(backend):
    code, output, _ = launch("-n", "2", "--backend", backend, "--tag-output", JOB, "ok")
    assert code == 0, output
    assert "[0] rank 0 of 2 on " + backend in output.replace("[0]rank", "[0] rank"), output
    for rank in (0, 1):
        assert f"[{rank}] sum 3 in µs → ✓" in output, output
        assert f"[{rank}] rank {rank} still heard" in output and f"[{rank}] rank {rank} stderr: ±" in output, output
    if sys.platform.startswith("linux"):  # the job's sockets, read from /proc
        assert_listens_on_loopback_only(output, must_listen=backend == "torch")


def assert_listens_on_loopback_only(output: str, must_listen: bool) -> None:
    """Every listener of a local job (launcher, MPI or gloo transport, rendezvous store) binds 127.0.0.1."""
    reports = re.findall(r"rank \d+ listens on (\[[^\]]*\])", output)  # lines of two ranks may interleave
    assert len(reports) == 2, output
    seen = {address for report in reports for address in ast.literal_eval(report)}
    if must_listen:
        assert seen, output  # the rendezvous store (rank 0) and gloo's pairs do listen: where is the question
    assert all(address.startswith("127.") or address == "::1" for address in seen), output


def test_untagged_output_keeps_every_character_of_every_rank():
    code, output, _ = launch("-n", "2", JOB, "ok")
    assert code == 0, output
    assert output.count("sum 3 in µs → ✓") == 2, output
    assert "rank 0 still heard" in output and "rank 1 still heard" in output, output
    assert output.count("stderr: ±") == 2, output


@pytest.mark.parametrize("backend", ["mpi", "torch"])
def test_exception_on_one_rank_stops_the_job_with_one_traceback(backend):
    code, output, elapsed = launch("-n", "2", "--backend", backend, JOB, "raise")
    assert code != 0, output
    assert output.count("Traceback (most recent call last)") == 1, output
    assert output.count("\nRuntimeError: boom on the last rank") == 1, output  # the traceback's last line
    waits = line_of("comm.allreduce(x)  # the others wait here")
    assert f"hpdl: rank 0 stopped at {JOB}:{waits} in <module>: rank 1: RuntimeError: boom on the last rank" in output
    assert elapsed < 30, output


@pytest.mark.parametrize("backend", ["mpi", "torch"])
def test_nonzero_exit_of_one_rank_is_the_job_exit_code(backend):
    code, output, elapsed = launch("-n", "2", "--backend", backend, JOB, "exit3")
    assert code == 3, output
    assert elapsed < 25, output


@pytest.mark.parametrize("backend", ["mpi", "torch"])
def test_rank_that_dies_mid_collective_ends_the_job(backend):
    code, output, elapsed = launch("-n", "2", "--backend", backend, JOB, "die", env={"JOB_TIMEOUT": "10"})
    assert code != 0, output
    assert elapsed < 30, output


SIGNALED = """
import os, signal, time
rank = os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK"))  # MPICH's, Open MPI's
print(f"rank {rank} started at {time.time():.3f}", flush=True)
if rank == "1":
    os.kill(os.getpid(), signal.SIGBUS)  # what touching a page past a full /dev/shm does
"""


def test_a_rank_killed_by_a_signal_is_said_with_its_traceback_and_fails_the_job(tmp_path):
    """MPICH's forking launcher prints "signaled with Bus error" and exits 0: the job looked successful."""
    script = tmp_path / "signaled.py"
    script.write_text(SIGNALED)
    code, output, _ = launch("-n", "2", str(script))
    assert code == 128 + signal.SIGBUS, output
    from hpdl.runtime.spawn import local_mpiexec

    if local_mpiexec()[1] == "openmpi":  # its launcher says it itself
        assert "signal 7 (Bus error)" in output, output
        return
    assert "rank 1 died of SIGBUS" in output and "Fatal Python error: Bus error" in output, output
    assert 'signaled.py", line 6 in <module>' in output and "/dev/shm" in output, output


def test_gloo_job_without_finalize_exits_cleanly():
    # torch 2.13 + gloo aborts at exit unless the group is torn down after a barrier.
    for _ in range(3):
        code, output, _ = launch("-n", "2", "--backend", "torch", JOB, "noexit")
        assert code == 0, output
        assert "terminate called" not in output


def test_launcher_usage_errors():
    code, output, _ = launch("-n", "2", "no_such_script.py")
    assert code == 2 and "not found" in output
    code, output, _ = launch("-n", "0", JOB, "ok")
    assert code == 2 and "at least one rank" in output


def test_info_reports_versions_backends_and_launcher():
    leftover = f"/dev/shm/mpich_shm_{os.getpid():08x}_9"  # as a job killed a minute ago left it (nothing maps it)
    if os.path.isdir("/dev/shm"):
        with open(leftover, "wb") as segment:
            segment.write(b"\0" * 4096)
        os.utime(leftover, (time.time() - 60, time.time() - 60))
    try:
        done = subprocess.run(HPDL + ["info", "--json"], capture_output=True, text=True, timeout=60)
    finally:
        if os.path.exists(leftover):
            os.unlink(leftover)
    assert done.returncode == 0, done.stderr
    info = json.loads(done.stdout)
    assert info["mpi library"].startswith(("MPICH", "Open MPI", "Intel", "MVAPICH"))
    assert info["torch.distributed"]["gloo"] is True
    assert info["launcher"]["detected"] == "none" and info["launcher"]["auto backend"] == "self"
    assert "GPU" in info["cuda"]["mpi backend GPU path"]
    assert "THP_MEM_ALLOC_ENABLE" in info["memory"]["torch tensors >= 2 MB on huge pages"]
    assert "built-in" in info["shm thresholds"] and "hpdl tune" in info["shm thresholds"]  # conftest: file off
    assert info["two-rank collectives as messages"].startswith("allreduce below 32768 B; allgather every size")
    probes = not info["mpi library"].startswith(("MPICH", "Intel", "MVAPICH"))
    assert info["mpi receives"].startswith("after a matched probe" if probes else "at once"), info["mpi receives"]
    room = info["shared memory for windows"]  # (no /dev/shm off Linux: not checked)
    assert re.fullmatch(r"\d+ MB free in /dev/shm|little: .*--shm-size.*|not checked \(no /dev/shm\)", room), room
    if os.path.isdir("/dev/shm"):  # the one above, and any a killed job of another test left
        left = info["leftover MPI files in /dev/shm"]
        assert re.fullmatch(r"\d+ files? \(\d+ MB\) that killed jobs left; .*hpdl.runtime.shm_leftovers.*", left), left
    text = subprocess.run(HPDL + ["info"], capture_output=True, text=True, timeout=60).stdout
    assert "mpi library:" in text and "launcher:" in text


def test_launch_lines_people_type_for_mpirun_horovodrun_and_torchrun():
    """Pure parsing: the forms of `hpdl launch --help`, the script's own arguments untouched."""
    from hpdl.cli.launch import parse

    cases = {
        ("-n", "2", "train.py", "--lr", "0.1"): (2, ["train.py", "--lr", "0.1"], []),
        ("-n", "2", "python", "train.py", "-n", "5"): (2, ["train.py", "-n", "5"], []),
        ("-np", "3", "python3", "-u", "train.py", "--help"): (3, ["train.py", "--help"], []),
        ("--nproc-per-node", "2", "python", "-O", "-X", "dev", "train.py"): (2, ["train.py"], ["-O", "-X", "dev"]),
        ("--nproc_per_node=4", "--backend", "torch", "train.py"): (4, ["train.py"], []),
        ("-n", "2", "-m", "pkg.mod", "--flag", "-m", "x"): (2, ["-m", "pkg.mod", "--flag", "-m", "x"], []),
        ("-n", "2", "python", "-m", "pkg.mod", "-n", "1"): (2, ["-m", "pkg.mod", "-n", "1"], []),
        ("--tag-output", "-n", "1", "--timeout", "9", sys.executable, "train.py"): (1, ["train.py"], []),
    }
    cwd = os.getcwd()
    os.chdir(os.path.dirname(JOB))  # a script must exist: job.py stands in for train.py
    try:
        for argv, (nprocs, target, python_options) in cases.items():
            argv = tuple("job.py" if a == "train.py" else a for a in argv)
            target = ["job.py" if a == "train.py" else a for a in target]
            command = parse(list(argv))
            assert (command.options.nprocs, command.target, command.python_options) == (nprocs, target, python_options)
    finally:
        os.chdir(cwd)
    for bad, message in (
        (["job.py"], "say how many ranks"),
        (["-n", "2"], "name a script"),
        (["-n", "2", "python", "-c", "print(1)"], "not supported"),
        (["-n", "2", "python", "-m"], "name the module"),
    ):
        with pytest.raises(ValueError, match=message):
            parse(bad)


def test_launch_forms_run_with_the_scripts_arguments_untouched():
    code, output, _ = launch("-n", "2", "python", JOB, "argv", "--lr", "0.1", "--help", "-n", "7")
    assert code == 0 and "argv ['--lr', '0.1', '--help', '-n', '7']" in output, output
    env = {"PYTHONPATH": os.path.dirname(JOB)}  # job.py as the module `job`
    code, output, _ = launch("-np", "1", "-m", "job", "argv", "-m", "x", env=env)
    assert code == 0 and "argv ['-m', 'x']" in output, output
    code, output, _ = launch("--help")
    assert code == 0 and "hpdl launch -np 2 python train.py" in output and "-m package.module" in output


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the sockets from /proc")
@pytest.mark.parametrize("backend", ["mpi", "torch"])
def test_torch_own_init_runs_and_listens_on_loopback_only(backend):
    """A script that calls torch's own `init_process_group("gloo")` (env://) instead of hpdl's.

    Under --backend torch it once failed with EADDRINUSE (the launcher holds the store's port for rank 0),
    and under MPI its store listened on every interface. (hpdl's own init: the tagged-output test above.)
    """
    code, output, _ = launch("-n", "2", "--backend", backend, TORCH_ENV_JOB, "listeners")
    assert code == 0, output
    assert len(re.findall(r"rank \d of 2: sum 3", output)) == 2, output
    assert_listens_on_loopback_only(output, must_listen=True)


def test_hpdl_init_on_the_scripts_own_group_names_a_rank_that_never_comes():
    """`hpdl.init("torch")` after the script's own `init_process_group`: hpdl's communicator on that group, and
    the progress reports that name a missing rank go through the group's own store."""
    code, output, elapsed = launch("-n", "2", "--backend", "torch", TORCH_ENV_JOB, "hpdl")
    assert code != 0 and output.count(": hpdl sum 6") == 2, output
    assert re.search(r"CommTimeoutError: allreduce #\d+ .*within 2.0 s.*Did not arrive: rank 0", output), output
    assert elapsed < 25, output  # ended by rank 1's error, not by rank 0's sleep


def test_a_dead_jobs_shared_memory_is_removed_by_the_launcher_that_reuses_its_pid(tmp_path):
    """MPICH names a gforker job's segment after the launcher's pid; `remove_forker_segments` must remove that name.

    A killed job leaves its segment in /dev/shm, and a later job whose gforker got the same pid opened it at
    MPI_Init (seen: "Message from rank 1 and tag 7 truncated"); hpdl's launcher removes it before and after.
    """
    from hpdl.runtime.spawn import local_mpiexec, remove_forker_segments

    mpiexec, flavour = local_mpiexec()
    if flavour != "gforker":
        pytest.skip(f"the launcher here is {flavour}, not the mpich wheel's mpiexec.gforker")
    script = tmp_path / "segments.py"
    script.write_text(  # the shared-memory files MPICH mapped into this rank, and its launcher's pid
        "import os\nfrom mpi4py import MPI\nMPI.COMM_WORLD.Barrier()\n"
        "maps = {line.split()[-1] for line in open('/proc/self/maps') if '/dev/shm/mpich_' in line}\n"
        "if MPI.COMM_WORLD.rank == 0:\n    print(os.getppid(), sorted(os.path.basename(m) for m in maps), flush=True)\n"
    )
    done = subprocess.run([mpiexec, "-n", "2", sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    pid, names = done.stdout.splitlines()[0].split(" ", 1)
    mapped = ast.literal_eval(names)
    assert mapped, done.stdout  # MPICH's node segment for two ranks on one machine
    left = tmp_path / "shm"  # as a killed job leaves them, beside another job's
    left.mkdir()
    for name in [*mapped, "mpich_shm_1234abcd_0"]:
        (left / name).write_bytes(b"")
    removed = sorted(os.path.basename(p) for p in remove_forker_segments(int(pid), root=str(left)))
    assert removed == sorted(mapped)
    assert os.listdir(left) == ["mpich_shm_1234abcd_0"]


SEGMENTS_JOB = """
import os, signal, sys, time
from mpi4py import MPI
MPI.COMM_WORLD.Barrier()
names = ('/dev/shm/mpich_shm_', '/dev/shm/vader_segment.', '/dev/shm/sm_segment.')  # MPICH's, Open MPI's
maps = sorted({line.split()[-1] for line in open('/proc/self/maps') if any(name in line for name in names)})
report, end = sys.argv[1], sys.argv[2]
if MPI.COMM_WORLD.rank == 0:
    with open(report + '.part', 'w') as out:
        print(repr(maps), file=out)
    os.rename(report + '.part', report)
MPI.COMM_WORLD.Barrier()
if end == 'killed':
    os.kill(os.getpid(), signal.SIGKILL)  # as a failure, a timeout or a test's teardown ends a job
deadline = time.monotonic() + 60
while not os.path.exists(end) and time.monotonic() < deadline:
    time.sleep(0.05)
"""


def _job_segments(report, deadline: float) -> list[str]:
    while not report.exists():
        assert time.monotonic() < deadline, "the job did not say which segment files it maps"
        time.sleep(0.05)
    return list(ast.literal_eval(report.read_text()))


def test_the_segment_files_a_killed_job_leaves_in_dev_shm_are_found_and_a_running_jobs_are_not(tmp_path):
    """MPICH keeps a job's node segment in /dev/shm until its ranks finalise, Open MPI each rank's: a killed job's
    stay (MPICH 2-3 MB a job, Open MPI 4 MB a rank, until reboot; the suite left some 23 MB per run).
    `shm_leftovers` finds such files by nothing using them."""
    from hpdl.runtime import shm_leftovers
    from hpdl.runtime.spawn import local_mpiexec, mpiexec_argv

    if local_mpiexec()[1] not in ("gforker", "hydra"):  # (the next test covers Open MPI's names)
        pytest.skip("Open MPI's launcher removes a killed rank's segments itself: it leaves them only when it dies too")
    script, release = tmp_path / "segments.py", tmp_path / "release"
    script.write_text(SEGMENTS_JOB)
    started, deadline = time.time(), time.monotonic() + 60
    job = [*mpiexec_argv(2), sys.executable, str(script)]
    running = subprocess.Popen([*job, str(tmp_path / "running.txt"), str(release)])
    try:
        live = _job_segments(tmp_path / "running.txt", deadline)
        killed = subprocess.run([*job, str(tmp_path / "killed.txt"), "killed"], capture_output=True, timeout=60)
        assert killed.returncode != 0, killed
        dead = _job_segments(tmp_path / "killed.txt", deadline)
        assert live and dead and all(os.path.exists(path) for path in live + dead), (live, dead)
        found = shm_leftovers.leftovers(since=started, settle=0)
        assert set(dead) <= set(found) and not set(live) & set(found), (live, dead, found)
        # The command lists; only this test's dead files are removed: with no settling time a sweep could take a
        # segment another test's job is creating at this moment (settling is what keeps a real sweep off those).
        listing = [sys.executable, "-m", "hpdl.runtime.shm_leftovers", "--dry-run", "--settle", "0"]
        listed = subprocess.run(listing, capture_output=True, text=True, timeout=60)
        assert listed.returncode == 0, listed.stdout + listed.stderr
        assert set(dead) <= set(listed.stdout.split()) and not set(live) & set(listed.stdout.split()), listed.stdout
        assert shm_leftovers.remove(dead) > 0
        assert not any(os.path.exists(path) for path in dead) and all(os.path.exists(path) for path in live)
    finally:
        release.touch()
        assert running.wait(timeout=60) == 0
    assert not any(os.path.exists(path) for path in live)  # finalised: the MPI library removed its own


def test_open_mpi_segments_nothing_holds_are_leftovers_and_held_ones_are_not(tmp_path):
    """Open MPI (4.x vader, 5.x sm) keeps one segment file per rank; a job whose launcher died with it leaves them
    (340 of them, 4-16 MB each, piled up in this VM's /dev/shm over a week of Open MPI runs). Found by name and by
    nothing mapping or holding them, as MPICH's; a file held open, or a name of neither library, is not one."""
    from hpdl.runtime import shm_leftovers

    uid = os.getuid()
    names = [f"vader_segment.host.{uid}.1a2b0001.0", f"sm_segment.host.{uid}.3c4d0001.1", f"sm_segment.host.{uid}.x.2"]
    names.append("not_an_mpi_file.0")
    old = time.time() - 60
    for name in names:
        (tmp_path / name).write_bytes(b"\0" * 64)
        os.utime(tmp_path / name, (old, old))
    with open(tmp_path / names[2], "rb"):  # held open (a live rank maps or holds its segment)
        found = shm_leftovers.leftovers(root=str(tmp_path), settle=1)
    assert found == sorted(str(tmp_path / name) for name in names[:2]), found


def test_ranks_put_large_torch_tensors_on_huge_pages_unless_the_caller_chose():
    """Without it every step's fresh activations cost a page fault per 4 KB (kernel time > compute at 2048^2)."""
    from hpdl.runtime import spawn

    assert spawn.job_environment("mpi", 2, base={})["THP_MEM_ALLOC_ENABLE"] == "1"
    assert spawn.job_environment("torch", 2, base={"THP_MEM_ALLOC_ENABLE": "0"})["THP_MEM_ALLOC_ENABLE"] == "0"


def test_ranks_get_their_share_of_the_cores_in_openmp_and_tensorflows_pools_unless_the_caller_chose():
    """TensorFlow ignores OMP_NUM_THREADS: without its own variables every rank's pools take the whole machine."""
    from hpdl.runtime import spawn

    env = spawn.job_environment("mpi", 2, base={})
    share = str(spawn.threads_per_rank(2))
    assert [env[k] for k in ("OMP_NUM_THREADS", *spawn.TF_THREAD_VARIABLES)] == [share] * 3, env
    env = spawn.job_environment("mpi", 2, base={"OMP_NUM_THREADS": "3", "TF_NUM_INTEROP_THREADS": "2"})
    assert [env[k] for k in ("OMP_NUM_THREADS", *spawn.TF_THREAD_VARIABLES)] == ["3", "3", "2"], env


def test_an_outer_jobs_launch_variables_go_and_the_users_open_mpi_settings_stay():
    """Open MPI refuses to run as root (most containers) without OMPI_ALLOW_RUN_AS_ROOT(_CONFIRM), and
    OMPI_MCA_* choose its transports: a launch that dropped every OMPI_ variable could not start there."""
    from hpdl.runtime import spawn

    user = {
        "OMPI_ALLOW_RUN_AS_ROOT": "1",
        "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
        "OMPI_MCA_btl": "self,vader",
        "OMPI_MCA_osc": "^ucx",
        "PRTE_MCA_ras_base_verbose": "1",
        "MPIR_CVAR_CH4_SHM_POSIX_EAGER": "iqueue",
    }
    outer = {
        "OMPI_COMM_WORLD_RANK": "3",
        "OMPI_COMM_WORLD_SIZE": "8",
        "OMPI_UNIVERSE_SIZE": "8",
        "OMPI_FILE_LOCATION": "/tmp/ompi.1/1/3",
        "OMPI_MCA_initial_wdir": "/home",
        "OMPI_MCA_num_procs": "8",
        "OMPI_MCA_orte_hnp_uri": "1.0;tcp://10.0.0.1:4000",
        "OMPI_MCA_ess": "env",
        "PRTE_LAUNCHED": "1",
        "OPAL_USER_PARAMS_GIVEN": "1",
        "PMIX_RANK": "3",
        "PMI_RANK": "3",
        "RANK": "3",
        "MASTER_PORT": "29500",
        "TORCHELASTIC_RUN_ID": "x",
    }
    env = spawn.job_environment("mpi", 2, base={**user, **outer})
    assert {k: env.get(k) for k in user} == user
    assert not set(outer) & set(env), set(outer) & set(env)
    # unless the user chose, local Open MPI ranks meet in shared memory: its TCP transport listens everywhere
    assert spawn.job_environment("mpi", 2, base={})["OMPI_MCA_btl"] == "^tcp"


def test_rank_labels_of_gforker_and_open_mpi_read_as_hydras():
    import io

    from hpdl.runtime.processes import relabel_lines

    raw = b"0>a\n[1,12]<stdout>: b\n[1,3]<stderr>: c\n[1] d\nplain 1> e\n"
    sink = io.StringIO()
    relabel_lines(io.BytesIO(raw), sink)
    assert sink.getvalue() == "[0] a\n[12] b\n[3] c\n[1] d\nplain 1> e\n"

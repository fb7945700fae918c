"""A lab: a two-node cluster on your laptop, and what a slow link between nodes does to an allreduce.

    sudo .venv/bin/python examples/lab_cluster.py [--link 1gbit] [--size 16M]

As root on Linux it makes two hosts, a and b, out of network namespaces on a bridge, each host's link shaped
to `--link` (hpdl cluster up), runs 4 ranks on them (hpdl launch -n 4 -H a:2,b:2, from host a, through the
cluster's stand-in for ssh), and compares, on the same data:
1. where the ranks are: each on its host, with its place on it (from the real host names);
2. the flat allreduce (every byte of every rank crosses the link, as MPI's ring sends it) against the
   hierarchical one (summed in shared memory inside each host, then one leader per host across the link),
   each as a fraction of what the link allows;
3. the same sum both ways (the answer does not depend on the path).
Without root it says why and what to run instead. The cluster is removed at the end, whatever happens.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.abspath(__file__)


def lab_main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--link", default="1gbit", help="each host's link rate, tc's units (default 1gbit)")
    parser.add_argument("--size", default="16M", help="bytes per rank of the allreduce (default 16M)")
    parser.add_argument("--reps", type=int, default=5, help="timed calls per path (default 5)")
    args = parser.parse_args()

    from hpdl.bench.cluster import bits_per_second
    from hpdl.bench.report import parse_bytes
    from hpdl.runtime import sim_cluster

    why = sim_cluster.available()
    if why:
        print(f"lab_cluster: a simulated cluster cannot be made here: {why}.")
        print("  Run it as root on Linux (sudo .venv/bin/python examples/lab_cluster.py), or on a real cluster:")
        print("  hpdl launch -n 4 -H node1:2,node2:2 examples/lab_cluster.py --worker")
        return 0
    bits_per_second(args.link)  # a bad rate fails before anything is made
    cluster = sim_cluster.up(2, args.link, "hpdllab")
    print(f"== a cluster on this machine: {', '.join(f'{h} {a}' for h, a in cluster.addresses.items())}, "
          f"each link {args.link}", flush=True)  # fmt: skip
    try:
        worker = [
            HERE,
            "--worker",
            "--link",
            args.link,
            "--size",
            str(parse_bytes(args.size)),
            "--reps",
            str(args.reps),
        ]
        launch = [
            sys.executable, "-m", "hpdl.cli.main", "launch", "-n", "4", "-H", "a:2,b:2",
            "--launcher-exec", sim_cluster.remote_shell(), *worker,
        ]  # fmt: skip
        on_a = [sys.executable, "-m", "hpdl.cli.main", "cluster", "--name", cluster.name, "exec", "a", *launch]
        env = dict(os.environ, HPDL_CLUSTER=cluster.name, OMP_NUM_THREADS="1")
        return subprocess.run(on_a, env=env, timeout=600).returncode
    finally:
        sim_cluster.down(cluster.name)


def worker(link: str, nbytes: int, reps: int) -> None:
    """Every rank: where it is, then the two allreduces, alternating, timed by the slowest rank."""
    import socket

    import torch

    import hpdl
    from hpdl.bench.cluster import bits_per_second

    hier = hpdl.init()
    flat = hier.split(0, hier.rank)
    assert flat is not None
    flat.shared_memory = False  # type: ignore[attr-defined]  # plain MPI: no shared memory, no leaders
    places = hier.allgather_object(f"rank {hier.rank} on host {socket.gethostname()}, {hier.local_rank + 1} of "
                                   f"{hier.local_size} there")  # fmt: skip
    say = print if hier.rank == 0 else (lambda *a, **k: None)
    say("\n== 1. where the ranks are (hpdl.init() reads it from the host names)")
    for line in places:
        say(f"   {line}")

    data = torch.arange(nbytes // 4, dtype=torch.float32) + hier.rank
    times: dict[str, list[float]] = {"flat": [], "hierarchical": []}
    results = {}
    for rep in range(reps + 1):
        for name, comm in (
            (("flat", flat), ("hierarchical", hier)) if rep % 2 else (("hierarchical", hier), ("flat", flat))
        ):
            x = data.clone()
            hier.barrier()
            start = time.perf_counter()
            comm.allreduce(x)
            slowest = hier.allgather_object(time.perf_counter() - start)
            if rep:  # the first round warms up (connections, shared memory)
                times[name].append(max(slowest))
            results[name] = x
    bound = nbytes * 8 / bits_per_second(link)  # a leader must send its host's whole sum across the link once
    say(f"\n== 2. allreduce of {nbytes / 2**20:g} MiB per rank across a {link} link (median of {reps}, the slowest "
        f"rank; the link allows {bound * 1e3:.0f} ms)")  # fmt: skip
    for name in ("flat", "hierarchical"):
        median = statistics.median(times[name])
        say(f"   {name:>12}: {median * 1e3:7.1f} ms  = {bound / median:4.0%} of what the link allows")
    speedup = statistics.median(times["flat"]) / statistics.median(times["hierarchical"])
    say(f"   hierarchical is {speedup:.2f}x the flat one: inside a host the ranks sum in shared memory, and one")
    say("   leader per host sends the host's sum across the link; the flat one is MPI's among all 4 ranks")
    same = torch.equal(results["flat"], results["hierarchical"])
    say(f"\n== 3. the same sum both ways: {same}")
    if not same:
        raise SystemExit("the two paths gave different sums")
    hpdl.finalize()


if __name__ == "__main__":
    if "--worker" in sys.argv:
        parser = argparse.ArgumentParser()
        parser.add_argument("--worker", action="store_true")
        parser.add_argument("--link", default="1gbit")
        parser.add_argument("--size", type=int, default=16 << 20)
        parser.add_argument("--reps", type=int, default=5)
        options = parser.parse_args()
        worker(options.link, options.size, options.reps)
    else:
        sys.exit(lab_main())

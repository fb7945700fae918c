"""`hpdl plan calibrate -H a:2,b:2` on a simulated cluster of two hosts whose links are shaped to 200 Mbit/s.

The cluster file must describe what the probe ran on: 2 nodes of 2 ranks, the link between the hosts near its
shaped rate and the shared memory inside each host far above it. Where namespaces cannot be made (no root, no
CAP_NET_ADMIN) the test skips, saying why.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Iterator

import pytest

from hpdl.plan.cluster import load_cluster_file
from hpdl.runtime import sim_cluster

LINK_Bps = 200e6 / 8
"""The shaped rate of each host's link (200mbit), bytes per second."""

why_not = sim_cluster.available()
pytestmark = pytest.mark.skipif(why_not is not None, reason=f"no simulated cluster here: {why_not}")


@pytest.fixture(scope="module")
def cluster() -> Iterator[sim_cluster.Cluster]:
    name = f"hpdlp{os.environ.get('PYTEST_XDIST_WORKER', '')}"
    made = sim_cluster.up(2, "200mbit", name)
    try:
        yield made
    finally:
        sim_cluster.down(name)


def test_calibrate_across_two_hosts_measures_shared_memory_and_the_shaped_link_apart(cluster, tmp_path):
    out = tmp_path / "cluster.toml"
    command = (
        f"{sys.executable} -m hpdl.cli.main plan calibrate --quick -H a:2,b:2 "
        f"--launcher-exec {sim_cluster.remote_shell()} --out {out}"
    )
    env = dict(os.environ, HPDL_CLUSTER=cluster.name, OMP_NUM_THREADS="1")
    argv = [sys.executable, "-m", "hpdl.cli.main", "cluster", "--name", cluster.name, "exec", "a", command]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    measured = load_cluster_file(str(out))
    assert (measured.nodes, measured.devices_per_node) == (2, 2)
    # Per device: the 2 ranks of a host cross the host's one link at once, so each gets about half its rate
    # (a little more: the token bucket lets its 256 KB burst through at wire speed).
    per_host = measured.inter.bandwidth_Bps * measured.devices_per_node
    assert LINK_Bps / 2 <= per_host <= 2 * LINK_Bps, measured.to_toml()
    assert measured.intra.bandwidth_Bps > 10 * per_host, measured.to_toml()

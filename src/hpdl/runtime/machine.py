"""`describe`: where and with what this process runs (host, CPU, Python, torch, NumPy, MPI, hpdl versions).

Benchmarks record it beside every measurement (`hpdl.bench.report.environment`
is this function) and `hpdl demo` writes it into its report, so that a
number can be rerun and compared.
"""

from __future__ import annotations

import datetime
import os
import platform
import socket
from typing import Any, Optional

import numpy as np

from hpdl._version import __version__

__all__ = ["describe"]


def describe(**extra: Any) -> dict[str, Any]:
    """Where and with what a measurement ran: enough to rerun it (rule 6 of BENCHMARKING.md)."""
    import torch

    env: dict[str, Any] = {
        "hostname": socket.gethostname(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_version": torch.__version__,
        "numpy_version": np.__version__,
        "torch_threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "thp_mem_alloc_enable": os.environ.get("THP_MEM_ALLOC_ENABLE"),  # torch's large tensors on huge pages
        "transparent_hugepage": {name: _chosen(transparent_hugepage(name)) for name in ("enabled", "defrag")},
    }
    try:
        import mpi4py
        from mpi4py import MPI

        text = MPI.Get_library_version().replace("\x00", "").strip()  # Open MPI's ends in a NUL
        env["mpi_library_version"] = " ".join(text.splitlines()[0].split())
        env["mpi_library_version_full"] = text
        env["mpi_standard"] = "{}.{}".format(*MPI.Get_version())
        env["mpi4py_version"] = mpi4py.__version__
    except ImportError:
        env["mpi_library_version"] = None
    env["hpdl_version"] = __version__
    env.update(extra)
    return env


def transparent_hugepage(name: str) -> Optional[str]:
    """The kernel's transparent huge page setting `name` ("enabled", "defrag") as it reads, such as
    "always [madvise] never" (the choice in brackets); None where there is none."""
    try:
        with open(f"/sys/kernel/mm/transparent_hugepage/{name}") as setting:
            return setting.read().strip()
    except OSError:
        return None


def _chosen(setting: Optional[str]) -> Optional[str]:
    """The bracketed choice of a kernel setting ("madvise" of "always [madvise] never")."""
    if setting is None:
        return None
    chosen = [word[1:-1] for word in setting.split() if word.startswith("[")]
    return chosen[0] if chosen else setting


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"

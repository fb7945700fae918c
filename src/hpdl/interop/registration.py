"""Register the "hpdl" backend with torch.distributed, cheaply (this runs on every `import hpdl`).

`import hpdl` does not import torch (the launcher and `hpdl info` stay
light): it registers at once when torch is loaded, else right after
`import torch` finishes, which every program that reaches
`init_process_group` has done. Two things happen then, and nothing heavy is
imported:
- `Backend.register_backend("hpdl", ...)` with the extended API, so that
  `init_process_group("hpdl")` and `new_group(backend="hpdl")` reach
  `create_process_group` (imported on first use);
- the `env://` rendezvous learns to work under an MPI launcher without
  MASTER_ADDR/MASTER_PORT: rank 0 opens a TCPStore on a free port and
  broadcasts its address over MPI. torchrun-style variables, when present,
  are used exactly as before.

Programs that never import hpdl get the same when they ask for "hpdl", through
the package's entry points, which name `hpdl_torch_autoload` (outside this
package: it cannot fail, and imports hpdl only when "hpdl" is asked for, so
`import torch` alone changes nothing). torch >= 2.14 calls its `register` from
the "torch.distributed.backends" group when a group of that backend is made;
before 2.14 its `autoload` ("torch.backends", inside `import torch`) registers
the name with an on-request hook that brings the program here. `register`
below replaces that hook with the plain name.
"""

from __future__ import annotations

import os
from typing import Any, Iterator

from hpdl.interop.import_hooks import when_imported

__all__ = ["BACKEND_NAME", "register", "register_when_torch_loads", "autoload", "create"]

BACKEND_NAME = "hpdl"
_registered = False


def register() -> None:
    """Make "hpdl" a torch.distributed backend (idempotent; a no-op without torch.distributed)."""
    global _registered
    if _registered:
        return
    import torch.distributed as dist

    if not dist.is_available():
        return
    import importlib

    # `torch.distributed.rendezvous` the attribute is a function; the module holds the handlers.
    rendezvous_module = importlib.import_module("torch.distributed.rendezvous")

    if not isinstance(dist.Backend.__dict__.get(BACKEND_NAME.upper(), BACKEND_NAME), str):
        type.__setattr__(dist.Backend, BACKEND_NAME.upper(), BACKEND_NAME)  # hpdl_torch_autoload's on-request hook
    dist.Backend.register_backend(BACKEND_NAME, create, extended_api=True, devices=["cpu", "cuda"])
    original = rendezvous_module._rendezvous_handlers.get("env")
    if original is not None and not getattr(original, "_hpdl", False):
        rendezvous_module._rendezvous_handlers["env"] = _env_or_mpi(original)
    _registered = True


def autoload() -> None:
    """`import hpdl`'s registration once torch is loaded (possibly while torch is still importing): register, and
    never break the import that triggered it.

    An error here becomes a warning that says what happened; `init_process_group("hpdl")` then raises that the
    backend is unknown, or hpdl_torch_autoload says why when it is asked for.
    """
    try:
        register()
    except Exception as exc:  # noqa: BLE001 - torch must import whatever happens here
        import warnings

        warnings.warn(
            f"hpdl could not register its torch.distributed backend ({type(exc).__name__}: {exc}); "
            'init_process_group("hpdl") will not find it',
            RuntimeWarning,
            stacklevel=2,
        )


def register_when_torch_loads() -> None:
    """Register now if torch is loaded, else once `import torch` has finished (torch itself is not imported here)."""
    when_imported("torch", autoload)  # guarded: torch may be mid-import here (its entry point loads hpdl)


def create(backend_options: Any, pg_options: Any) -> Any:
    """torch's creator of an "hpdl" group (`init_process_group`, `new_group`)."""
    from hpdl.interop.torch_backend.factory import create_process_group

    return create_process_group(backend_options, pg_options)


def _env_or_mpi(original: Any) -> Any:
    def handler(url: str, **kwargs: Any) -> Iterator[Any]:
        if _needs_mpi_rendezvous():
            from hpdl.interop.torch_backend.rendezvous import mpi_rendezvous

            return mpi_rendezvous(url, kwargs.get("timeout"))
        return original(url, **kwargs)

    handler._hpdl = True  # type: ignore[attr-defined]
    return handler


def _needs_mpi_rendezvous() -> bool:
    """Under an MPI launcher (or `hpdl launch`) with no MASTER_ADDR/MASTER_PORT: agree on a store over MPI."""
    if os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT"):
        return False
    from hpdl.runtime.environment import detect

    launch = detect()
    return launch.backend == "mpi" and launch.launcher != "torchrun"

"""torch's autoload entry point for hpdl: cannot fail, imports nothing of hpdl, changes nothing until "hpdl" is
asked for.

torch calls every "torch.backends" entry point at the end of `import torch` and turns any exception into its own
`RuntimeError: Failed to load the backend extension`, failing the import for the whole environment; so this
module sits outside the `hpdl` package (a folder named `hpdl` first on the path, a half-removed install or an hpdl
that fails at import cannot reach it) and catches everything. It does not import hpdl either: `import torch` in
a program that never asks for hpdl leaves os.environ, torch's rendezvous handlers and Open MPI's settings as
they were (`import hpdl` would choose Open MPI defaults and teach env:// to meet over MPI).

- On every torch `Backend.HPDL` becomes a hook that imports hpdl (which registers for real) when torch reads it,
  that is when `init_process_group("hpdl")` or `new_group(backend="hpdl")` starts (`Backend("hpdl")`), before
  its rendezvous: under a plain `mpiexec` (no MASTER_ADDR) env:// then meets over MPI. That attribute is the
  one change `import torch` makes. torch >= 2.14 would find "hpdl" by itself in the
  "torch.distributed.backends" entry points, but only after the env:// rendezvous has failed for want of
  MASTER_ADDR.
- Older torch only knows the names registered before `init_process_group` runs: "hpdl" is also registered by
  name, with a creator that imports hpdl on first use.
"""

from __future__ import annotations

from typing import Any

__all__ = ["autoload", "create", "register"]

NAME = "hpdl"
_failed: list[str] = []


def autoload() -> None:
    """The "torch.backends" entry point (inside `import torch`): "hpdl" on request, lazily; never raise."""
    try:
        import torch.distributed as dist

        if not dist.is_available():
            return
        backend = dist.Backend
        if NAME in backend.backend_list:
            return  # hpdl registered already
        if not hasattr(backend, "_ensure_backend_registered"):  # torch < 2.14: no entry-point group to find it
            backend.register_backend(NAME, create, extended_api=True, devices=["cpu", "cuda"])
        type.__setattr__(backend, NAME.upper(), _OnRequest())
    except Exception as error:  # noqa: BLE001 - torch's import must survive anything here
        _warn(f"hpdl's torch.distributed backend is not registered ({type(error).__name__}: {error})")


class _OnRequest:
    """`Backend.HPDL` until hpdl is imported: torch reads it in `Backend("hpdl")`, the first thing a group of this
    backend does; reading it imports hpdl, whose registration puts the plain string back."""

    def __get__(self, instance: Any, owner: Any = None) -> str:
        register()
        return NAME


def register() -> Any:
    """Import hpdl and register its backend for real (env:// over MPI included); the "torch.distributed.backends"
    entry point (torch >= 2.14 calls it when "hpdl" is asked for). Returns hpdl's registration module. A failure
    is a RuntimeError that says why, raised to whoever asked for "hpdl" (never to `import torch`)."""
    try:
        from hpdl.interop import registration

        registration.register()
        return registration
    except Exception as error:
        import torch.distributed as dist

        if not isinstance(dist.Backend.__dict__.get(NAME.upper(), NAME), str):
            type.__setattr__(dist.Backend, NAME.upper(), NAME)  # ask once: the group's creator says it again
        raise RuntimeError(_why(error)) from error


def create(backend_options: Any, pg_options: Any) -> Any:
    """The creator torch calls for an "hpdl" group: hpdl's own, imported now."""
    return register().create(backend_options, pg_options)


def _why(error: BaseException) -> str:
    asked, said = 'the "hpdl" torch.distributed backend was asked for, but', f"({type(error).__name__}: {error})"
    if isinstance(error, ImportError):
        return f"{asked} importing hpdl failed {said}; is another `hpdl` (a folder of that name) first on sys.path?"
    return f"{asked} hpdl could not register it {said}"


def _warn(message: str) -> None:
    if message in _failed:
        return
    _failed.append(message)
    import warnings

    warnings.warn(message, RuntimeWarning, stacklevel=3)

"""torch's autoload entry point for hpdl, kept outside the `hpdl` package so that `import torch` never breaks.

torch calls every "torch.backends" entry point at the end of `import torch` and turns any exception into its own
`RuntimeError: Failed to load the backend extension`, failing the import for the whole environment. The entry
point named a module inside `hpdl`, so a folder named `hpdl` first on the path (the working directory will do),
a half-removed install or an hpdl that fails at import broke `import torch` itself. This module imports nothing
but the standard library until it is called, and then imports hpdl inside a guard: whatever state hpdl is in,
torch imports, and a program that asks for the "hpdl" backend is told why it is missing.
"""

from __future__ import annotations

__all__ = ["autoload"]


def autoload() -> None:
    """Register hpdl's torch.distributed backend if hpdl imports; else warn once and leave torch alone."""
    try:
        from hpdl.interop.registration import autoload as register
    except Exception as error:  # noqa: BLE001 - torch's import must survive any state of hpdl
        import warnings

        warnings.warn(
            f"hpdl's torch.distributed backend is not registered: importing hpdl failed ({type(error).__name__}: "
            f"{error}); init_process_group('hpdl') will not find it (is another `hpdl` first on sys.path?)",
            RuntimeWarning,
            stacklevel=2,
        )
        return
    register()

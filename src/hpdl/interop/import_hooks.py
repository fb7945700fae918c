"""Run a callback once a module has finished importing, without importing it (post-import hooks).

`import hpdl` must not import torch (the launcher has no use for it) nor
torch._dynamo (a second of start-up), yet the "hpdl" backend has to be
registered once torch is loaded, and kept out of dynamo's tracing once
dynamo is. The module's own loader calls the callbacks when its code has run.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
import warnings
from typing import Any, Callable, Optional, Sequence

__all__ = ["when_imported"]

_waiting: dict[str, list[Callable[[], None]]] = {}


def when_imported(name: str, callback: Callable[[], None]) -> None:
    """Call `callback()` now if module `name` is loaded, else right after its import finishes (once, however
    often it is asked for)."""
    if name in sys.modules:
        callback()
        return
    callbacks = _waiting.setdefault(name, [])
    if callback not in callbacks:
        callbacks.append(callback)
    if not any(isinstance(finder, _AfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds a watched module with the finders after it and has that module's loader run the callbacks."""

    def find_spec(
        self, fullname: str, path: Optional[Sequence[str]], target: Optional[types.ModuleType] = None
    ) -> Optional[importlib.machinery.ModuleSpec]:
        callbacks = _waiting.pop(fullname, None)
        if callbacks is None:
            return None
        if not _waiting:
            sys.meta_path.remove(self)
        for finder in sys.meta_path:
            if finder is self:
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    _call_after(spec.loader, callbacks)
                return spec
        return None


def _call_after(loader: Any, callbacks: list[Callable[[], None]]) -> None:
    original = loader.exec_module

    def exec_module(module: types.ModuleType) -> None:
        original(module)
        del loader.exec_module  # the loader belongs to this module alone: as it was from here on
        for callback in callbacks:
            try:
                callback()
            except Exception as error:  # noqa: BLE001 - the user's import must not fail because of hpdl
                warnings.warn(f"hpdl: after importing {module.__name__}: {error!r}", stacklevel=2)

    loader.exec_module = exec_module

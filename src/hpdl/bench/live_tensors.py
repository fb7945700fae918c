"""The bytes every live tensor holds, by storage: the zero benches' memory probe (2-rank MLP and composed layouts)."""

from __future__ import annotations

import gc


def live_bytes() -> dict[int, int]:
    """data_ptr -> bytes of every storage of a live tensor object (CPU)."""
    import torch

    out = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor):
            try:
                storage = obj.untyped_storage()
                if storage.device.type != "meta" and storage.nbytes():
                    out[storage.data_ptr()] = storage.nbytes()
            except Exception:  # wrapper subclasses (DTensor) hold their data in a local tensor, counted itself
                continue
    return out

"""The buffers of one ZeRO unit on one rank: compute flat, master shard, gradient shard, optimizer pieces.

For a unit (`zero_partition.Unit`) of P padded elements and shard size S:

- `flat` (P elements, compute dtype, the parameters' device) holds the full
  parameters; every parameter of the unit is a view into it. Stages 1 and 2
  keep it; stage 3 keeps its storage at 0 bytes except while the unit is
  gathered (`torch.UntypedStorage.resize_`, as FSDP does, so the views and
  what autograd saved stay valid).
- `master` (S elements): this rank's part, in the parameters' original dtype
  (fp32 master copies under bf16 mixed precision), on the host with
  optimizer offload. Without mixed precision or offload at stages 1 and 2 it
  is the view `flat[lo:hi]` itself (no copy).
- `grad` (S elements, master dtype, compute device): the reduced gradient
  shard of stages 2 and 3 (stage 1 reads its part of the full gradients);
  `zero_grad(set_to_none=True)` releases its storage until the next
  reduction writes it (`release_grad`, `ensure_grad`),
  followed in `grad_flat` by `used`, one flag per parameter of the unit:
  above 0 where some rank had a gradient for it (a parameter no rank used
  keeps no gradient, as in one process, so momentum and weight decay leave
  it alone).
- `pieces`: one 1-D `nn.Parameter` per parameter that meets this rank's
  range, a view into `master`; these are what the optimizer steps, so its
  state (exp_avg, ...) exists for this rank's part only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from hpdl.comm.base import Communicator
from hpdl.comm.work import Work
from hpdl.parallel.zero_redundancy.partition import Piece, Unit

__all__: list[str] = []


@dataclass
class UnitBuffers:
    """One unit's tensors on this rank (see the module docstring)."""

    unit: Unit
    params: list[nn.Parameter]
    flat: torch.Tensor
    master: torch.Tensor
    master_is_flat: bool
    """`master` is a view of `flat` (nothing to copy back after a step)."""
    pieces: list[Piece]
    piece_params: list[nn.Parameter]
    grad: Optional[torch.Tensor] = None
    grad_flat: Optional[torch.Tensor] = None
    used: Optional[torch.Tensor] = None
    grad_fresh: bool = True
    """`grad` holds nothing yet this step (the next reduction may write it instead of adding)."""
    gathered: bool = True
    pending: Optional[Work] = None
    keep: list[torch.Tensor] = field(default_factory=list)
    """Buffers an in-flight collective still reads."""

    rank: int = 0

    @property
    def bounds(self) -> tuple[int, int]:
        return self.unit.bounds(self.rank)

    def allocate_grad(self, dtype: torch.dtype) -> None:
        """The gradient shard and usage flags (stages 2 and 3), zeroed."""
        flat = torch.zeros(self.unit.shard + len(self.unit.slots), dtype=dtype, device=self.flat.device)
        self.grad_flat, self.grad, self.used = flat, flat[: self.unit.shard], flat[self.unit.shard :]

    @property
    def has_grad(self) -> bool:
        """The gradient shard holds memory (stages 2 and 3: False after `release_grad`, until a reduction)."""
        return self.grad_flat is not None and self.grad_flat.untyped_storage().nbytes() > 0

    def release_grad(self) -> None:
        """`zero_grad(set_to_none=True)`: give the gradient shard's memory back until the next reduction writes
        it (as torch frees `.grad`), so a forward holds no gradients: FSDP2's peak, not the shard's bytes above it."""
        if self.grad_flat is not None:
            self.grad_flat.untyped_storage().resize_(0)
            self.grad_fresh = True

    def ensure_grad(self) -> None:
        """Memory for the gradient shard again (its values are undefined: the reduction writes all of them)."""
        assert self.grad_flat is not None
        storage = self.grad_flat.untyped_storage()
        need = self.grad_flat.numel() * self.grad_flat.element_size()
        if storage.nbytes() != need:
            storage.resize_(need)
            self.grad_fresh = True

    # ------------------------------------------------------------------ stage 3: gather and free
    def start_gather(self, comm: Communicator) -> None:
        """Launch the allgather that fills `flat` (storage re-allocated first); `wait_gather` completes it."""
        if self.gathered or self.pending is not None:
            return
        storage = self.flat.untyped_storage()
        need = self.flat.numel() * self.flat.element_size()
        if storage.nbytes() != need:
            storage.resize_(need)
        src = self.master
        if src.dtype != self.flat.dtype or src.device != self.flat.device:
            src = src.to(device=self.flat.device, dtype=self.flat.dtype)
        self.keep = [src]
        self.pending = comm.allgather(src, out=self.flat, async_op=True)

    def wait_gather(self) -> None:
        if self.pending is not None:
            self.pending.wait()
            self.pending = None
            self.keep = []
            self.gathered = True

    def free(self) -> None:
        """Release the full parameters (stage 3); the views keep their shapes, their storage is 0 bytes."""
        self.wait_gather()
        self.flat.untyped_storage().resize_(0)
        self.gathered = False

    # ------------------------------------------------------------------ stages 1 and 2: publish after a step
    def publish(self, comm: Communicator) -> Work:
        """Launch the allgather of the updated master shards into every rank's `flat` (stages 1 and 2)."""
        lo, hi = self.bounds
        if self.master_is_flat:
            src = self.flat[lo:hi].clone()  # the engine's input may not overlap its output
        else:
            src = self.master.to(device=self.flat.device, dtype=self.flat.dtype)
        self.keep = [src]
        return comm.allgather(src, out=self.flat, async_op=True)


def build_unit(
    unit: Unit,
    params: list[nn.Parameter],
    rank: int,
    *,
    compute_dtype: Optional[torch.dtype],
    offload: bool,
    sharded_params: bool,
) -> UnitBuffers:
    """Move `params` into a new flat buffer, make their master shard and the optimizer's pieces.

    `params` already hold the same values on every rank (broadcast first).
    `sharded_params` (stage 3): the master shard is its own tensor and the
    flat buffer is released at once.
    """
    device = params[0].device
    dtype = compute_dtype or unit.dtype
    flat = torch.zeros(unit.padded, dtype=dtype, device=device)
    master_values = torch.zeros(unit.shard, dtype=unit.dtype, device=device)
    lo, hi = unit.bounds(rank)
    with torch.no_grad():
        for slot, p in zip(unit.slots, params):
            source = p.detach().reshape(-1)
            flat[slot.offset : slot.offset + slot.numel].copy_(source)
            a, b = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
            if a < b:  # from the original values (fp32 masters keep every bit under bf16 compute)
                master_values[a - lo : b - lo].copy_(source[a - slot.offset : b - slot.offset])
            p.data = flat[slot.offset : slot.offset + slot.numel].view(slot.shape)
    master_is_flat = not sharded_params and compute_dtype is None and not offload
    if master_is_flat:
        master = flat[lo:hi]
    elif offload:
        master = master_values.cpu().pin_memory()
    else:
        master = master_values
    pieces = unit.pieces(rank)
    piece_params = [nn.Parameter(master[pc.shard_offset : pc.shard_offset + pc.numel]) for pc in pieces]
    buffers = UnitBuffers(unit, params, flat, master, master_is_flat, pieces, piece_params, rank=rank)
    if sharded_params:
        buffers.free()
    return buffers

"""`BranchParallel`: run a block's independent branches on different ranks and merge them with one collective."""

from __future__ import annotations

import functools
from typing import Any, Optional, Sequence, Union

import torch
from torch import nn

from hpdl.comm.base import Communicator
from hpdl.parallel.branch import placement as placing
from hpdl.parallel.branch.merge import Layout, allreduce_sum, gather_concat, sum_input_grad

__all__ = ["BranchParallel", "MERGES", "branch_parameters"]

MERGES = ("concat", "sum", "mean")


class BranchParallel(nn.Module):
    """The branches of a block, each on one rank of `comm`, merged: `merge(branch_0(x), ..., branch_n-1(x))`.

    Arguments:
        branches: an `nn.ModuleList` (or list) of independent modules, each
            taking the block's input; they must share no module or parameter.
            Every rank builds all of them (the same initial weights); each
            keeps only its own (`self.branches`, indices in `self.owned`).
        merge: "concat" (along `dim`, in branch order), "sum" or "mean"
            (branch outputs of one shape).
        comm: the branch group; every rank of it calls the block with the
            same input, in the same order (what runs around it is replicated).
        dim: the concatenation dimension (1: channels of an NCHW tensor).
        placement: the rank of each branch; default: branch i on rank i when
            there are as many branches as ranks, else balanced (longest first
            onto the least loaded rank) by the forward + backward time measured
            on `sample` (averaged over the ranks), or by parameter counts
            without a sample.
        sample: an input of the block's shape, to measure the branches.
    """

    def __init__(
        self,
        branches: Union[nn.ModuleList, Sequence[nn.Module]],
        merge: str,
        comm: Communicator,
        *,
        dim: int = 1,
        placement: Optional[Sequence[int]] = None,
        sample: Optional[torch.Tensor] = None,
    ):
        super().__init__()
        branches = checked_branches(branches, merge, "BranchParallel")
        self.merge, self.dim, self.comm = merge, dim, comm
        self.count = len(branches)
        self.costs: list[float] = self._costs(branches, sample, placement)
        self.placement = self._place(placement)
        """The rank of each branch (the same list on every rank)."""
        self.owned = [i for i, rank in enumerate(self.placement) if rank == comm.rank]
        """The indices of the branches this rank runs."""
        self.branches = nn.ModuleList([branches[i] for i in self.owned])
        self._layouts: dict[Any, Layout] = {}

    def _costs(self, branches: list, sample: Optional[torch.Tensor], placement: Optional[Sequence[int]]) -> list[float]:
        if placement is not None or len(branches) == self.comm.size:
            return placing.parameter_costs(branches)
        if sample is None:
            return placing.parameter_costs(branches)
        table = torch.tensor([c.seconds for c in placing.measure(branches, sample)], dtype=torch.float64)
        if self.comm.size > 1:  # every rank measured; they must agree on one placement
            self.comm.allreduce(table, "avg")
        return table.tolist()

    def _place(self, placement: Optional[Sequence[int]]) -> list[int]:
        size = self.comm.size
        if placement is None:
            return placing.place(self.costs, size)
        owner = list(placement)
        if len(owner) != self.count or any(not isinstance(r, int) or not 0 <= r < size for r in owner):
            raise ValueError(f"placement={owner} must give a rank in [0, {size}) for each of the {self.count} branches")
        if set(owner) != set(range(size)):
            raise ValueError(
                f"placement={owner} leaves ranks {sorted(set(range(size)) - set(owner))} without a branch; every rank "
                "of the group must own one (or use a smaller group)"
            )
        return owner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"BranchParallel takes one tensor, got {type(x).__name__}")
        arg = sum_input_grad(x, self.comm) if x.requires_grad and torch.is_grad_enabled() else x
        outs = [branch(arg) for branch in self.branches]
        if self.merge == "concat":
            layout = self._layout(x, outs)
            return gather_concat(outs, self.comm, layout)
        shape = outs[0].shape
        for i, o in zip(self.owned, outs):
            if o.shape != shape:
                raise ValueError(
                    f"merge={self.merge!r} needs branch outputs of one shape: branch {self.owned[0]} gives "
                    f"{list(shape)}, branch {i} gives {list(o.shape)}"
                )
        local = outs[0] if len(outs) == 1 else torch.stack(outs).sum(0)
        return allreduce_sum(local, self.comm, 1.0 / self.count if self.merge == "mean" else 1.0)

    def _layout(self, x: torch.Tensor, outs: list[torch.Tensor]) -> Layout:
        """The shapes of every branch's output for inputs of this shape (exchanged once per input shape)."""
        # (the same on every rank: the outputs' dtypes may differ from rank to rank, autocast's state may not)
        key = (tuple(x.shape), x.dtype, *_autocast_state(x.device.type))
        layout = self._layouts.get(key)
        if layout is None:
            mine = [(tuple(o.shape), str(o.dtype).removeprefix("torch.")) for o in outs]
            everyone = self.comm.allgather_object(mine) if self.comm.size > 1 else [mine]
            shapes: list = [None] * self.count
            dtypes: list = [None] * self.count
            for rank, theirs in enumerate(everyone):
                for i, (shape, dtype) in zip([j for j, r in enumerate(self.placement) if r == rank], theirs):
                    shapes[i], dtypes[i] = shape, getattr(torch, dtype)
            dim = self.dim % len(shapes[0])
            for i, shape in enumerate(shapes):
                if len(shape) != len(shapes[0]) or any(
                    a != b for d, (a, b) in enumerate(zip(shape, shapes[0])) if d != dim
                ):
                    raise ValueError(
                        f"merge='concat' along dim {self.dim}: branch {i} gives {list(shape)}, branch 0 gives "
                        f"{list(shapes[0])}; every other dimension must agree"
                    )
            # torch.cat's promotion over every branch, as the block on one process gives
            merged = functools.reduce(torch.promote_types, dtypes)
            layout = self._layouts[key] = Layout(shapes, self.placement, self.comm.size, dim, merged)
        return layout

    def extra_repr(self) -> str:
        return f"merge={self.merge!r}, branches={self.count}, placement={self.placement}, owned={self.owned}"


def _autocast_state(device_type: str) -> tuple:
    """Whether autocast is on for this device type, and its dtype: what decides the branch outputs' dtypes."""
    try:
        return torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)
    except (TypeError, AttributeError):  # torch < 2.4: the CPU's own functions, and the default (CUDA) ones
        if device_type == "cpu":
            return torch.is_autocast_cpu_enabled(), torch.get_autocast_cpu_dtype()
        return torch.is_autocast_enabled(), torch.get_autocast_gpu_dtype()


def branch_parameters(model: nn.Module) -> list[str]:
    """Names of the parameters of `model` that live in a `BranchParallel`'s branches: each rank holds its own
    branches' (and nobody else's), so a global norm or a checkpoint must take them from every rank."""
    return [
        f"{name}.{pname}" if name else pname
        for name, module in model.named_modules()
        if isinstance(module, BranchParallel)
        for pname, _ in module.branches.named_parameters(prefix="branches")
    ]


def checked_branches(branches: Union[nn.ModuleList, Sequence[nn.Module]], merge: str, what: str) -> list[nn.Module]:
    """The branches as a list, once `merge` is known and they are a non-empty list of independent modules."""
    if merge not in MERGES:
        raise ValueError(f"merge={merge!r}; choose one of {', '.join(map(repr, MERGES))}")
    branches = list(branches)
    if not branches or not all(isinstance(b, nn.Module) for b in branches):
        raise TypeError(f"{what} needs a non-empty nn.ModuleList (or list) of branch modules")
    check_independent(branches)
    return branches


def check_independent(branches: Sequence[nn.Module]) -> None:
    """Branches that share a module or a parameter are not independent: a clear error, not a silent wrong gradient."""
    seen: dict[int, int] = {}
    for i, branch in enumerate(branches):
        mine = {id(m) for m in branch.modules()} | {id(p) for p in branch.parameters()}
        for key in mine:
            j = seen.get(key)
            if j is not None and j != i:
                raise ValueError(
                    f"branches {j} and {i} share a module or parameter: branch parallelism runs every branch on its "
                    "own rank, so shared weights would be updated apart. Give each branch its own modules, or keep "
                    "the shared part outside the BranchParallel block (before it, replicated)"
                )
            seen[key] = i

"""ZeRO stage 3: parameters live sharded; a unit is gathered just before its forward and its backward.

Units are submodules chosen by a wrap policy (`units_by_policy`). Each unit
module gets hooks:

- before its forward: gather the unit (or wait for its prefetch);
- after its forward: free the unit (the root unit stays until backward
  ends), start the gather of the next unit in forward order, and hook the
  outputs, so that
- before its backward (the first gradient reaching an output): gather it
  again and prefetch the unit whose backward comes next;
- after its backward (every parameter's gradient staged, `ShardReducer`):
  free it; its gradient goes out in a reduce-scatter.

The root unit (parameters outside every unit) is gathered by the wrapper
before the forward and again by a hook on the wrapper's outputs before
the backward: a pipeline stage runs several micro-batches' forwards and
backwards in any order, and a backward may follow another backward's end.
With `reshard=False` (FSDP2's `reshard_after_forward=False`) a unit stays
gathered from its first forward until the end of the next backward that
reduces gradients: a pipeline step's micro-batches then gather every unit
once per step instead of twice per micro-batch, for the memory of a whole
stage's parameters during the step.

The forward order is recorded in the first forward pass; it must be the
same on every rank (the same model code on every rank), since the gathers
are collectives.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Union

import torch
from torch import nn

from hpdl.comm.base import Communicator
from hpdl.parallel.zero_redundancy.units import UnitBuffers

__all__: list[str] = []

WrapPolicy = Union[None, int, Sequence[type], Callable[[nn.Module], bool]]


def units_by_policy(
    root: nn.Module, policy: WrapPolicy, default_numel: int
) -> list[tuple[Optional[nn.Module], list[tuple[str, nn.Parameter]]]]:
    """(module, its parameters) per unit, in registration order; the root's leftover parameters come last
    (module None stands for the root, gathered by the wrapper itself).

    policy: None -> size-based with `default_numel`; an int -> size-based
    with that many parameters; a tuple/list/set of module classes -> every
    instance is a unit; a callable(module) -> bool.
    """
    if policy is None or isinstance(policy, int):
        threshold = default_numel if policy is None else int(policy)
        if threshold < 1:
            raise ValueError(f"wrap_policy={policy!r}: a size-based policy needs a positive parameter count")
        chosen = _size_based(root, threshold)
    elif isinstance(policy, (tuple, list, set, frozenset)):
        classes = tuple(policy)
        if not all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
            raise TypeError(f"wrap_policy={policy!r}: a collection must hold nn.Module classes")
        chosen = {id(m) for m in root.modules() if m is not root and isinstance(m, classes)}
    elif callable(policy):
        chosen = {id(m) for m in root.modules() if m is not root and bool(policy(m))}
    else:
        raise TypeError(f"wrap_policy={policy!r}: use None, an int, a tuple of module classes or a callable")
    owner: dict[str, Optional[nn.Module]] = {}

    def visit(module: nn.Module, prefix: str, current: Optional[nn.Module]) -> None:
        unit = module if id(module) in chosen else current
        for name, p in module.named_parameters(recurse=False):
            if p.requires_grad:
                owner[prefix + name] = unit
        for name, child in module.named_children():
            visit(child, f"{prefix}{name}.", unit)

    visit(root, "", None)
    named = dict(root.named_parameters())
    groups: dict[int, tuple[Optional[nn.Module], list[tuple[str, nn.Parameter]]]] = {}
    for name, module in owner.items():
        groups.setdefault(id(module), (module, []))[1].append((name, named[name]))
    ordered = [g for g in groups.values() if g[0] is not None]
    leftovers = groups.get(id(None))
    return ordered + ([leftovers] if leftovers is not None else [])


def _size_based(root: nn.Module, threshold: int) -> set[int]:
    """Post-order: a module becomes a unit when its not yet wrapped parameters reach `threshold` (FSDP's rule)."""
    chosen: set[int] = set()

    def unwrapped(module: nn.Module) -> int:
        total = sum(p.numel() for p in module.parameters(recurse=False) if p.requires_grad)
        total += sum(unwrapped(child) for child in module.children())
        if module is not root and total >= threshold:
            chosen.add(id(module))
            return 0
        return total

    unwrapped(root)
    return chosen


class ParamScheduler:
    """Gathers, frees and prefetches the units of stage 3 from module hooks (see the module docstring)."""

    def __init__(
        self,
        units: Sequence[UnitBuffers],
        modules: Sequence[Optional[nn.Module]],
        comm: Communicator,
        *,
        prefetch: bool,
        begin_backward: Callable[[], None],
        reshard: bool = True,
        poll: Optional[Callable[[], None]] = None,
    ):
        self.units = list(units)
        self.poll = poll
        """Retires the reduce-scatters that finished (their staging is freed) before a prefetch allocates more."""
        self.comm = comm
        self.prefetch = prefetch
        self.reshard = reshard
        self.begin_backward = begin_backward
        self.root = next((i for i, m in enumerate(modules) if m is None), None)
        self.forward_order: list[int] = []
        self.recorded = False
        self.peak_gathered = 0
        self._handles = []
        for u, module in enumerate(modules):
            if module is None:
                continue
            self._handles.append(module.register_forward_pre_hook(self._make_pre_forward(u)))
            self._handles.append(module.register_forward_hook(self._make_post_forward(u)))

    # ------------------------------------------------------------------ gather / free
    def gather(self, u: int) -> None:
        buffers = self.units[u]
        buffers.start_gather(self.comm)
        self._track()
        buffers.wait_gather()

    def start(self, u: Optional[int]) -> None:
        if u is not None and self.prefetch:
            self.units[u].start_gather(self.comm)
            self._track()

    def _track(self) -> None:
        gathered = sum(b.flat.untyped_storage().nbytes() for b in self.units)
        self.peak_gathered = max(self.peak_gathered, gathered)

    def free(self, u: int) -> None:
        if self.units[u].gathered or self.units[u].pending is not None:
            self.units[u].free()

    def free_all(self) -> None:
        for u in range(len(self.units)):
            self.free(u)

    def gather_root(self) -> None:
        """Before the forward: the root unit, and the prefetch of the first unit in forward order."""
        if self.root is not None:
            self.gather(self.root)
        if self.recorded and self.forward_order:
            self.start(self.forward_order[0])

    def prefetch_for(self, kind: str) -> None:
        """Start the gathers the next pass needs first: the root and the first unit before a forward, the root
        and the last unit before a backward (a pipeline stage knows which comes next: `Pipeline` tells it)."""
        if not self.prefetch or not self.recorded or not self.forward_order:
            return
        if self.root is not None:
            self.start(self.root)
        self.start(self.forward_order[0] if kind == "forward" else self.forward_order[-1])

    def unit_done(self, u: int, syncing: bool) -> None:
        """Unit `u`'s backward is over on this pass: free it, unless it is kept until the reducing backward."""
        if self.reshard or syncing:
            self.free(u)

    def backward_done(self, syncing: bool) -> None:
        """A backward pass ended: free every unit, unless they are kept until the reducing backward."""
        if self.reshard or syncing:
            self.free_all()

    def root_pre_backward(self, grad: torch.Tensor) -> None:
        """A hook on the wrapper's outputs: the root's parameters are back before the backward needs them."""
        self.begin_backward()
        if self.root is not None:
            self.gather(self.root)

    def end_of_forward(self) -> None:
        """Called by the wrapper after the whole forward: the order is known from now on."""
        self.recorded = True

    def _neighbour(self, u: int, step: int) -> Optional[int]:
        if not self.recorded or u not in self.forward_order:
            return None
        i = self.forward_order.index(u) + step
        return self.forward_order[i] if 0 <= i < len(self.forward_order) else None

    # ------------------------------------------------------------------ hooks
    def _make_pre_forward(self, u: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            if not self.recorded and u not in self.forward_order:
                self.forward_order.append(u)
            self.gather(u)

        return hook

    def _make_post_forward(self, u: int) -> Callable[..., Any]:
        def hook(module: nn.Module, args: Any, output: Any) -> Any:
            if torch.is_grad_enabled():
                for t in tensors_of(output):
                    if t.requires_grad:
                        t.register_hook(self._make_pre_backward(u))
            if self.reshard:
                self.free(u)
            # Prefetch after freeing: at most one unit's parameters are gathered at a time in forward (FSDP2's
            # default); the gather overlaps whatever runs between this unit and the next (a no-op when kept).
            self.start(self._neighbour(u, +1))
            return None

        return hook

    def _make_pre_backward(self, u: int) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            self.begin_backward()
            self.gather(u)
            if self.poll is not None:
                self.poll()
            self.start(self._neighbour(u, -1))

        return hook

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def tensors_of(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in tensors_of(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in tensors_of(v)]
    return []

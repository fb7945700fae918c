"""What the `Trainer` needs to know about a model that `hpdl.parallel.build(model, mesh, plan)` returned.

`build` gives a module (plain, DataParallel, ZeRO, tensor-parallel,
SpatialParallel) or a `Pipeline`. They differ in four places only, and
this module holds all four, so that one loop serves every plan:

- the input: a spatial model (or a pipeline whose first stages are spatial)
  takes this rank's slab of the batch, not the whole batch;
- the step: a pipeline runs forward and backward of every micro-batch in
  `pipe.step(x, y, loss_fn)`; a module runs forward, then the loop's backward;
- the counting: every rank of one data-parallel replica (its tp, pp and sp
  ranks) sees the same batch, so the world's sample counts are divided by
  the ranks per replica;
- the checkpoint: a sharded folder (`hpdl.parallel.mesh.state`) that loads
  on any mesh, with the loop's own state beside the tensors.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Optional

import torch
from torch import nn

from hpdl.parallel import Mesh
from hpdl.parallel.pipe import Pipeline
from hpdl.parallel.spatial import SpatialParallel
from hpdl.parallel.tensor import vocab_parallel_cross_entropy
from hpdl.parallel.tensor.layers import ColumnParallelLinear

__all__ = ["MeshLayout"]


class MeshLayout:
    """How the loop feeds, steps, counts and checkpoints `model`, built on `mesh`."""

    def __init__(self, model: Any, mesh: Mesh) -> None:
        if not isinstance(mesh, Mesh):
            raise TypeError(f"Trainer: mesh must be the hpdl.parallel.Mesh the model was built on, got {mesh!r}")
        self.model = model
        self.mesh = mesh
        self.pipeline = isinstance(model, Pipeline)
        self.ranks_per_replica = mesh.world.size // mesh.dp.size
        stage = model.module if self.pipeline else model
        self._spatial = stage if isinstance(stage, SpatialParallel) and (not self.pipeline or model.is_first) else None
        self.last_stage = not self.pipeline or model.is_last
        self.output_split = mesh.tp.size > 1 and _splits_output(stage)
        """True when this rank's output is its tp slice of the classes (a vocabulary-parallel head)."""

    def default_loss(self) -> Callable[[Any, Any], torch.Tensor]:
        """Cross entropy, over the tp ranks' slices of the classes when the head splits them (GPT's tp_plan)."""
        if self.output_split:
            tp = self.mesh.tp

            def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
                return vocab_parallel_cross_entropy(output, target, tp)

            return loss
        return _cross_entropy

    def local_inputs(self, inputs: Any) -> Any:
        """This rank's part of the replica's batch: its slab where the model (or the first stage) is spatial."""
        if self._spatial is not None and isinstance(inputs, torch.Tensor):
            return self._spatial.shard(inputs)
        return inputs

    def reports(self) -> bool:
        """Whether this rank's outputs count in an evaluation: one rank per replica, on the last stage."""
        return self.last_stage and self.mesh.tp.rank == 0 and self.mesh.sp.rank == 0

    def predict(self, inputs: Any) -> Any:
        """The model's output for `inputs` (no gradients); None on a pipeline's other stages."""
        if self.pipeline:
            return self.model.predict(inputs)
        return self.model(inputs)

    # ------------------------------------------------------------------ checkpoints
    def exists(self, path: str) -> bool:
        from hpdl.checkpoint.format import METADATA

        return os.path.exists(os.path.join(path, METADATA))  # written last: a folder without it is unfinished

    def save(self, path: str, optimizer: Any, state: dict[str, Any]) -> None:
        """The sharded folder `path` (collective): tensors by logical name, the loop's `state` beside them."""
        from hpdl.parallel.mesh.state import save

        save(path, self.model, optimizer, self.mesh, trainer=state)

    def load(self, path: str, optimizer: Any) -> dict[str, Any]:
        """Load `path` (written on any mesh) into the model and optimizer; return the loop's saved state."""
        from hpdl.checkpoint.errors import CheckpointError
        from hpdl.parallel.mesh.state import load

        extra = load(path, self.model, optimizer)
        if "trainer" not in extra:
            raise CheckpointError(f"checkpoint {path} was not written by hpdl.train.Trainer: it holds no loop state")
        return dict(extra["trainer"])


def _cross_entropy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(output, target)


def _splits_output(module: Optional[nn.Module]) -> bool:
    """True when the last layer with parameters is a column-parallel linear that keeps its slice."""
    if module is None:
        return False
    last = None
    for m in module.modules():
        if any(True for _ in m.parameters(recurse=False)):
            last = m
    return isinstance(last, ColumnParallelLinear) and not last.gather_output

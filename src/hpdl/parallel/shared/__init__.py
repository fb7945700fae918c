"""What every parallel strategy shares, below all of them: global-norm clipping, the wrapping optimizer's state,
`no_sync` gradient accumulation, and the view of a mesh a strategy may take. It imports nothing of
`hpdl.parallel` but itself."""

from hpdl.parallel.shared.clipping import clip_by_global_norm_
from hpdl.parallel.shared.gradient_sync import LocalAccumulation
from hpdl.parallel.shared.mesh_groups import MeshGroups
from hpdl.parallel.shared.optimizer_proxy import InnerOptimizerState

__all__ = ["clip_by_global_norm_", "InnerOptimizerState", "LocalAccumulation", "MeshGroups"]

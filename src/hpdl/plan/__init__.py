"""The planner: predict step time and memory of every parallel plan, pick the best, simulate other clusters.

    profile = hpdl.plan.reference_profile("gpt2-xl")
    cluster = hpdl.plan.parse_cluster("nodes=128,gpus_per_node=8,gpu=h100,intra=nvlink,inter=ib-200")
    result = hpdl.plan.search(profile, cluster, hpdl.plan.Workload(batch=1024))
    result.best.to_dict(), result.best_plan()    # the estimate, and an hpdl.parallel.Plan

docs/plan.md explains the model, its formulas and its limits.
"""

from hpdl.plan.cluster import Cluster, ClusterError, Link, load_cluster_file
from hpdl.plan.cost import Candidate, CostModel, Estimate, Workload
from hpdl.plan.memory import bubble_fraction, model_states, state_bytes
from hpdl.plan.models import NAMES, reference_profile, transformer_profile
from hpdl.plan.presets import parse_cluster, preset_cluster
from hpdl.plan.profile import Layer, ModelProfile, ProfileError, measure, measure_factory
from hpdl.plan.ranking import SearchResult, search

__all__ = [
    "Cluster",
    "ClusterError",
    "Link",
    "load_cluster_file",
    "parse_cluster",
    "preset_cluster",
    "Candidate",
    "CostModel",
    "Estimate",
    "Workload",
    "bubble_fraction",
    "model_states",
    "state_bytes",
    "NAMES",
    "reference_profile",
    "transformer_profile",
    "Layer",
    "ModelProfile",
    "ProfileError",
    "measure",
    "measure_factory",
    "SearchResult",
    "search",
]

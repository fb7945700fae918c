"""A cluster description: devices, memory, compute rate and the links between devices, per level.

The planner never talks to a cluster; it reads one of these. A cluster has
`nodes` nodes of `devices_per_node` devices each; a device has memory and a
compute rate per dtype; devices talk over two link levels, `intra` (inside a
node: NVLink, PCIe, shared memory) and `inter` (between nodes: InfiniBand,
Ethernet), each described by the alpha-beta model: a message of S bytes
takes `latency + S / bandwidth` seconds.

A TOML file maps onto `Cluster` one to one (see `Cluster.from_toml` and
docs/plan.md); unknown keys are rejected.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Optional

__all__ = ["Link", "Cluster", "ClusterError", "load_cluster_file", "dumps_toml", "GB", "DTYPES"]

GB = 1e9
"""Decimal gigabyte: datasheets and the ZeRO paper count memory and bandwidth in 10^9 bytes."""


class ClusterError(ValueError):
    """A cluster description is incomplete or inconsistent; the message names the field and the fix."""


@dataclass(frozen=True)
class Link:
    """One link level in the alpha-beta model: `time(S) = latency_s + S / bandwidth_Bps`."""

    name: str
    """What it is ("nvlink4", "ib-200", "shm"), for the report."""
    latency_s: float
    """alpha: seconds per message (start-up, software and wire)."""
    bandwidth_Bps: float
    """1/beta: bytes per second per device and direction."""

    def __post_init__(self) -> None:
        if not (self.latency_s >= 0 and math.isfinite(self.latency_s)):
            raise ClusterError(f"link {self.name!r}: latency {self.latency_s!r} s must be a finite number >= 0")
        if not (self.bandwidth_Bps > 0 and math.isfinite(self.bandwidth_Bps)):
            raise ClusterError(f"link {self.name!r}: bandwidth {self.bandwidth_Bps!r} B/s must be finite and > 0")

    def time(self, nbytes: float) -> float:
        """Seconds to send one message of `nbytes` over this link."""
        return self.latency_s + nbytes / self.bandwidth_Bps

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "latency_us": self.latency_s * 1e6, "bandwidth_GBps": self.bandwidth_Bps / GB}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str) -> Link:
        known = {"name", "latency_us", "bandwidth_GBps"}
        unknown = set(data) - known
        if unknown:
            raise ClusterError(f"[{where}]: unknown keys {sorted(unknown)}; a link has {sorted(known)}")
        missing = {"latency_us", "bandwidth_GBps"} - set(data)
        if missing:
            raise ClusterError(f"[{where}]: missing {sorted(missing)} (e.g. latency_us = 5.0, bandwidth_GBps = 25.0)")
        return cls(
            name=str(data.get("name", where)),
            latency_s=float(data["latency_us"]) * 1e-6,
            bandwidth_Bps=float(data["bandwidth_GBps"]) * GB,
        )


DTYPES = ("fp64", "fp32", "tf32", "bf16", "fp16")


@dataclass(frozen=True)
class Cluster:
    """Devices and links; every number the cost model uses about hardware comes from here."""

    name: str
    nodes: int
    devices_per_node: int
    memory_bytes: float
    """Memory per device (bytes)."""
    flops: Mapping[str, float]
    """Peak compute rate per dtype (FLOP/s per device): keys among fp64, fp32, tf32, bf16, fp16."""
    intra: Link
    inter: Link
    efficiency: float = 1.0
    """Share of the peak rate that model layers reach (model FLOPs utilisation); 1.0 for measured rates."""
    memory_bandwidth_Bps: float = 1e12
    """Device memory bandwidth; the optimizer step is memory-bound and costs bytes / this."""
    node_flops: Optional[Mapping[str, float]] = None
    """All devices of a node together (when they share cores, as CPU ranks do); None: no sharing."""
    cores_per_device: Optional[float] = None
    """CPU cores per device of a node (`hpdl plan calibrate`: cores / ranks; 0.5 for 4 ranks on 2 cores); None:
    a device's fixed costs (framework dispatch, optimizer step, copies) do not slow down with more devices busy."""
    layer_overhead_s: float = 0.0
    """Fixed seconds per layer and forward pass (module call, kernel launches); backward costs twice."""
    op_overhead_s: float = 0.0
    """Fixed seconds per dispatched operator in forward (measured profiles count them); backward costs twice."""
    tensor_overhead_s: float = 0.0
    """Fixed seconds per parameter tensor in the optimizer step."""
    pass_overhead_s: float = 0.0
    """Fixed seconds per forward-backward pass (loss, autograd engine start, hooks): once per micro-batch."""
    optimizer_ns: Optional[Mapping[str, float]] = None
    """Measured optimizer step, nanoseconds per parameter, by optimizer ("adam", "sgd-momentum"); where
    given it replaces the memory-traffic estimate (unfused CPU optimizers pass over memory many times)."""
    overlap: float = 1.0
    """Share of backward time that can hide gradient communication (0: none, 1: all of it)."""
    reserved_bytes: float = 0.0
    """Memory per device the runtime keeps for itself (CUDA context, allocator slack)."""
    source: str = ""
    """Where the numbers come from ("datasheet: ...", "measured on HOST at DATE")."""
    extra: Mapping[str, Any] = field(default_factory=dict)
    """Free-form notes kept with the file (calibration details)."""

    def __post_init__(self) -> None:
        for name in ("nodes", "devices_per_node"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ClusterError(f"cluster {self.name!r}: {name} = {value!r} must be an integer >= 1")
        if not self.memory_bytes > 0:
            raise ClusterError(f"cluster {self.name!r}: memory per device {self.memory_bytes!r} must be > 0")
        if not self.flops:
            raise ClusterError(f"cluster {self.name!r}: no compute rate; give [flops] with e.g. fp32 = 19.5e12")
        for dtype, rate in self.flops.items():
            if dtype not in DTYPES:
                raise ClusterError(f"cluster {self.name!r}: unknown dtype {dtype!r} in flops; use one of {DTYPES}")
            if not rate > 0:
                raise ClusterError(f"cluster {self.name!r}: flops[{dtype}] = {rate!r} must be > 0")
        if not 0 < self.efficiency <= 1:
            raise ClusterError(f"cluster {self.name!r}: efficiency {self.efficiency!r} must be in (0, 1]")
        if not 0 <= self.overlap <= 1:
            raise ClusterError(f"cluster {self.name!r}: overlap {self.overlap!r} must be in [0, 1]")
        overheads = (self.layer_overhead_s, self.op_overhead_s, self.tensor_overhead_s, self.pass_overhead_s)
        if self.cores_per_device is not None and not self.cores_per_device > 0:
            raise ClusterError(f"cluster {self.name!r}: cores_per_device {self.cores_per_device!r} must be > 0")
        if min(*overheads, self.reserved_bytes) < 0 or not (self.memory_bandwidth_Bps > 0):
            raise ClusterError(
                f"cluster {self.name!r}: layer overhead and reserved memory must be >= 0, memory bandwidth > 0"
            )

    @property
    def devices(self) -> int:
        return self.nodes * self.devices_per_node

    def rate(self, dtype: str, active_per_node: Optional[float] = None) -> float:
        """Achievable FLOP/s of one device for `dtype` when `active_per_node` devices of a node compute at once.

        Falls back from a missing 16-bit rate to fp32 (a CPU without bf16
        units runs bf16 no faster than fp32).
        """
        rate = self.flops.get(dtype)
        if rate is None:
            fallback = "fp32" if dtype in ("bf16", "fp16", "tf32") else dtype
            rate = self.flops.get(fallback)
        if rate is None:
            raise ClusterError(f"cluster {self.name!r} has no compute rate for {dtype!r} (it has {sorted(self.flops)})")
        rate *= self.efficiency
        alone = rate
        cores = (self.cores_per_device or 0.0) * self.devices_per_node
        if active_per_node and active_per_node <= cores:
            return rate  # a core for every busy device: its own rate (node_flops is the oversubscribed total)
        if self.node_flops and active_per_node:
            shared = self.node_flops.get(dtype, self.node_flops.get("fp32"))
            if shared:
                rate = min(rate, shared * self.efficiency / active_per_node)
        if cores and active_per_node and active_per_node > cores:
            # no more than a fair share of the cores: the busy probe's matmuls, which keep within a core's caches,
            # got 0.55 of a core each with 4 ranks on 2 cores here; a small CNN's and an MLP's steps 0.29-0.48
            rate = min(rate, alone * cores / active_per_node)
        return rate

    def sharing(self, active_per_node: float) -> float:
        """How much slower a device's CPU work runs when `active_per_node` devices of a node work at once: the
        devices per core (1 while every device has a core of its own, or the cores are not known)."""
        if not self.cores_per_device:
            return 1.0
        return max(1.0, active_per_node / (self.cores_per_device * self.devices_per_node))

    def with_devices(self, nodes: int, devices_per_node: Optional[int] = None) -> Cluster:
        """The same hardware with another node count (and devices per node: a node's cores stay its own)."""
        per_node = devices_per_node or self.devices_per_node
        cores = None if self.cores_per_device is None else self.cores_per_device * self.devices_per_node / per_node
        return replace(self, nodes=nodes, devices_per_node=per_node, cores_per_device=cores)

    # ------------------------------------------------------------------ files
    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "name": self.name,
            "source": self.source,
            "nodes": self.nodes,
            "devices_per_node": self.devices_per_node,
            "memory_GB": self.memory_bytes / GB,
            "efficiency": self.efficiency,
            "memory_bandwidth_GBps": self.memory_bandwidth_Bps / GB,
            "layer_overhead_us": self.layer_overhead_s * 1e6,
            "op_overhead_us": self.op_overhead_s * 1e6,
            "tensor_overhead_us": self.tensor_overhead_s * 1e6,
            "pass_overhead_us": self.pass_overhead_s * 1e6,
            "overlap": self.overlap,
            "reserved_GB": self.reserved_bytes / GB,
            "flops": dict(self.flops),
            "intra": self.intra.to_dict(),
            "inter": self.inter.to_dict(),
        }
        if self.cores_per_device is not None:
            data["cores_per_device"] = self.cores_per_device
        if self.node_flops:
            data["node_flops"] = dict(self.node_flops)
        if self.optimizer_ns:
            data["optimizer_ns"] = dict(self.optimizer_ns)
        if self.extra:
            data["extra"] = dict(self.extra)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "cluster") -> Cluster:
        scalar = {
            "name",
            "source",
            "nodes",
            "devices_per_node",
            "memory_GB",
            "efficiency",
            "memory_bandwidth_GBps",
            "layer_overhead_us",
            "op_overhead_us",
            "tensor_overhead_us",
            "pass_overhead_us",
            "overlap",
            "reserved_GB",
            "cores_per_device",
        }
        tables = {"flops", "node_flops", "optimizer_ns", "intra", "inter", "extra"}
        unknown = set(data) - scalar - tables
        if unknown:
            raise ClusterError(f"{where}: unknown keys {sorted(unknown)}; a cluster has {sorted(scalar | tables)}")
        missing = {"nodes", "devices_per_node", "memory_GB", "flops", "intra", "inter"} - set(data)
        if missing:
            raise ClusterError(f"{where}: missing {sorted(missing)}; see docs/plan.md for a complete cluster file")
        kwargs: dict[str, Any] = {
            "name": str(data.get("name", os.path.basename(where))),
            "source": str(data.get("source", "")),
            "nodes": int(data["nodes"]),
            "devices_per_node": int(data["devices_per_node"]),
            "memory_bytes": float(data["memory_GB"]) * GB,
            "flops": {str(k): float(v) for k, v in dict(data["flops"]).items()},
            "intra": Link.from_dict(data["intra"], "intra"),
            "inter": Link.from_dict(data["inter"], "inter"),
        }
        if "efficiency" in data:
            kwargs["efficiency"] = float(data["efficiency"])
        if "memory_bandwidth_GBps" in data:
            kwargs["memory_bandwidth_Bps"] = float(data["memory_bandwidth_GBps"]) * GB
        if "layer_overhead_us" in data:
            kwargs["layer_overhead_s"] = float(data["layer_overhead_us"]) * 1e-6
        if "op_overhead_us" in data:
            kwargs["op_overhead_s"] = float(data["op_overhead_us"]) * 1e-6
        if "tensor_overhead_us" in data:
            kwargs["tensor_overhead_s"] = float(data["tensor_overhead_us"]) * 1e-6
        if "pass_overhead_us" in data:
            kwargs["pass_overhead_s"] = float(data["pass_overhead_us"]) * 1e-6
        if "overlap" in data:
            kwargs["overlap"] = float(data["overlap"])
        if "reserved_GB" in data:
            kwargs["reserved_bytes"] = float(data["reserved_GB"]) * GB
        if "cores_per_device" in data:
            kwargs["cores_per_device"] = float(data["cores_per_device"])
        if "node_flops" in data:
            kwargs["node_flops"] = {str(k): float(v) for k, v in dict(data["node_flops"]).items()}
        if "optimizer_ns" in data:
            kwargs["optimizer_ns"] = {str(k): float(v) for k, v in dict(data["optimizer_ns"]).items()}
        if "extra" in data:
            kwargs["extra"] = dict(data["extra"])
        return cls(**kwargs)

    def to_toml(self) -> str:
        return dumps_toml(self.to_dict())

    def write(self, path: str) -> None:
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        tmp = f"{path}.tmp"
        with open(tmp, "w") as fh:
            fh.write(self.to_toml())
        os.replace(tmp, path)


def load_cluster_file(path: str) -> Cluster:
    """Read a cluster TOML file (see docs/plan.md for the keys)."""
    try:
        import tomllib
    except ImportError:  # Python < 3.11
        import tomli as tomllib  # type: ignore[no-redef]
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError:
        raise ClusterError(f"cluster file {path!r} does not exist (write one with `hpdl plan calibrate`)") from None
    except tomllib.TOMLDecodeError as exc:
        raise ClusterError(f"cluster file {path!r} is not valid TOML: {exc}") from None
    return Cluster.from_dict(data, where=path)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value) if isinstance(value, int) or math.isfinite(value) else '"nan"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    text = str(value).replace("\\", "\\\\").replace('"', '\\"')
    return f'"{text}"'


def dumps_toml(data: Mapping[str, Any], prefix: str = "") -> str:
    """A small TOML writer for flat tables and nested tables of scalars (what cluster and plan files hold)."""
    lines = [f"{key} = {_toml_value(v)}" for key, v in data.items() if not isinstance(v, Mapping)]
    for key, value in data.items():
        if isinstance(value, Mapping):
            name = f"{prefix}{key}"
            lines += ["", f"[{name}]", dumps_toml(value, prefix=f"{name}.").rstrip("\n")]
    return "\n".join(line for line in lines) + "\n"

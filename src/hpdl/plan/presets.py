"""Preset devices and links (datasheet figures) and the inline cluster form.

Every number here is a vendor datasheet peak (dense, no sparsity), not a
measurement: real layers reach a share of it, which the cluster's
`efficiency` (default 0.5, a typical model FLOPs utilisation of large
transformer training) accounts for. Latencies are typical NCCL-level
start-up costs, not wire latencies. Bandwidths are per device and
direction; the inter-node figure assumes one NIC per GPU (DGX/HGX layout).

    parse_cluster("nodes=128,gpus_per_node=8,gpu=h100,intra=nvlink,inter=ib-200")
    parse_cluster("cluster.toml")
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Optional

from hpdl.plan.cluster import GB, Cluster, ClusterError, Link, load_cluster_file

__all__ = ["DEVICES", "LINKS", "DevicePreset", "parse_cluster", "preset_cluster", "describe_presets"]

T = 1e12


@dataclass(frozen=True)
class DevicePreset:
    """One accelerator as its datasheet gives it."""

    memory_GB: float
    flops: Mapping[str, float]
    memory_bandwidth_GBps: float
    nvlink: str
    """The link that `intra=nvlink` means for this device."""
    datasheet: str


DEVICES: dict[str, DevicePreset] = {
    "v100": DevicePreset(
        32, {"fp64": 7.8 * T, "fp32": 15.7 * T, "fp16": 125 * T}, 900, "nvlink2", "NVIDIA V100 SXM2 32GB"
    ),
    "a100-40": DevicePreset(
        40,
        {"fp64": 19.5 * T, "fp32": 19.5 * T, "tf32": 156 * T, "bf16": 312 * T, "fp16": 312 * T},
        1555,
        "nvlink3",
        "NVIDIA A100 SXM4 40GB",
    ),
    "a100-80": DevicePreset(
        80,
        {"fp64": 19.5 * T, "fp32": 19.5 * T, "tf32": 156 * T, "bf16": 312 * T, "fp16": 312 * T},
        2039,
        "nvlink3",
        "NVIDIA A100 SXM4 80GB",
    ),
    "h100": DevicePreset(
        80,
        {"fp64": 67 * T, "fp32": 67 * T, "tf32": 494.7 * T, "bf16": 989.4 * T, "fp16": 989.4 * T},
        3350,
        "nvlink4",
        "NVIDIA H100 SXM5 80GB",
    ),
    "h200": DevicePreset(
        141,
        {"fp64": 67 * T, "fp32": 67 * T, "tf32": 494.7 * T, "bf16": 989.4 * T, "fp16": 989.4 * T},
        4800,
        "nvlink4",
        "NVIDIA H200 SXM 141GB",
    ),
}
DEVICES["a100"] = DEVICES["a100-80"]

LINKS: dict[str, Link] = {
    # NVLink: total bidirectional bandwidth per GPU / 2 = per direction.
    "nvlink2": Link("nvlink2", 3e-6, 150 * GB),
    "nvlink3": Link("nvlink3", 3e-6, 300 * GB),
    "nvlink4": Link("nvlink4", 3e-6, 450 * GB),
    "pcie4": Link("pcie4", 5e-6, 32 * GB),
    "pcie5": Link("pcie5", 5e-6, 64 * GB),
    # InfiniBand / Ethernet: line rate in Gb/s / 8 = GB/s per NIC and direction.
    "ib-100": Link("ib-100", 5e-6, 12.5 * GB),
    "ib-200": Link("ib-200", 5e-6, 25 * GB),
    "ib-400": Link("ib-400", 5e-6, 50 * GB),
    "eth-25": Link("eth-25", 20e-6, 3.125 * GB),
    "eth-100": Link("eth-100", 20e-6, 12.5 * GB),
}

_INLINE_KEYS = {
    "nodes": "number of nodes",
    "gpus_per_node": "devices per node (alias devices_per_node)",
    "devices_per_node": "devices per node",
    "gpu": f"device preset: {', '.join(sorted(DEVICES))}",
    "intra": f"intra-node link: nvlink or {', '.join(sorted(LINKS))}",
    "inter": f"inter-node link: {', '.join(sorted(LINKS))}",
    "efficiency": "share of peak FLOP/s reached (default 0.5)",
    "memory_gb": "memory per device, overriding the preset",
}


def preset_cluster(
    gpu: str,
    *,
    nodes: int = 1,
    devices_per_node: int = 8,
    intra: str = "nvlink",
    inter: str = "ib-200",
    efficiency: float = 0.5,
    memory_gb: Optional[float] = None,
) -> Cluster:
    """A cluster of identical preset devices (datasheet figures)."""
    device = DEVICES.get(gpu.lower())
    if device is None:
        raise ClusterError(f"unknown gpu {gpu!r}; presets: {', '.join(sorted(DEVICES))} (or write a cluster TOML)")
    intra_name = device.nvlink if intra.lower() == "nvlink" else intra.lower()
    links = []
    for level, name in (("intra", intra_name), ("inter", inter.lower())):
        link = LINKS.get(name)
        if link is None:
            raise ClusterError(f"unknown {level} link {name!r}; presets: nvlink, {', '.join(sorted(LINKS))}")
        links.append(link)
    return Cluster(
        name=f"{nodes}x{devices_per_node} {gpu.lower()} {intra_name}/{links[1].name}",
        nodes=nodes,
        devices_per_node=devices_per_node,
        memory_bytes=(memory_gb if memory_gb is not None else device.memory_GB) * GB,
        flops=dict(device.flops),
        intra=links[0],
        inter=links[1],
        efficiency=efficiency,
        memory_bandwidth_Bps=device.memory_bandwidth_GBps * GB,
        reserved_bytes=2 * GB,
        source=f"datasheet: {device.datasheet}; links {links[0].name} and {links[1].name} (datasheet line rates)",
    )


def parse_cluster(text: str) -> Cluster:
    """A cluster from a TOML file path, an inline `key=value,...` string, or a bare device preset name."""
    if os.path.exists(text) or text.endswith(".toml"):
        return load_cluster_file(text)
    if "=" not in text:
        if text.lower() in DEVICES:
            return preset_cluster(text)
        raise ClusterError(
            f"--cluster {text!r}: not a file, a device preset ({', '.join(sorted(DEVICES))}) or an inline form "
            "such as 'nodes=128,gpus_per_node=8,gpu=h100,intra=nvlink,inter=ib-200'"
        )
    values: dict[str, str] = {}
    for part in text.split(","):
        key, sep, value = part.strip().partition("=")
        key = key.strip().lower()
        if not sep or key not in _INLINE_KEYS:
            keys = "; ".join(f"{k}: {v}" for k, v in _INLINE_KEYS.items())
            raise ClusterError(f"--cluster: cannot read {part.strip()!r}; the inline keys are {keys}")
        values[key] = value.strip()
    if "gpu" not in values:
        raise ClusterError("--cluster: the inline form needs gpu=NAME (e.g. gpu=h100)")
    try:
        nodes = int(values.get("nodes", "1"))
        per_node = int(values.get("gpus_per_node", values.get("devices_per_node", "8")))
        efficiency = float(values.get("efficiency", "0.5"))
        memory = float(values["memory_gb"]) if "memory_gb" in values else None
    except ValueError as exc:
        raise ClusterError(f"--cluster: {exc}; nodes and gpus_per_node are integers") from None
    return preset_cluster(
        values["gpu"],
        nodes=nodes,
        devices_per_node=per_node,
        intra=values.get("intra", "nvlink"),
        inter=values.get("inter", "ib-200"),
        efficiency=efficiency,
        memory_gb=memory,
    )


def describe_presets() -> list[str]:
    """One line per preset device and link, for `--help` and the docs."""
    lines = [
        f"{name}: {d.memory_GB:g} GB, bf16 {d.flops.get('bf16', d.flops.get('fp16', 0)) / T:g} TFLOP/s, "
        f"fp32 {d.flops['fp32'] / T:g} TFLOP/s, {d.memory_bandwidth_GBps:g} GB/s memory ({d.datasheet})"
        for name, d in DEVICES.items()
    ]
    lines += [f"{name}: {link.latency_s * 1e6:g} us, {link.bandwidth_Bps / GB:g} GB/s" for name, link in LINKS.items()]
    return lines

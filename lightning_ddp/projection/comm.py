"""What one collective costs: latency-bandwidth formulas (ring, tree), fabric presets, the measured fit (seconds,
bytes, bytes per second; the formulas and their sources: docs/projection.md)."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal, Optional, Protocol

from lightning_ddp.metrics.accounting import bus_factor

Algorithm = Literal["ring", "tree", "auto"]
"""All-reduce algorithms: ``ring``, ``tree``, or ``auto`` (the cheaper of the two per message, as NCCL's tuner)."""


# ---- links and fabrics ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Link:
    """One level of the interconnect, as NCCL sees it from one rank."""

    name: str
    bandwidth_Bps: float
    """Bus bandwidth per rank (per NIC for a network level), bytes/s: the large-message nccl-tests ``busbw``."""
    latency_s: float
    """``alpha``: latency of one algorithm step over this link, seconds."""
    source: str = ""  # where the numbers come from


class CommCost(Protocol):
    """What the timeline needs from a communication model: seconds for one collective ``kind`` (``all_reduce``,
    ``reduce_scatter``, ``all_gather`` or ``broadcast``) of ``nbytes`` on ``n`` ranks."""

    def collective_s(self, kind: str, nbytes: float, n: int) -> float: ...


@dataclass(frozen=True)
class Fabric:
    """An interconnect: one level (``inter=None``) or NVLink-style nodes joined by a network (docs/projection.md)."""

    name: str
    intra: Link
    """The link between ranks of one node (or between all ranks, for a one-level fabric)."""
    inter: Optional[Link] = None
    """The network between nodes, per NIC; ``None``: one level for every world size."""
    gpus_per_node: int = 8
    """Ranks per node; world sizes above it must be multiples of it (two-level fabrics only)."""
    nics_per_node: int = 8
    """Network interfaces per node, each at ``inter.bandwidth_Bps``."""
    call_overhead_s: float = 15e-6
    """``c``: fixed cost of every collective, seconds."""
    algorithm: Algorithm = "auto"
    """All-reduce algorithm: ``ring``, ``tree`` or ``auto``."""
    description: str = ""

    def nodes(self, n: int) -> int:
        """Nodes holding ``n`` ranks (1 for a one-level fabric or a single node)."""
        if self.inter is None or n <= self.gpus_per_node:
            return 1
        if n % self.gpus_per_node:
            raise ValueError(
                f"world size {n} does not fill whole nodes of {self.gpus_per_node} GPUs on fabric {self.name!r}; "
                f"use a multiple of {self.gpus_per_node} (or set `network.gpus_per_node`)"
            )
        return n // self.gpus_per_node

    def bus_bandwidth(self, n: int) -> float:
        """Bytes/s the ring (and tree) moves per rank at ``n`` ranks: the slower of NVLink and the node's NICs."""
        if self.nodes(n) == 1:
            return self.intra.bandwidth_Bps
        assert self.inter is not None
        return min(self.intra.bandwidth_Bps, self.nics_per_node * self.inter.bandwidth_Bps)

    def _cost_s(self, n: int, latency_s: float, bytes_per_rank: float) -> float:
        """One call on ``n`` ranks: the per-call cost, ``latency_s``, and ``bytes_per_rank`` at the bus bandwidth."""
        return 0.0 if n <= 1 else self.call_overhead_s + latency_s + bytes_per_rank / self.bus_bandwidth(n)

    def ring_s(self, kind: str, nbytes: float, n: int) -> float:
        """A ring ``kind``: all-reduce in two passes moving ``(n-1)/n`` of ``nbytes`` per rank each, reduce-scatter
        (``nbytes`` in) and all-gather (``nbytes`` out) in one, a pipelined broadcast in one moving all of it (the
        nccl-tests bus factors, ``bus_factor``)."""
        passes = 2 if kind == "all_reduce" else 1
        m = self.nodes(n)
        inter_s = (m - 1) * self.inter.latency_s if m > 1 else 0.0
        return self._cost_s(n, passes * ((n - m) * self.intra.latency_s + inter_s), bus_factor(kind, n) * nbytes)

    def tree_all_reduce_s(self, nbytes: float, n: int) -> float:
        """Seconds of a tree all-reduce of ``nbytes`` on ``n`` ranks (docs/projection.md)."""
        m = self.nodes(n)
        if self.inter is None:  # one level: the textbook double binary tree over all ranks, up and down
            return self._cost_s(n, 2 * math.ceil(math.log2(max(n, 1))) * self.intra.latency_s, 2 * nbytes)
        # NCCL: a chain inside each node, a double binary tree over nodes (tuning.cc)
        latency = 2 * ((n // m - 1) * self.intra.latency_s + math.ceil(math.log2(m)) * self.inter.latency_s)
        return self._cost_s(n, latency, 2 * nbytes)

    def collective_s(self, kind: str, nbytes: float, n: int) -> float:
        """Seconds for one ``kind`` of ``nbytes`` on ``n`` ranks: a ring's, an all-reduce's by ``algorithm``."""
        if kind != "all_reduce" or self.algorithm == "ring":
            return self.ring_s(kind, nbytes, n)
        if self.algorithm == "tree":
            return self.tree_all_reduce_s(nbytes, n)
        return min(self.ring_s(kind, nbytes, n), self.tree_all_reduce_s(nbytes, n))

    def shard_group_size(self, n: int) -> int:
        """hsdp's shard group on ``n`` ranks: the GPUs of one node (its NVLink), or every rank on one node or level."""
        return self.gpus_per_node if self.nodes(n) > 1 else n

    def across_nodes(self) -> Fabric:
        """The one-level fabric of groups of one rank per node (hsdp's replicate groups), every node's groups at once:
        each rank on its share of the node's NICs; a one-level fabric is itself."""
        if self.inter is None:
            return self
        share = self.nics_per_node / self.gpus_per_node
        link = replace(self.inter, bandwidth_Bps=share * self.inter.bandwidth_Bps)
        return replace(self, name=f"{self.name} across nodes", intra=link, inter=None)

    def describe(self) -> str:
        """One line for reports."""
        intra = self.intra
        text = f"{intra.name} {intra.bandwidth_Bps / 1e9:g} GB/s busbw, alpha {intra.latency_s * 1e6:g} us"
        if self.inter is not None:
            text += (f"; {self.gpus_per_node} GPUs/node; {self.nics_per_node} x {self.inter.name} "
                     f"{self.inter.bandwidth_Bps / 1e9:g} GB/s, alpha {self.inter.latency_s * 1e6:g} us")
        return text + f"; {self.call_overhead_s * 1e6:.3g} us per call; all-reduce: {self.algorithm}"


# Link presets. Bandwidths are large-message bus bandwidths per rank as NCCL reaches them, not line rates;
# latencies per algorithm step sit between NCCL's LL and LL128 per-hop figures (tuning.cc `hwLat`: NVLink
# .47 / 1.9 us, PCI 1.0 / 2.5 us, network 2.7 / 4.0 us), since we model one protocol for every message size.
NVLINK4 = Link(
    name="NVLink 4 (H100 SXM, NVSwitch)", bandwidth_Bps=370e9, latency_s=1.0e-6,
    source="450 GB/s per direction line rate (18 links x 25 GB/s, NVIDIA H100 datasheet); NCCL reaches ~370 GB/s with "
    "its ~20% protocol overhead (S. Jeaugey, github.com/NVIDIA/nccl-tests/issues/212)",
)
PCIE_GEN4 = Link(
    name="PCIe Gen4 x16", bandwidth_Bps=22e9, latency_s=2.0e-6,
    source="31.5 GB/s per direction line rate (16 GT/s x 16 lanes, 128b/130b); ~70% of it as NCCL busbw between two "
    "GPUs through the host bridge (P2P copies reach ~89% of line rate on Gen5, voipmonitor/rtx6kpro "
    "hardware/pcie-bandwidth.md, and NCCL's protocol takes ~20% more)",
)
PCIE_GEN5 = Link(
    name="PCIe Gen5 x16", bandwidth_Bps=44e9, latency_s=2.0e-6,
    source="63 GB/s per direction line rate (32 GT/s x 16 lanes); measured P2P ~54-56 GB/s (voipmonitor/rtx6kpro "
    "hardware/pcie-bandwidth.md); ~70% of line rate as NCCL busbw",
)
IB_NDR = Link(
    name="InfiniBand NDR 400 Gb/s", bandwidth_Bps=48e9, latency_s=4.0e-6,
    source="50 GB/s per NIC per direction; NCCL reaches ~96% of NIC line rate (192 of 200 GB/s on DGX A100, "
    "github.com/NVIDIA/nccl/issues/812); per-step latency NCCL's network LL128 figure (tuning.cc)",
)

FABRICS: dict[str, Fabric] = {
    "h100_nvlink_ib": Fabric(
        "h100_nvlink_ib", NVLINK4, IB_NDR, gpus_per_node=8, nics_per_node=8,
        description="DGX/HGX H100: 8 GPUs per node on NVLink 4 / NVSwitch, 8 x 400 Gb/s InfiniBand NDR per node",
    ),
    "nvlink4": Fabric("nvlink4", NVLINK4, description="NVLink 4 between every pair of ranks (one NVSwitch domain)"),
    "pcie_gen4": Fabric("pcie_gen4", PCIE_GEN4, description="GPUs talking over PCIe Gen4 x16 (no NVLink)"),
    "pcie_gen5": Fabric("pcie_gen5", PCIE_GEN5, description="GPUs talking over PCIe Gen5 x16 (no NVLink)"),
    "ib_ndr": Fabric("ib_ndr", IB_NDR, description="one GPU per node, each with its own 400 Gb/s InfiniBand NDR NIC"),
}
"""Interconnect presets by name (``network.preset``); ``measured`` comes from a fit file instead."""


def get_fabric(name: str) -> Fabric:
    """The preset ``name``; an unknown name lists the valid ones."""
    try:
        return FABRICS[name]
    except KeyError:
        raise ValueError(f"unknown `network.preset` {name!r}; choose one of {', '.join(FABRICS)}, or `measured` with "
                         "`network.fit_path`") from None


# ---- the measured fit ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MeasuredFit:
    """``t = o + S / w`` fitted to all-reduces on ``world_size`` ranks (``bucket_prediction.json`` of the sweep)."""

    overhead_s: float
    """``o``: per-call overhead, seconds."""
    bandwidth_Bps: float
    """``w``: algorithm bandwidth of one all-reduce (message bytes over time), bytes/s."""
    world_size: int = 2  # ranks the fit was measured on
    backend: str = ""
    """The backend the fit was measured on (``gloo``, ``nccl``); empty if not recorded."""
    device: str = ""
    """The device it was measured on, as recorded; empty if not."""

    def __post_init__(self) -> None:
        """Refuses a negative overhead, a bandwidth not > 0 and a world below 2 ranks."""
        if self.overhead_s < 0 or not self.bandwidth_Bps > 0:
            raise ValueError(f"measured fit: need overhead_s >= 0 and bandwidth_Bps > 0, got {self.overhead_s!r} "
                             f"and {self.bandwidth_Bps!r}; refit with "
                             "lightning_ddp.sync.bucket_model.fit_latency_bandwidth")
        if self.world_size < 2:
            raise ValueError("measured fit: world_size must be >= 2 (a fit on one rank measures no link), "
                             f"got {self.world_size}")

    def fabric(self, overhead_scaling: Literal["per_hop", "per_call"] = "per_hop",
               algorithm: Algorithm = "ring") -> Fabric:
        """The fit as a one-level fabric, extrapolated to any ``n`` as docs/projection.md states."""
        n0 = self.world_size
        bus = self.bandwidth_Bps * 2 * (n0 - 1) / n0  # nccl-tests busbw of the measured all-reduce
        per_hop = overhead_scaling == "per_hop"  # else per_call: a fixed cost per call
        alpha = self.overhead_s / (2 * (n0 - 1)) if per_hop else 0.0
        link = Link(name="measured", bandwidth_Bps=bus, latency_s=alpha, source="all-reduce microbenchmark fit")
        call = 0.0 if per_hop else self.overhead_s
        where = " ".join(x for x in (self.backend, self.device) if x)
        fitted_on = f"fitted on {n0} ranks" + (f" ({where})" if where else "")
        fit = f"o = {self.overhead_s * 1e6:.4g} us, w = {self.bandwidth_Bps / 1e9:.4g} GB/s"
        return Fabric("measured", link, call_overhead_s=call, algorithm=algorithm,
                      description=f"{fitted_on}: {fit}; overhead {overhead_scaling.replace('_', ' ')}")


def read_fit(path: str | os.PathLike) -> MeasuredFit:
    """Read ``overhead_s``, ``bandwidth_Bps`` (and ``world_size``, ``backend``, ``device``) from a fit JSON file."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"all-reduce fit {str(path)!r} does not exist; run the sweep with "
                         "`run.predict_bucket_size: true` (it writes bucket_prediction.json) or point "
                         "`network.fit_path` at such a file")
    data = json.loads(path.read_text(encoding="utf-8"))
    missing = [k for k in ("overhead_s", "bandwidth_Bps") if data.get(k) is None]
    if missing:
        raise ValueError(f"all-reduce fit {str(path)!r} lacks {missing}; it must hold overhead_s and bandwidth_Bps "
                         "(see benchmarks/results/cpu/bucket_prediction.json)")
    return MeasuredFit(overhead_s=float(data["overhead_s"]), bandwidth_Bps=float(data["bandwidth_Bps"]),
                       world_size=int(data.get("world_size") or 2), backend=str(data.get("backend") or ""),
                       device=str(data.get("device") or ""))

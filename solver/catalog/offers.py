"""GPU types, node configs and cloud offers, loaded from `solver/data/` into frozen models.

A *node config* is a GPU type and a GPU count per node (`l40sx1`, `h100x8`). An *offer* is a
(cloud, region, instance type) that realises a node config, with its $/hour and a default
availability. Node configs that no offer sells can still be named (`h100x2`, which the paper's
stacks list): they get a conservative default network bandwidth.
"""

from __future__ import annotations

import datetime as dt
from functools import cached_property
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from solver.errors import InputError, unknown_value
from solver.io import data_path, load_yaml_model
from solver.types import FROZEN

GpuId = str
NodeId = str
Cloud = Literal["aws", "gcp"]

# Used for node configs that no offer sells (no instance page to read): the slowest network any
# GPU offer in solver/data/offers.yaml lists. An assumption, reported as such.
DEFAULT_NETWORK_GBPS = 10.0


class GpuType(BaseModel):
    """One GPU model's datasheet numbers."""

    model_config = FROZEN
    name: str = Field(description="Marketing name, e.g. 'NVIDIA L4 24GB'.")
    memory_gb: float = Field(gt=0, description="GPU memory, decimal GB (the datasheet's).")
    memory_mib: int = Field(
        gt=0,
        description="Total device memory as the GPU reports it (nvidia-smi memory.total, MiB): "
        "what vLLM's --gpu-memory-utilization is a fraction of.",
    )
    memory_mib_source: str = Field(default="", description="Where memory_mib was read.")
    memory_bandwidth_gb_s: float = Field(gt=0, description="Memory bandwidth, GB/s.")
    dense_tflops: float = Field(gt=0, description="Dense BF16 (or FP16 without BF16) TFLOPS.")
    bf16: bool = Field(description="Whether the GPU has BF16 tensor cores.")
    interconnect: str | None = Field(
        default=None,
        description="All-reduce model key of its multi-GPU nodes in calibration.yaml `allreduce` "
        "(e.g. nvlink-h100, pcie-gen4); None: no multi-GPU node runs TP over it.",
    )
    interconnect_source: str = Field(default="", description="Where the interconnect is stated.")
    source: str = Field(description="Where the numbers come from.")
    retrieved: dt.date = Field(description="When the source was read.")

    @property
    def memory_bytes(self) -> int:
        """Device memory in bytes, as CUDA reports it."""
        return self.memory_mib * 2**20


class GpuFile(BaseModel):
    model_config = FROZEN
    schema_version: Literal[1]
    gpus: dict[GpuId, GpuType]


class Offer(BaseModel):
    """An instance type in one region that realises a node config."""

    model_config = FROZEN
    cloud: Cloud = Field(description="aws or gcp.")
    region: str = Field(min_length=1, description="Cloud region, e.g. us-east-2.")
    instance_type: str = Field(min_length=1, description="e.g. g6e.xlarge.")
    gpu: GpuId = Field(description="GPU type id from gpus.yaml.")
    gpu_count: int = Field(gt=0, description="GPUs per instance.")
    vcpus: int = Field(gt=0, description="vCPUs per instance.")
    memory_gib: float = Field(gt=0, description="Host memory, GiB.")
    network_gbps: float = Field(gt=0, description="Network bandwidth, Gbit/s.")
    network_note: str = Field(default="", description="E.g. 'up to' (burst) figures.")
    price_usd_per_hour: float = Field(gt=0, description="On-demand Linux price, USD/hour.")
    spot_price_usd_per_hour: float | None = Field(
        default=None,
        gt=0,
        description="Spot (AWS) or Spot VM (GCP) price, USD/hour: the dearest of `spot_zones` "
        "(a plan spreads spot instances over zones). None: the source has no spot price below "
        "on-demand for it.",
    )
    spot_zones: list[str] = Field(
        default_factory=list,
        description="Zones of the region whose spot price the source lists below on-demand.",
    )
    availability: int = Field(ge=0, description="Default nodes rentable now (stack can override).")
    zones: list[str] = Field(
        default_factory=list,
        description="Zones of the region that sell it, from the source's rows (GCP). Empty: "
        "not recorded; the deployment then uses its default zone.",
    )
    source: str = Field(description="Where the price came from.")
    retrieved: dt.date = Field(description="When the price was read.")

    @property
    def node(self) -> NodeId:
        return node_id(self.gpu, self.gpu_count)

    @model_validator(mode="after")
    def _spot_below_on_demand(self) -> Offer:
        spot = self.spot_price_usd_per_hour
        if spot is not None and (spot >= self.price_usd_per_hour or not self.spot_zones):
            raise ValueError(
                f"spot_price_usd_per_hour {spot} needs spot_zones and must be below the "
                f"on-demand price {self.price_usd_per_hour} (a spot price at or above it is the "
                "source's marker for none: leave the field out)"
            )
        if spot is None and self.spot_zones:
            raise ValueError("spot_zones without a spot_price_usd_per_hour")
        return self


class UnsoldShape(BaseModel):
    model_config = FROZEN
    cloud: Cloud
    node: NodeId
    reason: str


class Unpriced(BaseModel):
    model_config = FROZEN
    cloud: Cloud
    region: str
    node: NodeId
    reason: str


class OfferFile(BaseModel):
    model_config = FROZEN
    schema_version: Literal[1]
    offers: list[Offer]
    unsold_shapes: list[UnsoldShape] = Field(default_factory=list)
    unpriced: list[Unpriced] = Field(default_factory=list)

    @model_validator(mode="after")
    def _one_offer_per_shape(self) -> OfferFile:
        seen: set[tuple[str, str, str]] = set()
        for i, offer in enumerate(self.offers):
            key = (offer.cloud, offer.region, offer.node)
            if key in seen:
                raise ValueError(f"offers[{i}]: second offer for {key}; keep only the cheapest")
            seen.add(key)
        return self


class NodeConfig(BaseModel):
    """A GPU type times a GPU count: the unit a template is built from."""

    model_config = FROZEN
    id: NodeId
    gpu_id: GpuId
    gpu: GpuType
    gpu_count: int = Field(gt=0)
    network_gbps: float = Field(gt=0, description="Slowest network among the offers selling it.")
    sold: bool = Field(description="Whether any offer in the catalog sells this shape.")

    @property
    def memory_gb(self) -> float:
        return self.gpu.memory_gb * self.gpu_count


def node_id(gpu: GpuId, count: int) -> NodeId:
    return f"{gpu}x{count}"


def split_node_id(node: NodeId) -> tuple[GpuId, int]:
    """`'l40sx4'` -> `('l40s', 4)`; raises InputError on a malformed id."""
    gpu, sep, count = node.rpartition("x")
    if not sep or not gpu or not count.isdigit() or int(count) <= 0:
        raise InputError(
            "node", f"malformed node id '{node}'", "write <gpu>x<count>, e.g. l4x1 or h100x8"
        )
    return gpu, int(count)


class Catalog(BaseModel):
    """GPU types plus offers; the single source of node configs and prices."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    gpus: dict[GpuId, GpuType]
    offers: tuple[Offer, ...]
    unsold_shapes: tuple[UnsoldShape, ...] = ()
    unpriced: tuple[Unpriced, ...] = ()

    @model_validator(mode="after")
    def _offers_name_known_gpus(self) -> Catalog:
        for i, offer in enumerate(self.offers):
            if offer.gpu not in self.gpus:
                raise unknown_value(f"offers[{i}].gpu", offer.gpu, self.gpus, "GPU type")
        return self

    @cached_property
    def node_configs(self) -> dict[NodeId, NodeConfig]:
        """Every node config some offer sells, keyed by id, sorted."""
        shapes = sorted({(o.gpu, o.gpu_count) for o in self.offers})
        return {node_id(g, c): self._make_node(g, c) for g, c in shapes}

    def node(self, node: NodeId) -> NodeConfig:
        """A node config by id; shapes no cloud sells are accepted when the GPU type is known."""
        if node in self.node_configs:
            return self.node_configs[node]
        gpu, count = split_node_id(node)
        if gpu not in self.gpus:
            raise unknown_value("node", node, self.node_configs, "node config")
        return self._make_node(gpu, count)

    def _make_node(self, gpu: GpuId, count: int) -> NodeConfig:
        nets = [o.network_gbps for o in self.offers if o.gpu == gpu and o.gpu_count == count]
        return NodeConfig(
            id=node_id(gpu, count),
            gpu_id=gpu,
            gpu=self.gpus[gpu],
            gpu_count=count,
            network_gbps=min(nets) if nets else DEFAULT_NETWORK_GBPS,
            sold=bool(nets),
        )

    def offers_for(self, node: NodeId) -> list[Offer]:
        return [o for o in self.offers if o.node == node]

    def offer_in(self, node: NodeId, cloud: str, region: str) -> Offer | None:
        """The instance type that sells `node` in (cloud, region); None when none does."""
        return next(
            (o for o in self.offers_for(node) if (o.cloud, o.region) == (cloud, region)), None
        )

    @property
    def regions(self) -> list[tuple[str, str]]:
        """(cloud, region) pairs with at least one offer, sorted."""
        return sorted({(o.cloud, o.region) for o in self.offers})

    @cached_property
    def prices(self) -> dict[tuple[str, str], dict[NodeId, float]]:
        """(cloud, region) -> node config -> $/hour of its offer there."""
        out: dict[tuple[str, str], dict[NodeId, float]] = {}
        for o in self.offers:
            out.setdefault((o.cloud, o.region), {})[o.node] = o.price_usd_per_hour
        return dict(sorted(out.items()))

    def cheapest_region(
        self, nodes: list[NodeId], regions: list[tuple[str, str]] | None = None
    ) -> tuple[tuple[str, str], float] | None:
        """The cheapest (cloud, region) offering every node, with the nodes' total $/hour.

        Only `regions` are considered when given; None when no region offers them all.
        """
        best: tuple[tuple[str, str], float] | None = None
        for where, offered in self.prices.items():
            if regions is not None and where not in regions:
                continue
            if all(n in offered for n in nodes):
                total = sum(offered[n] for n in nodes)
                if best is None or total < best[1]:
                    best = (where, total)
        return best


def load_catalog(gpus_path: Path | None = None, offers_path: Path | None = None) -> Catalog:
    """Load the shipped catalog (or the given files)."""
    gpu_file = load_yaml_model(GpuFile, gpus_path or data_path("gpus.yaml"))
    offer_file = load_yaml_model(OfferFile, offers_path or data_path("offers.yaml"))
    try:
        return Catalog(
            gpus=gpu_file.gpus,
            offers=tuple(offer_file.offers),
            unsold_shapes=tuple(offer_file.unsold_shapes),
            unpriced=tuple(offer_file.unpriced),
        )
    except InputError:
        raise
    except ValueError as exc:  # pydantic wraps validator errors
        raise InputError(str(offers_path or "offers.yaml"), str(exc), "fix the data file") from exc

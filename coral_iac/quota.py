"""What a plan needs of the clouds' quotas, per region: a launch past a quota fails, and the
fleet is left short.

AWS limits running on-demand instances in vCPUs per instance class (EC2 Service Quotas): G and VT
instances (g4dn, g5, g6, g6e, ...) under L-DB2E81BA, P instances (p4d, p5, ...) under L-417A185B,
the rest under the Standard quota L-1216C47A. Spot instances count against separate vCPU quotas
("Spot Instance quotas", EC2 User Guide): All G and VT Spot Instance Requests (L-3819A6DF), All
P4, P3 and P2 (L-7212CCBC), All P5 (L-C4BD4855), All Standard (L-34B43A08); most accounts start
at 0 for the GPU ones. GCP limits GPUs per type and region (NVIDIA_<TYPE>_GPUS) and vCPUs per
region (CPUS); spot VMs take the preemptible quotas (PREEMPTIBLE_NVIDIA_<TYPE>_GPUS,
PREEMPTIBLE_CPUS) where the project has them, else the same ones. A replacement (an image upgrade, a changed
template) runs the old and the new instance side by side until the old drains, so the table also
gives twice each figure: what replacing every instance at once would need.

Checking against the account's actual quota needs credentials (`aws service-quotas
get-service-quota --service-code ec2 --quota-code CODE --region R`, `gcloud compute regions
describe R`); `coral preview` prints the needs with those commands.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from solver.catalog.offers import Catalog
from solver.plan_schema import Plan

AWS_CLASSES = {
    "g": ("L-DB2E81BA", "Running On-Demand G and VT instances"),
    "vt": ("L-DB2E81BA", "Running On-Demand G and VT instances"),
    "p": ("L-417A185B", "Running On-Demand P instances"),
}
AWS_STANDARD = ("L-1216C47A", "Running On-Demand Standard (A, C, D, H, I, M, R, T, Z) instances")
AWS_SPOT_CLASSES = {
    "g": ("L-3819A6DF", "All G and VT Spot Instance Requests"),
    "vt": ("L-3819A6DF", "All G and VT Spot Instance Requests"),
    "p2": ("L-7212CCBC", "All P4, P3 and P2 Spot Instance Requests"),
    "p3": ("L-7212CCBC", "All P4, P3 and P2 Spot Instance Requests"),
    "p4": ("L-7212CCBC", "All P4, P3 and P2 Spot Instance Requests"),
    "p5": ("L-C4BD4855", "All P5 Spot Instance Requests"),
}
AWS_SPOT_STANDARD = (
    "L-34B43A08",
    "All Standard (A, C, D, H, I, M, R, T, Z) Spot Instance Requests",
)
# GCP's quota metric per GPU type of the catalog (Compute Engine "GPU quota" names).
GCP_GPU_QUOTAS = {
    "t4": "NVIDIA_T4_GPUS",
    "l4": "NVIDIA_L4_GPUS",
    "v100": "NVIDIA_V100_GPUS",
    "a100-40gb": "NVIDIA_A100_GPUS",
    "a100-80gb": "NVIDIA_A100_80GB_GPUS",
    "h100": "NVIDIA_H100_GPUS",
}


@dataclass(frozen=True)
class QuotaNeed:
    """One quota of one region and what the plan's instances take of it."""

    cloud: str
    region: str
    quota: str  # AWS quota code, or GCP metric
    name: str
    unit: str  # "vCPUs" or "GPUs"
    needed: int

    @property
    def during_replacement(self) -> int:
        return 2 * self.needed

    @property
    def check(self) -> str:
        """The command that reads the account's limit."""
        if self.cloud == "aws":
            return (
                f"aws service-quotas get-service-quota --service-code ec2 --quota-code "
                f"{self.quota} --region {self.region}"
            )
        return f"gcloud compute regions describe {self.region} (quota {self.quota})"


def aws_quota(instance_type: str, spot: bool = False) -> tuple[str, str]:
    """(code, name) of the on-demand (or, `spot`, the spot) vCPU quota an EC2 instance type
    counts against."""
    family = re.match(r"[a-z]+\d?", instance_type)
    name = family.group(0) if family else ""
    classes, standard = (
        (AWS_SPOT_CLASSES, AWS_SPOT_STANDARD) if spot else (AWS_CLASSES, AWS_STANDARD)
    )
    for prefix in sorted(classes, key=len, reverse=True):
        if name.startswith(prefix):
            return classes[prefix]
    return standard


def quota_needs(plan: Plan, catalog: Catalog) -> list[QuotaNeed]:
    """Per (cloud, region, quota): what the plan's GPU nodes need, sorted. Nodes without a
    catalog offer (refused before deployment) are left out."""
    totals: dict[tuple[str, str, str, str, str], int] = {}

    def add(key: tuple[str, str, str, str, str], amount: int) -> None:
        totals[key] = totals.get(key, 0) + amount

    for inst in plan.instances:
        for node in inst.nodes:
            offer = catalog.offer_in(node, inst.cloud, inst.region)
            if offer is None:
                continue
            if inst.cloud == "aws":
                code, name = aws_quota(offer.instance_type, inst.is_spot)
                add(("aws", inst.region, code, name, "vCPUs"), offer.vcpus)
            else:
                metric = GCP_GPU_QUOTAS.get(offer.gpu, f"NVIDIA_{offer.gpu.upper()}_GPUS")
                pre, what = ("PREEMPTIBLE_", "spot ") if inst.is_spot else ("", "")
                gpus = f"{what}{offer.gpu} GPUs"
                add(("gcp", inst.region, pre + metric, gpus, "GPUs"), offer.gpu_count)
                add(("gcp", inst.region, pre + "CPUS", f"{what}vCPUs", "vCPUs"), offer.vcpus)
    return [QuotaNeed(*key, needed) for key, needed in sorted(totals.items())]

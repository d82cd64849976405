"""Import offers from a SkyPilot catalog `vms.csv` (schema v8) so users can refresh prices.

Rules:
- One row per availability zone: the cheapest zone's on-demand price is the region's price.
- AWS rows carry the GPU (AcceleratorName, AcceleratorCount) and the whole instance price.
- GCP lists GPU prices as separate rows with an empty InstanceType; the offer price is the host VM
  row plus the GPU row. A2/A3/G2 machine types imply their GPU (`GCP_BUNDLED`); T4 and V100 attach
  to an N1 host, for which we use n1-standard-(4 x GPUs) (the smallest N1 size with room for a
  serving process), written `n1-standard-4+1xT4`.
- Placeholder prices are dropped: empty, zero or negative, and 700.0 (SkyPilot's marker for an
  unavailable accelerator region). Unknown GPUs and counts outside 1/2/4/8 are skipped.
- Spot: a zone's SpotPrice counts when it is below that row's on-demand price and above a tenth
  of it (`SPOT_FLOOR`): the catalogs write it equal to on-demand, or leave it empty, where a zone
  sells no spot capacity. GCP adds the host's and the GPU's of one zone. The offer's spot price
  is the dearest counted zone's below the offer's on-demand price, as a plan spreads its spot
  instances over the zones (`spot_zones`).
- Network bandwidth and availability are not in the CSV: they are kept from the current catalog's
  offer for the same instance type / shape, else the catalog defaults (named in `network_note`).
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Iterable, Mapping

from solver.catalog.offers import DEFAULT_NETWORK_GBPS, Catalog, Offer, node_id
from solver.errors import InputError

ACCELERATOR_IDS = {
    "H100": "h100",
    "A100-80GB": "a100-80gb",
    "A100": "a100-40gb",
    "L40S": "l40s",
    "L4": "l4",
    "A10G": "a10g",
    "T4": "t4",
    "V100": "v100",
}
GCP_BUNDLED = [
    (re.compile(r"^a3-highgpu-(\d)g$"), "H100", None),
    (re.compile(r"^a2-ultragpu-(\d)g$"), "A100-80GB", None),
    (re.compile(r"^a2-highgpu-(\d)g$"), "A100", None),
    (
        re.compile(r"^g2-standard-(\d+)$"),
        "L4",
        {4: 1, 8: 1, 12: 1, 16: 1, 32: 1, 24: 2, 48: 4, 96: 8},
    ),
]
GCP_N1_GPUS = ("T4", "V100")
PLACEHOLDER_PRICES = {700.0}
# A spot price at or below this share of on-demand is read as a placeholder, not a price: the
# AWS catalog has p3.8xlarge in apne2-az1 at exactly a tenth of on-demand (1.6936 of 16.936).
SPOT_FLOOR = 0.1
GPU_COUNTS = {1, 2, 4, 8}
DEFAULT_AVAILABILITY = {1: 16, 2: 8, 4: 4, 8: 2}
REQUIRED_COLUMNS = {
    "InstanceType",
    "AcceleratorName",
    "AcceleratorCount",
    "vCPUs",
    "MemoryGiB",
    "Region",
    "Price",
}


def _price(row: Mapping[str, str]) -> float | None:
    try:
        price = float(row.get("Price") or "nan")
    except ValueError:
        return None
    if not price > 0 or price in PLACEHOLDER_PRICES:
        return None
    return price


def _count(text: str | None) -> int | None:
    try:
        return int(float(text or ""))
    except ValueError:
        return None


def _spot(row: Mapping[str, str]) -> float | None:
    """The row's SpotPrice when it is a discount: below the row's on-demand price (the catalogs
    write a spot price equal to on-demand, or none, where a zone sells no spot capacity) and
    above SPOT_FLOOR of it."""
    price = _price(row)
    try:
        spot = float(row.get("SpotPrice") or "nan")
    except ValueError:
        return None
    if price is None or not SPOT_FLOOR * price < spot < price or spot in PLACEHOLDER_PRICES:
        return None
    return spot


ZoneSpots = dict[tuple[str, str], dict[str, float]]


def spot_prices(rows: list[Mapping[str, str]], cloud: str) -> ZoneSpots:
    """(region, instance type as the importer names it) -> zone -> spot $/hour, for the zones
    whose rows carry a spot discount. AWS: the instance's row. GCP: the host row plus the GPU row
    of the same zone (A2, A3 and G2 bundle theirs; T4 and V100 on `n1-standard-(4 x GPUs)`)."""
    out: ZoneSpots = {}
    if cloud == "aws":
        for row in rows:
            spot = _spot(row)
            if row["InstanceType"] and spot is not None:
                key = (row["Region"], row["InstanceType"])
                out.setdefault(key, {})[row.get("AvailabilityZone", "")] = spot
        return out
    hosts: dict[tuple[str, str, str], float] = {}
    gpus: dict[tuple[str, str, int, str], float] = {}
    for row in rows:
        spot, zone = _spot(row), row.get("AvailabilityZone", "")
        if spot is None:
            continue
        if row["InstanceType"]:
            hosts[(row["Region"], row["InstanceType"], zone)] = spot
        elif (count := _count(row.get("AcceleratorCount"))) is not None:
            gpus[(row["Region"], row["AcceleratorName"], count, zone)] = spot
    for (region, itype, zone), host in hosts.items():
        bundled = _bundled_gpu(itype)
        bundled_gpu = gpus.get((region, *bundled, zone)) if bundled is not None else None
        if bundled_gpu is not None:
            out.setdefault((region, itype), {})[zone] = round(host + bundled_gpu, 6)
    for (region, acc, count, zone), gpu in gpus.items():
        host_type = f"n1-standard-{4 * count}"
        n1_host = hosts.get((region, host_type, zone))
        if acc in GCP_N1_GPUS and n1_host is not None:
            out.setdefault((region, f"{host_type}+{count}x{acc}"), {})[zone] = round(
                n1_host + gpu, 6
            )
    return out


def spot_fields(zones: Mapping[str, float], on_demand: float) -> dict[str, object]:
    """An offer's spot fields from its zones' spot prices (`spot_prices`), counting the zones
    below the offer's `on_demand` $/hour: the dearest such zone's price (a plan spreads spot
    instances over the zones) and those zones, or none."""
    below = {z: v for z, v in zones.items() if v < round(on_demand, 6)}
    if not below:
        return {"spot_price_usd_per_hour": None, "spot_zones": []}
    return {"spot_price_usd_per_hour": round(max(below.values()), 6), "spot_zones": sorted(below)}


def _aws_candidates(
    rows: list[Mapping[str, str]],
) -> Iterable[tuple[str, str, str, int, float, Mapping[str, str]]]:
    for row in rows:
        acc, count, price = (
            row.get("AcceleratorName", ""),
            _count(row.get("AcceleratorCount")),
            _price(row),
        )
        if (
            acc in ACCELERATOR_IDS
            and count in GPU_COUNTS
            and price is not None
            and row["InstanceType"]
        ):
            yield row["Region"], row["InstanceType"], ACCELERATOR_IDS[acc], count, price, row


def _gcp_gpu_prices(rows: list[Mapping[str, str]]) -> dict[tuple[str, str, int], float]:
    """(region, accelerator, count) -> cheapest zone price of the GPU-only rows."""
    out: dict[tuple[str, str, int], float] = {}
    for row in rows:
        count, price = _count(row.get("AcceleratorCount")), _price(row)
        if row["InstanceType"] or count is None or price is None:
            continue
        key = (row["Region"], row["AcceleratorName"], count)
        out[key] = min(price, out.get(key, price))
    return out


def _bundled_gpu(itype: str) -> tuple[str, int] | None:
    """(accelerator, count) a GCP machine type comes with (A2, A3, G2), else None."""
    for pattern, acc, by_size in GCP_BUNDLED:
        if m := pattern.match(itype):
            n = int(m.group(1))
            return acc, (by_size.get(n, 0) if by_size else n)
    return None


def _gcp_candidates(
    rows: list[Mapping[str, str]],
) -> Iterable[tuple[str, str, str, int, float, Mapping[str, str]]]:
    gpu_prices = _gcp_gpu_prices(rows)
    hosts = {(r["Region"], r["InstanceType"]): r for r in rows if r["InstanceType"] and _price(r)}
    for (region, itype), row in hosts.items():
        bundled = _bundled_gpu(itype)
        if bundled is None:
            continue
        acc, count = bundled
        gpu_price = gpu_prices.get((region, acc, count))
        host_price = _price(row)
        if count in GPU_COUNTS and gpu_price is not None and host_price is not None:
            yield region, itype, ACCELERATOR_IDS[acc], count, host_price + gpu_price, row
    for (region, acc, count), gpu_price in gpu_prices.items():
        host_type = f"n1-standard-{4 * count}"
        host = hosts.get((region, host_type))
        host_price = _price(host) if host else None
        if (
            acc in GCP_N1_GPUS
            and count in GPU_COUNTS
            and host is not None
            and host_price is not None
        ):
            itype = f"{host_type}+{count}x{acc}"
            yield region, itype, ACCELERATOR_IDS[acc], count, host_price + gpu_price, host


def import_vms_rows(
    rows: list[Mapping[str, str]],
    cloud: str,
    current: Catalog,
    source: str,
    retrieved: dt.date,
    regions: set[str] | None = None,
) -> list[Offer]:
    """Offers (cheapest instance type per region and node shape) from SkyPilot vms.csv rows."""
    if rows and not REQUIRED_COLUMNS <= set(rows[0]):
        missing = sorted(REQUIRED_COLUMNS - set(rows[0]))
        raise InputError(source, f"missing columns {missing}", "pass a SkyPilot v8 vms.csv")
    if cloud not in ("aws", "gcp"):
        raise InputError("cloud", f"unknown cloud '{cloud}'", "use aws or gcp")
    cands = _aws_candidates(rows) if cloud == "aws" else _gcp_candidates(rows)
    best: dict[tuple[str, str], tuple[float, str, str, int, Mapping[str, str]]] = {}
    for region, itype, gpu, count, price, row in cands:
        if gpu not in current.gpus or (regions and region not in regions):
            continue
        key = (region, node_id(gpu, count))
        if key not in best or (price, itype) < best[key][:2]:
            best[key] = (price, itype, gpu, count, row)
    spots = spot_prices(rows, cloud)
    return [
        _offer(cloud, region, itype, gpu, count, price, row, current, source, retrieved, spots)
        for (region, _), (price, itype, gpu, count, row) in sorted(best.items())
    ]


def _offer(
    cloud: str,
    region: str,
    itype: str,
    gpu: str,
    count: int,
    price: float,
    row: Mapping[str, str],
    current: Catalog,
    source: str,
    retrieved: dt.date,
    spots: ZoneSpots,
) -> Offer:
    same_type = [o for o in current.offers if o.cloud == cloud and o.instance_type == itype]
    same_shape = [
        o
        for o in current.offers
        if (o.cloud, o.region) == (cloud, region) and o.node == node_id(gpu, count)
    ]
    network = same_type[0].network_gbps if same_type else DEFAULT_NETWORK_GBPS
    note = (
        same_type[0].network_note if same_type else "unknown: not in the SkyPilot catalog; default"
    )
    availability = same_shape[0].availability if same_shape else DEFAULT_AVAILABILITY[count]
    return Offer(
        cloud=cloud,
        region=region,
        instance_type=itype,
        gpu=gpu,
        gpu_count=count,
        vcpus=int(float(row["vCPUs"])),
        memory_gib=float(row["MemoryGiB"]),
        network_gbps=network,
        network_note=note,
        price_usd_per_hour=round(price, 6),
        availability=availability,
        source=source,
        retrieved=retrieved,
        **spot_fields(spots.get((region, itype), {}), price),
    )

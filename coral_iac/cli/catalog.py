"""`coral catalog`: GPU types, node configs and cloud offers; importing SkyPilot's catalog."""

from __future__ import annotations

import csv
import datetime as dt
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated

import typer
import yaml
from rich.table import Table

from coral_iac.cli.console import err, out, print_json, reports_errors

catalog_app = typer.Typer(help="GPU types, node configs and cloud offers.", no_args_is_help=True)


@catalog_app.command("show")
@reports_errors
def catalog_show(
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
    cloud: Annotated[str | None, typer.Option(help="Only this cloud (aws, gcp).")] = None,
    region: Annotated[str | None, typer.Option(help="Only this region.")] = None,
) -> None:
    """Print every offer: instance type, node config, $/hour, network, default availability."""
    from solver.catalog.offers import load_catalog

    cat = load_catalog()
    offers = [o for o in cat.offers if (cloud in (None, o.cloud)) and (region in (None, o.region))]
    if as_json:
        print_json([o.model_dump(mode="json") | {"node": o.node} for o in offers])
        return
    table = Table(title=f"{len(offers)} offers (on-demand, USD/hour)")
    for col in (
        "cloud",
        "region",
        "node",
        "instance type",
        "$/hour",
        "$/GPU-hour",
        "net Gbps",
        "avail",
        "price read",
    ):
        table.add_column(col, justify="right" if col[0] in "$na" else "left")
    for o in offers:
        table.add_row(
            o.cloud,
            o.region,
            o.node,
            o.instance_type,
            f"{o.price_usd_per_hour:.3f}",
            f"{o.price_usd_per_hour / o.gpu_count:.3f}",
            f"{o.network_gbps:g}",
            str(o.availability),
            str(o.retrieved),
        )
    out.print(table)
    if cat.unsold_shapes:
        err.print(
            "Shapes of the 1/2/4/8-GPU grid no cloud here sells: "
            + ", ".join(f"{u.cloud}:{u.node}" for u in cat.unsold_shapes)
        )


@catalog_app.command("import-skypilot")
@reports_errors
def catalog_import_skypilot(
    vms_csv: Annotated[Path, typer.Argument(help="SkyPilot catalog vms.csv (schema v8).")],
    cloud: Annotated[str, typer.Option(help="Which cloud the file is for: aws or gcp.")],
    region: Annotated[list[str] | None, typer.Option(help="Keep only these regions.")] = None,
    out_path: Annotated[
        Path | None, typer.Option("--out", help="Write offers YAML here (default: stdout).")
    ] = None,
) -> None:
    """Read a SkyPilot vms.csv into offers (cheapest instance per region and node shape)."""
    from solver.catalog.offers import load_catalog
    from solver.catalog.skypilot_import import import_vms_rows
    from solver.errors import InputError

    try:
        with vms_csv.open(encoding="utf-8", newline="") as handle:
            rows: list[Mapping[str, str]] = list(csv.DictReader(handle))
    except OSError as exc:
        raise InputError(
            str(vms_csv), f"cannot read file ({exc.strerror})", "check the path"
        ) from exc
    offers = import_vms_rows(
        rows,
        cloud,
        load_catalog(),
        f"SkyPilot catalog {vms_csv.name}",
        dt.date.today(),
        set(region) if region else None,
    )
    doc = {"schema_version": 1, "offers": [o.model_dump(mode="json") for o in offers]}
    text = yaml.safe_dump(doc, sort_keys=False)
    if out_path:
        out_path.write_text(text, encoding="utf-8")
        err.print(f"Wrote {len(offers)} offers to {out_path}")
    else:
        sys.stdout.write(text)



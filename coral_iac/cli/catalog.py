"""`coral catalog`: GPU types, node configs and cloud offers; importing SkyPilot's catalog."""

from __future__ import annotations

import csv
import datetime as dt
import io
import math
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated

import typer
import yaml

from coral_iac.cli.console import (
    err,
    load_stack_named,
    out,
    print_json,
    reports_errors,
    wrapping_table,
)

catalog_app = typer.Typer(help="GPU types, node configs and cloud offers.", no_args_is_help=True)


@catalog_app.command("show")
@reports_errors
def catalog_show(
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
    cloud: Annotated[str | None, typer.Option(help="Only this cloud (aws, gcp).")] = None,
    region: Annotated[str | None, typer.Option(help="Only this region.")] = None,
) -> None:
    """Print every offer: instance type, node config, $/hour on demand and as spot, how much of
    the spot capacity is taken back a month (an assumption where marked *), network, default
    availability."""
    # Deferred to when the command runs: the solver modules behind it (numpy,
    # pydantic, OR-Tools) would slow the start of every coral command.
    from solver.catalog.offers import load_catalog
    from solver.catalog.preemption import HOURS_PER_MONTH, Preemption, offer_preemption

    cat = load_catalog()
    offers = [o for o in cat.offers if (cloud in (None, o.cloud)) and (region in (None, o.region))]
    # Each offer with the preemption model of its spot capacity (None: not sold as spot).
    shown = [
        (o, offer_preemption(o) if o.spot_price_usd_per_hour is not None else None) for o in offers
    ]
    if as_json:
        print_json(
            [
                o.model_dump(mode="json")
                | {
                    "node": o.node,
                    "spot_preemption": None if p is None else p.model_dump(mode="json"),
                }
                for o, p in shown
            ]
        )
        return

    def lost(p: Preemption | None) -> str:
        if p is None:
            return "-"
        share = -math.expm1(-p.rate_per_hour * HOURS_PER_MONTH)
        return f"{share:.0%}" + ("*" if p.source.startswith("assumed") else "")

    right = ("$/hour", "$/GPU-hour", "spot $/hour", "spot lost/month", "net Gbps", "avail")
    headers = ["cloud", "region", "node", "instance type", *right, "price read"]
    rows = [
        [
            o.cloud,
            o.region,
            o.node,
            o.instance_type,
            f"{o.price_usd_per_hour:.3f}",
            f"{o.price_usd_per_hour / o.gpu_count:.3f}",
            "-" if o.spot_price_usd_per_hour is None else f"{o.spot_price_usd_per_hour:.3f}",
            lost(p),
            f"{o.network_gbps:g}",
            str(o.availability),
            str(o.retrieved),
        ]
        for o, p in shown
    ]
    columns = [(h, "right" if h in right else "left") for h in headers]
    table = wrapping_table(f"{len(offers)} offers (USD/hour)", columns, rows)
    out.print(table)
    if any(p is not None for _, p in shown):
        err.print(
            "spot lost/month: the share of spot instances the cloud takes back in a month "
            "(AWS Spot Instance Advisor buckets; * an assumption: solver/data/spot/"
            "preemption.yaml, overridden per stack under coral:fleet.preemption)"
        )
    if cat.unsold_shapes:
        err.print(
            "Shapes of the 1/2/4/8-GPU grid no cloud here sells: "
            + ", ".join(f"{u.cloud}:{u.node}" for u in cat.unsold_shapes)
        )


@catalog_app.command("models")
@reports_errors
def catalog_models(
    stack: Annotated[
        str | None,
        typer.Option(help="Also list this stack's own models (coral:fleet.model_cards)."),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """Every model id a stack may serve: layers, parameters, context and where it comes from.

    Built-in models come with Coral; a stack adds its own from their config.json
    (docs/models.md), listed with `--stack`.
    """
    # Deferred to when the command runs: the solver modules behind it (numpy,
    # pydantic, OR-Tools) would slow the start of every coral command.
    from solver.catalog.model_cards import load_model_cards
    from solver.catalog.user_models import stack_cards

    own = load_stack_named(stack).model_cards if stack else {}
    cards = stack_cards(own)
    builtin = load_model_cards()
    rows = [
        {
            "id": model,
            "name": card.display_name,
            "layers": card.layers,
            "params_b": card.params_b,
            "moe": card.is_moe,
            "context": card.max_context,
            "source": card.hf_repo,
            "card": "built-in" if model in builtin else f"stack {stack}",
        }
        for model, card in sorted(cards.items())
    ]
    if as_json:
        print_json(rows)
        return
    cells = [
        [
            str(r["id"]),
            str(r["layers"]),
            (f"{r['params_b']:g}B" if r["params_b"] is not None else "-")
            + (" MoE" if r["moe"] else ""),
            f"{r['context']:,}",
            str(r["source"]),
            str(r["card"]),
        ]
        for r in rows
    ]
    columns = [("id", "left"), ("layers", "right"), ("parameters", "right")]
    columns += [("context", "right"), ("source", "left"), ("card", "left")]
    title = f"{len(rows)} models (ids for coral:fleet.models; source: Hugging Face)"
    table = wrapping_table(title, columns, cells)
    out.print(table)


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
    # Deferred to when the command runs: the solver modules behind it (numpy,
    # pydantic, OR-Tools) would slow the start of every coral command.
    from solver.catalog.offers import load_catalog
    from solver.catalog.skypilot_import import import_vms_rows
    from solver.io import read_text

    # read_text: a missing file or one that is not UTF-8 is an InputError, not a traceback.
    rows: list[Mapping[str, str]] = list(csv.DictReader(io.StringIO(read_text(vms_csv))))
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
        # Deferred to when the command runs: the solver modules behind it (numpy,
        # pydantic, OR-Tools) would slow the start of every coral command.
        from solver.io import write_atomic

        write_atomic(out_path, text)
        err.print(f"Wrote {len(offers)} offers to {out_path}")
    else:
        sys.stdout.write(text)

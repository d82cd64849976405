"""`coral preview` and `coral render`: the Pulumi program, offline, for everyone.

Both run `coral_iac/program.py` in-process under Pulumi's mocks (`coral_iac/preview.py`):
the same code `pulumi preview` runs, with no Pulumi CLI and no cloud credentials.
"""

from __future__ import annotations

import re
import shutil
import tempfile
from pathlib import Path
from typing import Annotated, Any

import typer

from coral_iac.cli.console import (
    FittedTable,
    err,
    library_root,
    out,
    print_json,
    reports_errors,
    stacks_dir,
    warn,
)
from coral_iac.cli.plan import check_plan_stack, load_plan
from coral_iac.cost_report import cost_diff_table
from coral_iac.deploy_settings import load_deploy_settings
from coral_iac.exposure import exposure_warnings
from coral_iac.quota import quota_needs
from solver.catalog.offers import load_catalog
from solver.errors import CoralError, InputError
from solver.operations.reconfiguration import FleetState
from solver.validation import check_stack_name

NODE_TYPES = ("aws:ec2/instance:Instance", "gcp:compute/instance:Instance")


def _run(stack: str, previous: Path | None, library: Path | None) -> Any:
    # Pulumi and the program (ortools, scipy) take about a second to import: only when run.
    import pulumi

    from coral_iac.preview import preview_stack
    from coral_iac.program import ProgramOptions

    check_stack_name(stack)
    running = load_plan(previous) if previous is not None else None
    check_plan_stack(running, stack, previous)
    # Offline, a stale local library is rebuilt, as `coral plan` does.
    options = ProgramOptions(stacks_dir(), library_root(), library, rebuild_stale=True)
    try:
        return preview_stack(stack, options, running), running
    except pulumi.RunError as e:
        raise CoralError(str(e)) from None


def preview(
    stack: Annotated[str, typer.Option(help="Stack name (stacks/Pulumi.<stack>.yaml).")],
    previous: Annotated[
        Path | None, typer.Option(help="The running plan.json (default: a new stack).")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
    library: Annotated[
        Path | None,
        typer.Option(help="Template-library folder (default .coral/library/<stack>)."),
    ] = None,
) -> None:
    """What `pulumi preview` would declare: resources by region and instance, and the cost diff."""
    # These two import Pulumi (about 0.2 s): only when the command runs.
    from coral_iac.components import gcp_label
    from coral_iac.gateway_cost import GatewayCost

    result, running = _run(stack, previous, library)
    nodes = [r for r in result.resources if r.type in NODE_TYPES and not _is_gateway(r)]
    needs = quota_needs(result.plan, load_catalog())
    if as_json:
        print_json(
            {
                "outputs": {k: v for k, v in result.outputs.items() if k != "plan"},
                # Each resource with its inputs, as `pulumi preview --json` shows a step's new
                # state, so a script can check zones, images and market options.
                "resources": [
                    {"type": r.type, "name": r.name, "inputs": masked(r.inputs)}
                    for r in result.resources
                ],
                "quota": [
                    {
                        "cloud": q.cloud,
                        "region": q.region,
                        "quota": q.quota,
                        "name": q.name,
                        "unit": q.unit,
                        "needed": q.needed,
                        "during_replacement": q.during_replacement,
                        "check": q.check,
                    }
                    for q in needs
                ],  # fmt: skip
            }
        )
        return
    state = FleetState.model_validate_json(result.outputs["fleet_state"])
    # GCP label values are lowercased and stripped of '/' and ':': map them back to the keys.
    by_label = {gcp_label(key): key for key in state.members}
    by_region: dict[str, list[Any]] = {}
    for n in nodes:
        tags = n.inputs.get("tags") or {}
        if isinstance(tags, dict) and "coral:replica" in tags:
            replica, node = tags["coral:replica"], tags["coral:node"]
        else:  # GCP labels
            labels = n.inputs.get("labels", {})
            label = labels.get("coral-replica", "")
            replica, node = by_label.get(label, label or n.name), labels.get("coral-node", "?")
        region = replica.split("/")[2] if replica.count("/") >= 3 else "?"
        machine = n.inputs.get("instanceType") or n.inputs.get("machineType")
        by_region.setdefault(region, []).append((replica, node, machine, n.name))
    for region, rows in sorted(by_region.items()):
        table = FittedTable(title=f"{region}: {len(rows)} GPU nodes")
        for col in ("serving instance (replica key)", "node", "instance type"):
            table.add_column(col)
        for replica, node, machine, _ in sorted(rows):
            table.add_row(replica, str(node), str(machine))
        out.print(table)
    shared: dict[str, int] = {}
    for r in result.resources:
        if r.type not in NODE_TYPES and r.type != "coral:fleet:ServingInstance":
            shared[r.type] = shared.get(r.type, 0) + 1
    out.print(
        "Shared resources: "
        + ", ".join(f"{t.split(':')[-1]} x{n}" for t, n in sorted(shared.items()))
    )
    quota = FittedTable(title="Quota the GPU nodes need (a launch past a quota fails)")
    for col in ("region", "quota", "needed", "replacing every instance at once", "check with"):
        quota.add_column(
            col, justify="right" if col.startswith(("needed", "replacing")) else "left"
        )
    for q in needs:
        quota.add_row(
            f"{q.cloud}:{q.region}",
            f"{q.name} ({q.quota})",
            f"{q.needed} {q.unit}",
            f"{q.during_replacement} {q.unit}",
            q.check,
        )
    out.print(quota)
    gateway_raw = result.outputs.get("gateway_cost")
    gateway = GatewayCost.model_validate(gateway_raw) if gateway_raw else None
    out.print(cost_diff_table(running, result.plan, state, gateway))
    deploy = load_deploy_settings(stacks_dir(), stack)
    for line in exposure_warnings(deploy):
        warn(line)
    reach = "mock addresses" + ("" if deploy.api_cidrs else "; unreachable: api_cidrs is empty")
    for model, urls in sorted((result.outputs.get("endpoints") or {}).items()):
        out.print(f"{model}: {', '.join(urls)}  ({reach})")
    if "gateway" in result.outputs:
        (vm,) = [r for r in result.resources if r.type in NODE_TYPES and _is_gateway(r)]
        out.print(f"Gateway ({vm.inputs.get('instanceType')}): {result.outputs['gateway']}")
        for model, url in sorted(result.outputs["gateway_endpoints"].items()):
            out.print(f"  {model}: {url}  (one address per model; {reach})")


# Keys that hold a secret's value (not its name: `secretId` stays; nor `httpTokens`, IMDSv2's).
SECRET_KEY = re.compile(
    r"^(password|secret_?(string|binary|value)|private_?key|token|"
    r"(api|access|auth|hf|bearer)_?(key|token))$",
    re.I,
)


def masked(value: Any) -> Any:
    """`value` with the value of every key that names a secret replaced by "[secret]" (a secret
    name such as `secretId` stays: it is not the secret)."""
    if isinstance(value, dict):
        return {k: "[secret]" if SECRET_KEY.search(str(k)) else masked(v) for k, v in value.items()}
    if isinstance(value, list):
        return [masked(v) for v in value]
    return value


def _is_gateway(resource: Any) -> bool:
    # AWS tags are a mapping; a GCP instance's `tags` are its network tags (a list), and the
    # gateway only runs on AWS.
    tags = resource.inputs.get("tags")
    return isinstance(tags, dict) and tags.get("coral:role") == "gateway"


def render(
    stack: Annotated[str, typer.Option(help="Stack name (stacks/Pulumi.<stack>.yaml).")],
    out_dir: Annotated[Path, typer.Option("--out", help="Folder for the user-data files.")],
    previous: Annotated[Path | None, typer.Option(help="The running plan.json.")] = None,
    library: Annotated[
        Path | None,
        typer.Option(help="Template-library folder (default .coral/library/<stack>)."),
    ] = None,
    replace: Annotated[
        bool,
        typer.Option(help="Replace the contents of a non-empty --out folder (else refused)."),
    ] = False,
) -> None:
    """Write every node's rendered cloud-init user-data, one file per node.

    The folder is written whole: into a temporary folder beside it, then swapped in, so it never
    mixes files of two renders (another stack's, or removed nodes') and a failure leaves it as
    it was.
    """
    check_render_folder(out_dir, replace)
    result, _ = _run(stack, previous, library)
    files = {f"{r.name}.yaml": _user_data(r) for r in result.resources if r.type in NODE_TYPES}
    write_folder(out_dir, files)
    err.print(f"Wrote {len(files)} user-data files to {out_dir}")


def check_render_folder(out_dir: Path, replace: bool) -> None:
    """`--out` is a folder that may be written: absent, empty, or `replace` given.

    Raises:
        InputError: `--out` is a file, or a non-empty folder without `--replace`.
    """
    if out_dir.exists() and not out_dir.is_dir():
        raise InputError("--out", f"{out_dir} is a file, not a folder", "give a folder path")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not replace:
        count = sum(1 for _ in out_dir.iterdir())
        raise InputError(
            "--out",
            f"{out_dir} is not empty ({count} entries; perhaps another stack's render)",
            "pass --replace to replace its contents, or choose an empty folder",
        )


def write_folder(out_dir: Path, files: dict[str, str]) -> None:
    """Write `files` (name -> text) as the whole contents of `out_dir`, swapped in at once.

    Raises:
        InputError: the folder or its parent cannot be written.
    """
    staging: Path | None = None
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.new-"))
        for name, text in files.items():
            (staging / name).write_text(text, encoding="utf-8")
        staging.chmod(0o755)
        if out_dir.exists():
            old = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.old-"))
            out_dir.rename(old / "contents")
            try:
                staging.rename(out_dir)
            except OSError:
                (old / "contents").rename(out_dir)  # put the previous render back
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            staging.rename(out_dir)
    except OSError as exc:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        raise InputError(
            "--out", f"cannot write {out_dir} ({exc.strerror})", "choose a writable folder"
        ) from exc


def _user_data(resource: Any) -> str:
    """A node's rendered user-data: AWS `userData`, GCP `metadata.user-data`."""
    inputs = resource.inputs
    text = inputs.get("userData") or (inputs.get("metadata") or {}).get("user-data")
    if not isinstance(text, str):
        raise CoralError(f"node {resource.name} declares no user-data")
    return text


def register(app: typer.Typer) -> None:
    app.command("preview")(reports_errors(preview))
    app.command("render")(reports_errors(render))

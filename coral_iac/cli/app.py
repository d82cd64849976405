"""The `coral` command-line tool (Typer + Rich): one sub-app per pipeline stage, registered here.
Human output on stderr, `--json` on stdout."""

from __future__ import annotations

import typer

from coral_iac.cli.bench import register as register_bench_command
from coral_iac.cli.calibrate import register as register_calibrate_command
from coral_iac.cli.catalog import catalog_app
from coral_iac.cli.demand import demand_app
from coral_iac.cli.deploy import register as register_deploy_commands
from coral_iac.cli.plan import plan_app
from coral_iac.cli.profile import profile_app
from coral_iac.cli.simulate import register as register_simulate_command
from coral_iac.cli.templates import templates_app

app = typer.Typer(
    help="Coral IaC: serve many LLMs on the cheapest mix of cloud GPUs. docs/output.md explains "
    "every column of the tables coral prints.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
app.add_typer(catalog_app, name="catalog")
app.add_typer(profile_app, name="profile")
app.add_typer(templates_app, name="templates")
app.add_typer(plan_app, name="plan")
app.add_typer(demand_app, name="demand")
register_deploy_commands(app)
register_simulate_command(app)
register_calibrate_command(app)
register_bench_command(app)


def main() -> None:  # pragma: no cover - console entry point
    app()

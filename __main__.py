"""Coral IaC's Pulumi program: see coral_iac/program.py."""

from coral_iac.program import run

run()

"""Coral IaC: Pulumi program, bootstrap rendering and the coral CLI."""

"""Coral IaC solver core: catalog, performance model, serving templates, allocation (pure, no cloud SDKs)."""

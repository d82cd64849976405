"""Stage 1, the catalog: what can be rented and what is served. Takes the shipped data files
and a stack's regions, node configs and overrides; gives a `Catalog`, `ModelCard`s, a `Market`.

Data files: `solver/data/gpus.yaml`, `offers.yaml`, `models.yaml`, and the stack's own model
cards (`user_models`, from a model's `config.json`). A `Catalog` holds GPU types, node configs
and offers with $/hour and availability; a `ModelCard` layers, hidden size, heads and weight
bytes; the stack's `Market` price and availability per (region, node config) and GPU pools.
`skypilot_import` refreshes offers from SkyPilot's catalog files.
"""

"""Stage 1 input: what can be rented and what is served.

Takes the shipped data files (`solver/data/gpus.yaml`, `offers.yaml`, `models.yaml`) and a stack's
regions, node configs and overrides. Gives a `Catalog` (GPU types, node configs, offers with $/hour
and availability), `ModelCard`s (layers, hidden size, heads, weight bytes) and the stack's `Market`
(price and availability per (region, node config), GPU pools). `skypilot_import` refreshes
offers from SkyPilot's catalog files.
"""

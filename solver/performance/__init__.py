"""Stage 2: how fast one node runs j layers of a model.

Takes the catalog, the model cards, the calibration (`solver/data/calibration.yaml`, fitted by
`calibration` to measured timings) and optional measured tables. Gives a `PerfModel`: layer
times per phase (`analytical`: the roofline model; `measured_tables`: user-measured tables that
replace it), memory fit, and the profile table T̂_j(c) that the template search consumes.
`profiler/` measures tables on a GPU (optional torch extra; never imported by the rest).
"""

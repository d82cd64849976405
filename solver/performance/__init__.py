"""Stage 2, performance: how fast one node runs j layers of a model. Takes the catalog, model
cards, calibration and optional measured tables; gives a `PerfModel` and the profile table T̂.

The calibration is `solver/data/calibration.yaml`, fitted by `calibration` (Helix's per-layer
timings) and `vidur` / `kernel_fit` (Vidur's operator timings). A `PerfModel` gives layer times
per phase (`analytical`: the roofline model; `measured_tables`: user-measured tables that
replace it), memory fit, and the profile table T̂_j(c) that the template search consumes.
`profiler/` measures tables on a GPU (optional torch extra; never imported by the rest).
"""

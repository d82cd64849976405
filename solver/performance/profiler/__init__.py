"""GPU profiler behind `coral profile measure` (needs torch). Takes a model card, a grid of sizes
and the local GPU (or CPU); gives measured per-layer tables with a JSON sidecar each."""

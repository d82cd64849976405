"""GPU profiler: time one decoder layer of a model card and write measured tables (needs torch)."""

"""Evaluation beside the pipeline: replay request traces against a plan.

Takes a `Plan`, the stack and the `PerfModel`, and request traces (`traces`: generated in the
paper's shapes, or read from CSV). Gives per-model TTFT, TPOT, SLO attainment and goodput
(`simulator`), per-template sustained capacity, and epochs of re-planning (`epochs`).
"""

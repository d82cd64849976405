"""Simulation: replay request traces against a plan. Takes a `Plan`, the stack, the `PerfModel`
and traces; gives per-model TTFT, TPOT, SLO attainment and goodput, and per-template capacity.

Traces (`traces`, `workload`) are generated in the paper's shapes, the packaged Azure 2023
traces, or a CSV. The planner's closed loop and verification run `simulator` on every plan;
`coral simulate`, `coral bench` and the epochs of re-planning (`solver.plan.epochs`) run it on
any plan. `results` holds what a simulation gives back.
"""

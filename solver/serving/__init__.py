"""Stage 3, offline: the serving-template library (a *serving* template, not a Jinja2 file).
Takes a `PerfModel` and a stack's models and node configs; gives per-job libraries of placements.

In detail it takes the stack's N_max, rho and library mode, and gives, per (model, phase, SLO),
the throughput-optimal placement of every node multiset worth keeping: `enumeration` lists
multisets and places each one with `placement_search` (the exact combinatorial search),
`pruning` drops dominated ones, `library` builds (through `executors`), hashes, saves and loads
them. `instance_model` derives one instance's stage times, KV capacity and batch caps, for the
simulator and the deployed engine settings alike.
"""

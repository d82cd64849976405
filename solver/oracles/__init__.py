"""Test oracles, apart from the production path: exact formulations that are too slow to ship.

`placement_ilp` is the paper's placement ILP (checked against `templates.placement_search`);
`joint_model` the paper's joint problem as one integer program (checked against library +
allocation on small instances). Only tests and benchmarks import them.
"""

"""Test oracles, apart from the production path: exact formulations too slow to ship. Takes
small instances; gives the optimum that the template search and the allocation must reach.

`placement_ilp` is the paper's placement ILP (checked against `templates.placement_search`);
`joint_model` the paper's joint problem as one integer program (checked against library +
allocation on small instances). Only tests and benchmarks import them.
"""

"""Stage 4, online: the allocation ILP (paper Sec. 4.3). Takes demand per (model, phase), the
library's templates, the market and the running plan nu0; gives instances per template and region.

The answer (`Solution`) is the cheapest plan that meets demand, or under scarcity the
most-served one, with the constraints that bind. `problem` holds the data and columns,
`constraints` and `objective` the formulation (one function per constraint family, its formula
in the docstring), `model` the ILP on an OR-Tools backend, `reduction` the columns a solve can
do without (cost bounds, dominance under the stack's market), `decompose` the solve part by
part (each job or colocated model alone, then the union), `solve` the whole solve and its
two-step scarce solve, `explain` the binding constraints in words, and `baselines` and
`paper_baselines` the paper's Homo and Cauchy-like baselines on the same columns.
"""

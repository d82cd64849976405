"""Stage 4, online: the allocation ILP (paper Sec. 4.3).

Takes demand per (model, phase), the library's serving templates, the stack's market and the
running plan nu0. Gives how many instances of each template run in each region (`Solution`),
the cheapest that meets demand, or under scarcity the most-served one, with the constraints that
bind. `problem` holds the data and columns, `constraints` and `objective` the formulation (one
function per constraint family, its formula in the docstring), `solve` the solve and its
two-step scarce solve, `explain` the binding constraints in words, and `baselines` the paper's
Homo and Cauchy-like baselines on the same columns.
"""

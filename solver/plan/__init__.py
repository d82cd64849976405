"""Stage 5: the plan, the seam between the solver and the Pulumi program.

Takes a stack (`FleetConfig`), a `PerfModel` and a library folder. `planner` runs the stages
(demand, libraries, allocation) and gives a `Plan` (`schema`: instances with stable keys, their
serving templates, $/hour, served fraction, solver report). `validator` re-checks any plan
against the stack without trusting the solver.
"""

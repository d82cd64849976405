"""Stage 5: the plan, the seam between the solver and the Pulumi program. Takes a stack, a
`PerfModel` and a library folder; gives a validated `Plan` (`plan.json`) with its attainment.

`planner.plan_with_library` runs the stages: demand (`demand`), libraries, the SLO capacity
model (`solver.capacity`), the allocation, the closed loop through the simulator and the
verification (`attainment`), length buckets (`length_routing`). The plan file's types
(instances with stable keys, their serving templates, $/hour, served fractions, the solver
report) live in `solver.plan_schema`, below the stages that read them. `validator` re-checks any plan against the stack without trusting the solver; `epochs`
re-plans epoch by epoch under changing availability and simulates each epoch.
"""

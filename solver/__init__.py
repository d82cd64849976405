"""Coral IaC's pure core, one package per stage: catalog -> performance -> templates ->
allocation -> simulation -> plan -> operations. Takes a stack and data files; gives a plan.

No cloud SDKs, no network, no I/O at import time. The stages, in the order data flows
(docs/architecture.md draws them):

    catalog -> performance -> templates -> allocation -> simulation -> plan -> operations
                                              ^               |
                                              +- closed loop -+

- `catalog`: GPU types, node configs, cloud offers, model cards, the stack's market.
- `performance`: layer times and the profile table T̂ (analytical, measured, calibrated).
- `templates`: the offline serving-template library (placement search, enumeration, pruning).
- `allocation`: the online ILP that picks template instances per region, and the baselines.
- `simulation`: request traces and the event-driven simulator (the planner's closed loop and
  verification, and any plan's evaluation).
- `plan`: the planner that runs the stages for a stack, the plan schema, the plan validator.
- `operations`: demand sources' pure rules and the safe-reconfiguration state machine.
- `oracles`: exact but slow formulations that tests check the production path against.
- `evaluation`: our simulator and capacity model beside Vidur, the reference simulator.

Shared: `types` (vocabulary), `errors` (every stage's errors), `io` (file reading and atomic
writing), `stack` (the stack config schema, the input of every stage), `plan_schema` (the plan
file's types, which allocation, simulation, plan and operations read), `timing` (where a plan's
seconds go), `validation` (checks across fields and files).
"""

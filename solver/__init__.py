"""Coral IaC's pure core: no cloud SDKs, no I/O at import time. One package per stage, in the
order data flows:

    catalog -> performance -> templates -> allocation -> plan
                                                           |-> simulation (evaluate any plan)
                                                           |-> operations (demand, reconfiguration)

- `catalog`: GPU types, node configs, cloud offers, model cards, the stack's market.
- `performance`: layer times and the profile table T̂ (analytical, measured, calibrated).
- `templates`: the offline serving-template library (placement search, enumeration, pruning).
- `allocation`: the online ILP that picks template instances per region, and the baselines.
- `plan`: the plan schema, the planner that runs the stages for a stack, the plan validator.
- `simulation`: request traces and the event-driven simulator.
- `operations`: demand sources' pure rules and the safe-reconfiguration state machine.
- `oracles`: exact but slow formulations that tests check the production path against.

Shared: `types` (vocabulary), `errors` (every stage's errors), `io` (file reading), `stack`
(the stack config schema, the input of every stage).
"""

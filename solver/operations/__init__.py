"""Operations, pure parts (the I/O lives in `coral_iac`). Takes a stack's demand source and the
previous fleet state; gives demand per model and each instance's state for a new plan.

`demand_rules`: a stack's demand from its config, a demand file or measured token rates
(headroom, floors, units). `reconfiguration`: given the previous fleet state and a new plan,
which instances start, serve, retire or drain, so a fleet changes without losing capacity.
"""

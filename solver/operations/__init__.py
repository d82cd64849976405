"""Operations beside the pipeline, pure parts only (the I/O lives in `coral_iac`).

`demand_rules`: a stack's demand from its config, a demand file or measured token rates
(headroom, floors, units). `reconfiguration`: given the previous fleet state and a new plan,
which instances start, serve, retire or drain, so a fleet changes without losing capacity.
"""

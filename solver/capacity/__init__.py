"""The SLO capacity model: takes serving templates, their instance models, the SLO and the
planning workload's lengths and burstiness; gives each template's capacity at the attainment target.

`slo_capacity.capacity_factors` is what the allocation prices (T̂ x factor) and what the closed
loop in `solver.plan.attainment` corrects; it reads an instance only through its stage times
(`solver.serving.engine_model`).
"""

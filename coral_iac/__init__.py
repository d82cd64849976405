"""Coral IaC's deployment side: the Pulumi program, node and gateway bootstrap, the `coral` CLI.
Takes a stack and the solver's plan; gives the declared cloud fleet and its outputs.

`program` plans the stack and declares the fleet (through `components`: one replica's nodes;
`infra`: per-region networks and identities; `gateway`: one address per model, whose HAProxy
configuration and cloud-init `gateway_config` renders without Pulumi), `bootstrap` renders each
node's cloud-init user-data from the Jinja2 files in `templates/` with the vLLM flags and argv
of `engine_args`,
`deploy_settings` holds the stack's `deploy` section, `demand_sources` reads demand with I/O
(Prometheus, demand files), and `preview` runs the program offline under Pulumi's mocks.
`cli/` is the `coral` tool. Dependencies point one way: coral_iac imports solver, never back.
"""

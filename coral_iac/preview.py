"""Run the Pulumi program in-process with Pulumi's own mocks: no CLI, no credentials.

`preview_stack` loads `stacks/Pulumi.<stack>.yaml` into the runtime config, installs
`CoralMocks` and runs `coral_iac.program.run` under `pulumi.runtime.test`. The real SDK and
provider types register every resource. The mocks answer with deterministic fake IDs and IPs, so
two runs with the same inputs record identical resources. Used by `coral preview`,
`coral render` and the tests.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pulumi

from coral_iac import program
from coral_iac.program import ProgramOptions
from solver.errors import unknown_value
from solver.plan_schema import Plan

PROJECT = "coral"  # Pulumi.yaml's name: the config namespace


@dataclass
class Recorded:
    """One resource the program declared."""

    type: str
    name: str
    inputs: dict[str, Any]
    provider: str | None


@dataclass
class CoralMocks(pulumi.runtime.Mocks):
    """Deterministic answers for every resource and invoke the program uses."""

    previous_outputs: dict[str, Any] = field(default_factory=dict)
    resources: list[Recorded] = field(default_factory=list)
    # (instance type, zone) pairs EC2 does not offer; every other pair is offered in zones a-c
    not_offered: set[tuple[str, str]] = field(default_factory=set)
    # the gateway's health report (its SSM parameter's value); None: never published
    health_report: str | None = None

    def new_resource(self, args: pulumi.runtime.MockResourceArgs) -> tuple[str, dict[str, Any]]:
        self.resources.append(Recorded(args.typ, args.name, dict(args.inputs), args.provider))
        state = dict(args.inputs)
        if args.typ == "pulumi:pulumi:StackReference":
            state["outputs"] = self.previous_outputs
        elif args.typ == "aws:ec2/instance:Instance":
            state["privateIp"] = _ip("10.0", args.name)
            state["publicIp"] = _ip("198.51", args.name)  # TEST-NET-2: never a real host
        elif args.typ == "aws:ec2/eip:Eip":
            state["publicIp"] = _ip("198.51", args.name)
        elif args.typ == "gcp:compute/instance:Instance":
            nics = [dict(n) for n in state.get("networkInterfaces", [])] or [{}]
            nics[0]["networkIp"] = _ip("10.100", args.name)
            nics[0]["accessConfigs"] = [{"natIp": _ip("203.0", args.name)}]  # TEST-NET-3
            state["networkInterfaces"] = nics
        elif args.typ == "gcp:serviceaccount/account:Account":
            state["email"] = f"{state.get('accountId', 'sa')}@project.iam.gserviceaccount.com"
        return f"{args.name}-id", state

    def call(self, args: pulumi.runtime.MockCallArgs) -> tuple[dict[str, Any], list[Any]]:
        region = _provider_region(args.provider)
        if args.token == "aws:index/getAvailabilityZones:getAvailabilityZones":
            names = [f"{region}{z}" for z in "abc"]
            # AZ IDs in the same order; a letter names another physical zone in each account,
            # so here a -> az2, b -> az3, c -> az1
            ids = [f"{_zone_id_prefix(region)}-az{n}" for n in (2, 3, 1)]
            return {"names": names, "zoneIds": ids, "state": "available", "id": region}, []
        if args.token == "aws:ec2/getInstanceTypeOfferings:getInstanceTypeOfferings":
            (types,) = [f["values"] for f in args.args.get("filters", [])]
            pairs = [
                (t, f"{region}{z}")
                for t in types
                for z in "abc"
                if (t, f"{region}{z}") not in self.not_offered
            ]
            return {
                "instanceTypes": [t for t, _ in pairs],
                "locations": [z for _, z in pairs],
                "locationTypes": ["availability-zone"] * len(pairs),
                "id": region,
            }, []
        if args.token == "aws:ssm/getParameter:getParameter":
            if str(args.args.get("name", "")).endswith("/gateway/health"):
                if self.health_report is None:  # an invoke failure, as SSM's ParameterNotFound
                    return {}, [("name", "ParameterNotFound")]
                return {"name": args.args["name"], "type": "String", "value": self.health_report}, []
            return {
                "name": args.args.get("name"),
                "type": "String",
                "value": "ami-0mock0dlami0gpu",
            }, []
        return {}, []


def _provider_region(provider: str | None) -> str:
    """The region of an `aws-<region>` provider's URN ("us-east-2" when there is none)."""
    name = (provider or "").split("::")[-2] if provider and "::" in provider else ""
    return name.removeprefix("aws-") if name.startswith("aws-") else "us-east-2"


def _zone_id_prefix(region: str) -> str:
    """The prefix of an AWS region's AZ IDs: us-east-2 -> use2, ap-northeast-2 -> apne2."""
    area, *words, number = region.split("-")
    short = {"north": "n", "south": "s", "east": "e", "west": "w", "central": "c"}
    for long, letter in short.items():
        words = [w.replace(long, letter) for w in words]
    return area + "".join(words) + number


def _ip(prefix: str, name: str) -> str:
    digest = hashlib.sha256(name.encode()).digest()
    return f"{prefix}.{digest[0]}.{1 + digest[1] % 254}"


def stack_config(stacks_dir: Path, stack: str) -> dict[str, str]:
    """The stack file's config as the runtime holds it: structured values JSON-encoded."""
    # Deferred to when the command runs: the solver modules behind it (numpy,
    # pydantic, OR-Tools) would slow the start of every coral command.
    from solver.stack import read_stack_config

    path = stacks_dir / f"Pulumi.{stack}.yaml"
    if not path.exists():
        known = sorted(p.name[7:-5] for p in stacks_dir.glob("Pulumi.*.yaml"))
        raise unknown_value("--stack", stack, known, "stack")
    # An empty file, or one that is not a mapping, is an InputError, as are duplicate keys.
    config = read_stack_config(path)
    return {k: v if isinstance(v, str) else json.dumps(v) for k, v in config.items()}


@dataclass
class PreviewResult:
    resources: list[Recorded]
    outputs: dict[str, Any]

    @property
    def plan(self) -> Plan:
        return Plan.model_validate_json(self.outputs["plan"])

    def of_type(self, typ: str) -> list[Recorded]:
        return [r for r in self.resources if r.type == typ]


def preview_stack(
    stack: str,
    options: ProgramOptions,
    previous: Plan | None = None,
    previous_outputs: dict[str, Any] | None = None,
    not_offered: set[tuple[str, str]] | None = None,
    health_report: str | None = None,
) -> PreviewResult:
    """Run the program for `stack` under mocks, with `options` (stacks and library folders,
    whether a stale library is rebuilt as `coral plan` does, the clock). The stack's last
    outputs are `previous_outputs` (e.g. an earlier run's `PreviewResult.outputs`), or just the
    plan `previous`. `not_offered`: (instance type, zone) pairs EC2's offerings leave out.
    `health_report`: what the gateway last published (None: nothing)."""
    config = stack_config(options.stacks_dir, stack)
    if previous_outputs is None:
        previous_outputs = {"plan": previous.model_dump_json()} if previous is not None else {}
    mocks = CoralMocks(
        previous_outputs, not_offered=set(not_offered or ()), health_report=health_report
    )
    # A fresh root stack: set_mocks keeps an existing one, whose exports would leak into this run.
    pulumi.runtime.reset_options(project=PROJECT, stack=stack, preview=False)
    pulumi.runtime.set_all_config(
        {k if ":" in k else f"{PROJECT}:{k}": v for k, v in config.items()}
    )
    pulumi.runtime.set_mocks(mocks, project=PROJECT, stack=stack, preview=False)
    exported: dict[str, Any] = {}

    def body() -> pulumi.Output[Any]:
        outputs = program.run(options)
        return pulumi.Output.from_input(outputs).apply(exported.update)

    pulumi.runtime.test(body)()  # type: ignore[no-untyped-call]
    return PreviewResult(mocks.resources, exported)

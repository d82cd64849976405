"""Resource identities across the change that made `Infra` a component (`coral:infra:Infra`).

A stack deployed before holds the networks, identities, groups and providers `Infra` declares at
its root. Under the component their URNs change, which alone would make `pulumi up` delete and
recreate them (and, through the providers, every node). Each child therefore carries its root
URN as an alias. `MockResourceArgs` shows no aliases, so a recording monitor reads them from the
registration requests the SDK sends, as the engine would get them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pulumi
import pytest
from pulumi.runtime.mocks import MockMonitor

from coral_iac.preview import PROJECT
from tests.conftest import REPO

INFRA = "coral:infra:Infra"


@dataclass(frozen=True)
class Registered:
    urn: str
    parent: str
    type: str
    name: str
    aliases: list[Any]  # alias_pb2.Alias.Spec: what the SDK sends for each alias


class RecordingMonitor(MockMonitor):
    """Pulumi's mock monitor, keeping every RegisterResource request's URN, parent and aliases."""

    def __init__(self, mocks: pulumi.runtime.Mocks, into: list[Registered]) -> None:
        super().__init__(mocks)
        self.into = into

    def RegisterResource(self, request: Any) -> Any:  # noqa: N802 - the gRPC method's name
        response = super().RegisterResource(request)
        if request.type != "pulumi:pulumi:Stack":
            specs = [a.spec for a in request.aliases if a.HasField("spec")]
            self.into.append(
                Registered(response.urn, request.parent, request.type, request.name, specs)
            )
        return response


@pytest.fixture
def registered(monkeypatch, preview) -> Callable[[str], list[Registered]]:
    """Runs `preview` for a committed stack; returns what it registered, with aliases."""

    def run(stack: str) -> list[Registered]:
        out: list[Registered] = []
        set_mocks = pulumi.runtime.set_mocks

        def recording(mocks: pulumi.runtime.Mocks, **kwargs: Any) -> None:
            set_mocks(mocks, monitor=RecordingMonitor(mocks, out), **kwargs)

        monkeypatch.setattr(pulumi.runtime, "set_mocks", recording)
        preview(stack, REPO / "stacks")
        return out

    return run


def root_aliases(r: Registered) -> list[Any]:
    """The aliases that name the same type and name at the stack's root (no parent)."""
    return [
        a
        for a in r.aliases
        if a.noParent and not (a.name or a.type or a.stack or a.project or a.parentUrn)
    ]


def previous_urn(stack: str, r: Registered) -> str:
    """The URN the engine matches in a stack deployed before `Infra` was a component: the root
    URN an alias names, else the resource's own (the mocks qualify root resources' types with
    the stack's, which the engine does not)."""
    if root_aliases(r):
        return f"urn:pulumi:{stack}::{PROJECT}::{r.type}::{r.name}"
    return r.urn.replace("pulumi:pulumi:Stack$", "")


@pytest.mark.parametrize(
    ("stack", "kinds"),
    [
        (
            "dev",  # AWS, with the gateway
            {
                "pulumi:providers:aws",
                "aws:ec2/vpc:Vpc",
                "aws:ec2/internetGateway:InternetGateway",
                "aws:ec2/subnet:Subnet",
                "aws:ec2/routeTable:RouteTable",
                "aws:ec2/routeTableAssociation:RouteTableAssociation",
                "aws:ec2/securityGroup:SecurityGroup",
                "aws:iam/role:Role",
                "aws:iam/rolePolicy:RolePolicy",
                "aws:iam/instanceProfile:InstanceProfile",
            },
        ),
        (
            "dev-gcp",
            {
                "pulumi:providers:gcp",
                "gcp:compute/network:Network",
                "gcp:compute/subnetwork:Subnetwork",
                "gcp:compute/firewall:Firewall",
                "gcp:serviceaccount/account:Account",
                "gcp:secretmanager/secretIamMember:SecretIamMember",
            },
        ),
    ],
)
def test_every_infra_child_keeps_its_root_urn_as_an_alias(stack, kinds, registered):
    resources = registered(stack)
    (infra,) = [r for r in resources if r.type == INFRA]
    assert infra.name == "infra"
    children = [r for r in resources if r.parent == infra.urn]
    assert {r.type for r in children} == kinds  # every kind Infra declares in this stack
    for r in children:
        assert f"{INFRA}$" in r.urn, r.urn  # the new URN: under the component
        assert len(root_aliases(r)) == 1, f"{r.urn}: no alias to its root URN"
    # Nothing else moved: ServingInstance and Gateway children keep their URNs, with no alias.
    others = [r for r in resources if r.type != INFRA and r.parent != infra.urn]
    assert others and not any(root_aliases(r) for r in others)
    before = {previous_urn(stack, r) for r in resources if r.type != INFRA}
    assert len(before) == len(resources) - 1  # one distinct previous URN per resource
    assert not any(INFRA in urn for urn in before)


def test_the_aliases_name_the_urns_a_deployed_stack_holds(registered):
    """Spelled out for the dev stack: what `pulumi stack --show-urns` listed before."""
    resources = registered("dev")
    before = {previous_urn("dev", r) for r in resources if r.type != INFRA}
    root = "urn:pulumi:dev::coral::"
    assert {
        root + "pulumi:providers:aws::aws-us-east-2",
        root + "aws:ec2/vpc:Vpc::vpc-us-east-2",
        root + "aws:ec2/subnet:Subnet::subnet-us-east-2",
        root + "aws:ec2/subnet:Subnet::subnet-us-east-2a",
        root + "aws:ec2/routeTableAssociation:RouteTableAssociation::routes-us-east-2a",
        root + "aws:iam/role:Role::node-role",
        root + "aws:iam/instanceProfile:InstanceProfile::node-profile",
        root + "aws:ec2/securityGroup:SecurityGroup::sg-phi-4-us-east-2",
        root + "coral:fleet:Gateway::gateway",
        root + "coral:fleet:Gateway$aws:ec2/instance:Instance::gateway",
    } <= before
    nodes = [r for r in resources if r.type == "aws:ec2/instance:Instance" and r.name != "gateway"]
    assert nodes and all("coral:fleet:ServingInstance$aws:ec2/instance" in r.urn for r in nodes)

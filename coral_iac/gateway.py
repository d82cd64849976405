"""The gateway: one HAProxy VM that gives every model one stable address (docs/gateway.md).

`Gateway` is a component: the VM with its security group, IAM role, Elastic IP, the SSM
parameter it polls (`publish`) and the one it writes its health report to. What it runs and
loads (HAProxy's configuration, the VM's cloud-init, the health report) is rendered without
Pulumi in `coral_iac/gateway_config.py`. `published_health` reads the health report at the
start of a run.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pulumi
import pulumi_aws as aws

from coral_iac.deploy_settings import GatewaySettings
from coral_iac.gateway_config import (
    HealthReport,
    gateway_limits,
    gateway_upstreams,
    health_parameter_name,
    parameter_name,
    parameter_value,
    render_gateway_user_data,
    render_haproxy_config,
)
from coral_iac.infra import EC2_ASSUME_ROLE, SECRET_SUFFIX, GatewayPeer, Region
from solver.plan_schema import Plan
from solver.stack import ModelSpec
from solver.types import base_model


@dataclass(frozen=True)
class GatewayArgs:
    """Typed inputs of the gateway."""

    stack: str
    settings: GatewaySettings
    region: Region  # where it runs: the region's provider, VPC and subnet (`Infra.region`)
    image: pulumi.Input[str]  # its AMI (`Infra.aws_image`, recorded under "gateway:<region>")
    api_port: int
    api_cidrs: list[str]
    api_key_secret: str | None = None  # deploy.api_key_secret: the key clients must send


class Gateway(pulumi.ComponentResource):
    """The HAProxy VM; `public_ip` is its Elastic IP, `publish` declares its configuration and
    registers the component's outputs (its last child). `peer` is what the groups of the
    endpoints it reaches admit (`Infra.gateway`)."""

    public_ip: pulumi.Output[str]
    url: pulumi.Output[str]
    peer: GatewayPeer

    def __init__(
        self, name: str, args: GatewayArgs, opts: pulumi.ResourceOptions | None = None
    ) -> None:
        # Its type and name are those of the first gateway (its children's URNs depend on them).
        super().__init__("coral:fleet:Gateway", name, None, opts)
        self.name, self.args = name, args
        region = args.region
        self._child = pulumi.ResourceOptions(parent=self, provider=region.provider)
        tags = {"coral:stack": args.stack, "coral:role": "gateway"}
        ingress: list[Any] = [
            {
                "protocol": "tcp",
                "from_port": args.api_port,
                "to_port": args.api_port,
                "cidr_blocks": list(args.api_cidrs),
                "description": "OpenAI-compatible API, one path per model",
            }
        ]
        group = aws.ec2.SecurityGroup(
            f"{name}-sg",
            description=f"Coral {args.stack}: gateway",
            vpc_id=region.network,
            ingress=ingress if args.api_cidrs else [],
            egress=[
                {
                    "protocol": "-1",
                    "from_port": 0,
                    "to_port": 0,
                    "cidr_blocks": ["0.0.0.0/0"],
                    "description": "replicas, SSM, packages",
                }
            ],
            tags=tags,
            opts=self._child,
        )
        vm = aws.ec2.Instance(
            name,
            ami=args.image,
            instance_type=args.settings.instance_type,
            subnet_id=region.subnet_id,
            vpc_security_group_ids=[group.id],
            iam_instance_profile=self._identity(name, args),
            # The user-data holds no plan (module doc): only a settings change replaces it.
            user_data=render_gateway_user_data(
                args.stack,
                region.region,
                args.api_port,
                args.api_key_secret,
                args.settings.tls_secret,
            ),
            user_data_replace_on_change=True,
            metadata_options={
                "http_tokens": "required",
                "http_endpoint": "enabled",
                "http_put_response_hop_limit": 1,
            },
            root_block_device={
                "volume_size": args.settings.disk_gb,
                "volume_type": "gp3",
                "encrypted": True,
            },
            tags=tags | {"Name": f"coral-{args.stack}-gateway"},
            opts=self._child,
        )
        # A fixed address: the per-model URLs and remote replicas' firewalls outlive the VM.
        eip = aws.ec2.Eip(f"{name}-ip", domain="vpc", instance=vm.id, tags=tags, opts=self._child)
        # The health report the VM overwrites (coral-gateway-health). Declared so that a
        # destroy removes it; its value is the VM's, never reset by a run.
        aws.ssm.Parameter(
            f"{name}-health",
            name=health_parameter_name(args.stack),
            type="String",
            tier="Intelligent-Tiering",
            description="Coral gateway: replicas passing HAProxy's /health checks (JSON)",
            insecure_value=HealthReport(up=[]).model_dump_json(),
            tags=tags,
            opts=pulumi.ResourceOptions.merge(
                self._child, pulumi.ResourceOptions(ignore_changes=["insecureValue", "value"])
            ),
        )
        self.public_ip = eip.public_ip
        scheme = "https" if args.settings.tls_secret else "http"
        self.url = eip.public_ip.apply(lambda ip: f"{scheme}://{ip}:{args.api_port}")
        self.peer = GatewayPeer(args.settings.cloud, region.region, group.id, eip.public_ip)

    def _identity(self, name: str, args: GatewayArgs) -> pulumi.Output[str]:
        """A role that may read this stack's gateway parameter (and its API key and TLS
        certificate) and write its health report, and nothing else."""
        role = aws.iam.Role(
            f"{name}-role",
            assume_role_policy=EC2_ASSUME_ROLE,
            tags={"coral:stack": args.stack},
            opts=self._child,
        )
        where = args.region.region
        arn = f"arn:aws:ssm:{where}:*:parameter{parameter_name(args.stack)}"
        health = f"arn:aws:ssm:{where}:*:parameter{health_parameter_name(args.stack)}"
        statements: list[dict[str, Any]] = [
            {"Effect": "Allow", "Action": "ssm:GetParameter", "Resource": arn},
            {"Effect": "Allow", "Action": "ssm:PutParameter", "Resource": health},
        ]
        secrets = [  # the API key it checks, the certificate it serves
            f"arn:aws:secretsmanager:{where}:*:secret:{name}{SECRET_SUFFIX}"
            for name in (args.api_key_secret, args.settings.tls_secret)
            if name
        ]
        if secrets:
            statements.append(
                {
                    "Effect": "Allow",
                    "Action": "secretsmanager:GetSecretValue",
                    "Resource": secrets[0] if len(secrets) == 1 else secrets,
                }
            )
        aws.iam.RolePolicy(
            f"{name}-read-config",
            role=role.id,
            policy=json.dumps({"Version": "2012-10-17", "Statement": statements}),
            opts=self._child,
        )
        return aws.iam.InstanceProfile(f"{name}-profile", role=role.name, opts=self._child).name

    def same_network(self, cloud: str, region: str) -> bool:
        """Replicas in the gateway's own VPC are reached on private addresses."""
        return (cloud, region) == (self.args.settings.cloud, self.args.region.region)

    def publish(
        self,
        plan: Plan,
        addresses: Mapping[str, pulumi.Output[str]],
        states: Mapping[str, str] | None = None,
        models: Mapping[str, ModelSpec] | None = None,
        room: float = 1.0,
    ) -> dict[str, pulumi.Output[str]]:
        """Declare the configuration parameter (updated in place); returns the URL per model.
        `models` (the serving fleet's specs, length buckets included): each backend admits what
        the plan gives it (`gateway_limits`, with `room`: 1 / `allocation.target_utilization`);
        None admits every request."""
        settings, port = self.args.settings, self.args.api_port
        limits = gateway_limits(plan, models, states, room=room) if models is not None else None

        def pack(resolved: Mapping[str, str]) -> str:
            upstreams = gateway_upstreams(plan, resolved, states)
            config = render_haproxy_config(
                upstreams,
                self.args.stack,
                port,
                settings.health_check_interval_ms,
                api_key=self.args.api_key_secret is not None,
                buckets=plan.buckets(),
                tls=settings.tls_secret is not None,
                limits=limits,
            )
            return parameter_value(config)

        # Fail the preview, not the update, on a plan too large for one parameter.
        pack({k: f"255.255.255.255:{port}" for k in addresses})
        keys = sorted(addresses)

        def pack_resolved(resolved: list[str]) -> str:
            return pack(dict(zip(keys, resolved, strict=True)))

        value = pulumi.Output.all(*(addresses[k] for k in keys)).apply(pack_resolved)
        aws.ssm.Parameter(
            f"{self.name}-config",
            name=parameter_name(self.args.stack),
            type="String",
            tier="Intelligent-Tiering",
            description="Coral gateway HAProxy configuration (gzip + base64); no secret",
            insecure_value=value,
            tags={"coral:stack": self.args.stack, "coral:role": "gateway"},
            opts=self._child,
        )
        names = sorted(
            {base_model(i.model) for i in plan.instances if i.phase in ("aggregated", "decode")}
        )
        self.register_outputs({"public_ip": self.public_ip, "url": self.url})
        return {m: pulumi.Output.concat(self.url, f"/{m}/v1") for m in names}


def published_health(stack: str, provider: pulumi.ProviderResource) -> str | None:
    """The gateway's last health report (JSON), or None when there is none to read: a first
    deploy, or a gateway that never published. Read at the start of a run, before anything is
    declared, with the gateway region's provider."""
    try:
        found = aws.ssm.get_parameter(
            name=health_parameter_name(stack), opts=pulumi.InvokeOptions(provider=provider)
        )
    except Exception:  # noqa: BLE001 - the SDK raises a bare Exception for a failed invoke
        return None
    return found.value

"""`ServingInstance`: one template instance in one region, i.e. one replica's nodes.

Every node is an `aws.ec2.Instance` or `gcp.compute.Instance` through its region's explicit
provider. Each boots from user-data rendered by `coral_iac/bootstrap.py`. The head node (node
rank 0) is declared first, and its private IP flows into the other nodes' user-data as an
Output. Logical names come from the stable replica key, so an unchanged replica never changes.

A spot replica's nodes are spot capacity (`SPOT_MARKET` on AWS, `SPOT_SCHEDULING` on GCP), in
its plan's zone, tagged `coral:market: spot`; their user-data adds the interruption handler.
An on-demand replica's nodes are declared without any of it, exactly as before spot existed.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import cast

import pulumi
import pulumi_aws as aws
import pulumi_gcp as gcp

from coral_iac.bootstrap import render_user_data, slug
from coral_iac.engine_args import NodeBoot, Ports, RouterSpec
from coral_iac.infra import Identity, Region
from solver.catalog.offers import Offer

# AWS spot: a one-time request whose instance terminates when EC2 takes it back, so Pulumi
# declares it again (a new request) instead of a stopped node waiting for capacity.
SPOT_MARKET = aws.ec2.InstanceInstanceMarketOptionsArgs(
    market_type="spot",
    spot_options=aws.ec2.InstanceInstanceMarketOptionsSpotOptionsArgs(
        instance_interruption_behavior="terminate", spot_instance_type="one-time"
    ),
)
# GCP Spot VM, deleted when preempted (as AWS's terminate). GCE requires TERMINATE on host
# maintenance and no automatic restart for it.
SPOT_SCHEDULING = gcp.compute.InstanceSchedulingArgs(
    provisioning_model="SPOT",
    preemptible=True,
    automatic_restart=False,
    on_host_maintenance="TERMINATE",
    instance_termination_action="DELETE",
)


@dataclass(frozen=True)
class ServingInstanceArgs:
    """Typed inputs of one serving instance."""

    stack: str
    replica_key: str
    model: str
    phase: str
    template: str
    offers: list[Offer]  # per node, the offer that realises its node config in this region
    boots: list[NodeBoot]  # per node that runs vLLM processes (same order as offers)
    region: Region
    identity: Identity
    group: pulumi.Input[str]  # AWS security group id, or GCP network tag
    disk_gb: int  # each node's root disk: model files, venv, headroom (`card_disk_gb`)
    router_prefill_ips: list[pulumi.Output[str]] | None = None  # decode: its router's prefills
    subnet_id: pulumi.Input[str] | None = None  # AWS: the zone's subnet (`Infra.aws_node_subnet`)
    gcp_zones: list[str] | None = None  # GCP: each node's zone, as offers (`gcp_node_zones`)
    image: str | None = None  # the boot image this replica keeps (None: its region's)
    spot: bool = False  # spot capacity (`Instance.market`): `SPOT_MARKET` / `SPOT_SCHEDULING`


class ServingInstance(pulumi.ComponentResource):
    """The nodes of one replica; `head_private_ip` and `head_public_ip` locate its API."""

    head_private_ip: pulumi.Output[str]
    head_public_ip: pulumi.Output[str]

    def __init__(
        self, name: str, args: ServingInstanceArgs, opts: pulumi.ResourceOptions | None = None
    ) -> None:
        super().__init__("coral:fleet:ServingInstance", name, None, opts)
        child = pulumi.ResourceOptions(parent=self, provider=args.region.provider)
        disk_gb = args.disk_gb
        order = sorted(range(len(args.boots)), key=lambda k: not args.boots[k].is_head)
        head_ip: pulumi.Output[str] | None = None
        for k in order:  # head first: the others need its private IP
            boot, offer = args.boots[k], args.offers[k]
            user_data = _user_data(boot, head_ip, args.router_prefill_ips)
            tags = _tags(args, boot)
            node_name = f"{name}.n{boot.node_index}"
            if args.region.cloud == "aws":
                node = _aws_node(node_name, args, offer, user_data, tags, disk_gb, child)
                private_ip, public_ip = node.private_ip, node.public_ip
            else:
                zone = args.gcp_zones[k] if args.gcp_zones else args.region.zone
                gcp_node = _gcp_node(node_name, args, offer, zone, user_data, tags, disk_gb, child)
                private_ip, public_ip = _gcp_ips(gcp_node)
            if boot.is_head:
                head_ip = private_ip
                self.head_private_ip = private_ip
                self.head_public_ip = public_ip
        self.register_outputs(
            {"head_private_ip": self.head_private_ip, "head_public_ip": self.head_public_ip}
        )


def _user_data(
    boot: NodeBoot,
    head_ip: pulumi.Output[str] | None,
    router_prefill_ips: list[pulumi.Output[str]] | None,
) -> pulumi.Output[str]:
    """One node's cloud-init user-data: a decode head gets its router's prefill heads, a
    non-head node its head's private IP (declared before it)."""
    if boot.is_head and router_prefill_ips:
        return pulumi.Output.all(*router_prefill_ips).apply(
            lambda ips: render_user_data(
                boot.model_copy(update={"router": router_spec(ips, boot.ports)}), ""
            )
        )
    if boot.is_head:
        return pulumi.Output.from_input(render_user_data(boot, ""))
    assert head_ip is not None  # ServingInstance declares the head node first
    return head_ip.apply(lambda ip: render_user_data(boot, ip))


def _tags(args: ServingInstanceArgs, boot: NodeBoot) -> dict[str, str]:
    """The node's `coral:*` tags (AWS tags; GCP labels after `gcp_label`); `coral:market` on
    spot nodes only, so on-demand nodes keep the tags they were declared with."""
    market = {"coral:market": "spot"} if args.spot else {}
    return {
        "coral:stack": args.stack,
        "coral:model": args.model,
        "coral:phase": args.phase,
        "coral:template": args.template,
        "coral:replica": args.replica_key,
        "coral:node": str(boot.node_index),
        "coral:stages": ",".join(str(p.rank) for p in boot.processes),
    } | market


def _aws_node(
    name: str,
    args: ServingInstanceArgs,
    offer: Offer,
    user_data: pulumi.Output[str],
    tags: dict[str, str],
    disk_gb: int,
    opts: pulumi.ResourceOptions,
) -> aws.ec2.Instance:
    """One EC2 node: IMDSv2 only, an encrypted gp3 root volume sized for the weights; spot
    capacity for a spot replica."""
    return aws.ec2.Instance(
        name,
        ami=args.image or args.region.image,
        instance_type=offer.instance_type,
        subnet_id=args.subnet_id or args.region.subnet_id,
        vpc_security_group_ids=[args.group],
        iam_instance_profile=args.identity.aws_instance_profile,
        user_data=user_data,
        user_data_replace_on_change=True,
        instance_market_options=SPOT_MARKET if args.spot else None,
        metadata_options={
            "http_tokens": "required",
            "http_endpoint": "enabled",
            "http_put_response_hop_limit": 1,
        },
        root_block_device={"volume_size": disk_gb, "volume_type": "gp3", "encrypted": True},
        tags=tags | {"Name": f"coral-{args.stack}-{slug(args.replica_key)}-{tags['coral:node']}"},
        opts=opts,
    )


def _gcp_node(
    name: str,
    args: ServingInstanceArgs,
    offer: Offer,
    zone: str,
    user_data: pulumi.Output[str],
    tags: dict[str, str],
    disk_gb: int,
    opts: pulumi.ResourceOptions,
) -> gcp.compute.Instance:
    """One Compute Engine node; an N1 offer such as "n1-standard-4+1xT4" attaches its GPUs; a
    Spot VM for a spot replica."""
    machine, _, accelerator = offer.instance_type.partition("+")
    guest: list[gcp.compute.InstanceGuestAcceleratorArgs] = []
    if accelerator:  # N1 + attached GPUs, e.g. "n1-standard-4+1xT4"
        count, _, gpu = accelerator.partition("x")
        guest = [
            gcp.compute.InstanceGuestAcceleratorArgs(
                type=f"nvidia-tesla-{gpu.lower()}", count=int(count)
            )
        ]
    digest = hashlib.sha256(args.replica_key.encode()).hexdigest()[:10]
    labels = {k.replace("coral:", "coral-"): gcp_label(v) for k, v in tags.items()}
    return gcp.compute.Instance(
        name,
        name=f"coral-{args.stack}-{digest}-n{tags['coral:node']}"[:63],
        machine_type=machine,
        zone=zone,
        boot_disk=gcp.compute.InstanceBootDiskArgs(
            initialize_params=gcp.compute.InstanceBootDiskInitializeParamsArgs(
                image=args.image or args.region.image, size=disk_gb, type="pd-balanced"
            )
        ),
        network_interfaces=[
            gcp.compute.InstanceNetworkInterfaceArgs(
                subnetwork=args.region.subnet_id,
                access_configs=[gcp.compute.InstanceNetworkInterfaceAccessConfigArgs()],
            )
        ],
        scheduling=SPOT_SCHEDULING
        if args.spot
        else gcp.compute.InstanceSchedulingArgs(
            on_host_maintenance="TERMINATE", automatic_restart=True
        ),
        guest_accelerators=guest,
        metadata={"user-data": user_data, "install-nvidia-driver": "True"},
        service_account=gcp.compute.InstanceServiceAccountArgs(
            email=args.identity.gcp_service_account, scopes=["cloud-platform"]
        ),
        tags=[args.group],
        labels=labels,
        opts=opts,
    )


def _gcp_ips(node: gcp.compute.Instance) -> tuple[pulumi.Output[str], pulumi.Output[str]]:
    """A GCP node's private IP and public (NAT) IP, "" without one. The SDK types both as
    optional (its output types double as inputs); GCP sets them on every created interface."""
    private_ip = node.network_interfaces.apply(lambda nis: cast(str, nis[0].network_ip))
    public_ip = node.network_interfaces.apply(
        lambda nis: cast(str, nis[0].access_configs[0].nat_ip) if nis[0].access_configs else ""
    )
    return private_ip, public_ip


def router_spec(prefill_ips: list[str], ports: Ports) -> RouterSpec:
    """The decode node's router: every prefill head of the model in its region, and itself
    (ports from the same `allocate_ports(deploy.api_port)` on every node)."""
    return RouterSpec(
        prefill_urls=[f"http://{ip}:{ports.prefill_http}" for ip in prefill_ips],
        decode_urls=[f"http://127.0.0.1:{ports.decode_http}"],
    )


def gcp_label(value: str) -> str:
    """GCP label values: lowercase letters, digits, - and _, at most 63 characters."""
    out = "".join(c if c.isalnum() or c in "-_" else "_" for c in value.lower())
    return out[:63]

"""Per-region (and per-stack) infrastructure the serving instances share.

- AWS, per region: an explicit provider, the Deep Learning AMI id from its public SSM
  parameter, and a VPC with one public subnet (nodes download weights; inbound traffic is
  limited by security groups), plus one per zone the GPU nodes use: by zone name for
  on-demand replicas, by AZ ID for spot ones (`ZONE_LETTER_SLOTS`). Per stack: an IAM role and
  instance profile that may read only the Hugging Face token secret.
- GCP, per region: an explicit provider and a subnetwork of the stack's network (regional), and
  per node a zone that sells its machine type (`gcp_node_zones`, from the catalog's `zones`),
  or for a spot replica the plan's zone (`spot_zone`).
  Per stack: the network, and a service account with secretAccessor on the token secret only.
- Per (model, region), a security group or firewall rules. Nodes of one model in one region
  reach each other on every port: vLLM's NCCL, ZMQ and NIXL ports are dynamic, and a prefill
  instance must reach its decode router. The API port is open only to `deploy.api_cidrs`, and
  only where an endpoint runs (with `deploy.api_key_secret`, an endpoint that checks no key, a
  disaggregated model's vllm-router or any replica behind the gateway, which checks the key
  alone, is open to the gateway alone). Nothing else is open: no SSH.
- Where an endpoint runs, the stack's gateway (`coral_iac/gateway.py`) reaches the API port: by
  its security group in its own region (private addresses), by its Elastic IP elsewhere.

`Infra` is a component (`coral:infra:Infra`): every resource above is its child. Stacks deployed
before it was one hold those resources at the stack's root, so each child carries its old URN as
an alias (`ROOT_ALIAS`) and is adopted in place rather than deleted and created again.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pulumi
import pulumi_aws as aws
import pulumi_gcp as gcp

from coral_iac.bootstrap import secret_name
from coral_iac.deploy_settings import DeploySettings
from solver.catalog.offers import Offer
from solver.errors import InputError

# Trust policy of the roles EC2 instances run as (serving nodes, the gateway).
EC2_ASSUME_ROLE = json.dumps(
    {
        "Version": "2012-10-17",
        "Statement": [
            {
                "Effect": "Allow",
                "Action": "sts:AssumeRole",
                "Principal": {"Service": "ec2.amazonaws.com"},
            }
        ],
    }
)

# Subnet slots: an AWS region's VPC, 10.<region>.0.0/16, holds sixteen /20 subnets, at third
# octet 16 x slot. Slot 0 is the region's own subnet (the gateway's); slots 1-7 the zone-letter
# subnets of on-demand replicas, zone a-g (`Infra.aws_node_subnet`); slots 8-15 the zone-ID
# subnets of spot replicas, az1-az8 (`Infra.aws_spot_subnet`). Disjoint ranges, so a zone's
# letter subnet and its ID subnet never overlap, whichever physical zone a letter names.
ZONE_LETTER_SLOTS = 7
ZONE_ID_SLOTS = 8

# The URN every child of `Infra` had before `Infra` was a component: the same type and name at
# the stack's root. Without it, the new parent changes each URN and `pulumi up` would replace
# every network, identity and provider, and with the providers every node.
ROOT_ALIAS = pulumi.Alias(parent=pulumi.ROOT_STACK_RESOURCE)


@dataclass
class Region:
    """What every node in one (cloud, region) is declared with."""

    cloud: str
    region: str
    provider: pulumi.ProviderResource
    image: pulumi.Input[str]
    subnet_id: pulumi.Output[str]
    network: pulumi.Output[str] | None = None  # GCP network self-link; AWS VPC id
    zone: str = ""
    groups: dict[str, pulumi.Output[str]] = field(default_factory=dict)  # model -> SG id / tag
    index: int = 0  # the region's place in coral:fleet.regions (its CIDR block)
    routes: pulumi.Output[str] | None = None  # AWS route table id
    # AWS AZ name, or AZ ID for spot replicas (`aws_spot_subnet`) -> subnet
    zone_subnets: dict[str, pulumi.Output[str]] = field(default_factory=dict)
    # AWS, read once per region: its zones, their AZ IDs (ID -> name), and the zones each
    # instance type is offered in.
    zones: list[str] | None = None
    zone_names: dict[str, str] = field(default_factory=dict)
    offered: dict[str, set[str]] = field(default_factory=dict)


@dataclass(frozen=True)
class GatewayPeer:
    """Where the gateway connects from, so endpoint groups can admit it on the API port."""

    cloud: str
    region: str
    group_id: pulumi.Output[str]  # its security group (same region: private addresses)
    public_ip: pulumi.Output[str]  # its Elastic IP (other regions and clouds)


@dataclass
class Identity:
    """How nodes authenticate to the secret manager (no token in user-data)."""

    aws_instance_profile: pulumi.Output[str] | None = None
    gcp_service_account: pulumi.Output[str] | None = None


@dataclass(frozen=True)
class InfraArgs:
    """Typed inputs of the shared infrastructure."""

    stack: str
    deploy: DeploySettings
    # The stack's (cloud, region) list, coral:fleet.regions. A region's network CIDR comes from
    # its place there, so plans using more or fewer regions never renumber (and replace) another
    # region's network; add regions at the end.
    order: Sequence[tuple[str, str]] = ()
    # The AMI id each AWS region was deployed with (the stack's `images` output), kept unless
    # `deploy.refresh_images`.
    images: Mapping[str, str] = field(default_factory=dict)


class Infra(pulumi.ComponentResource):
    """Creates shared resources on first use, so unused regions and clouds cost nothing. Its
    children are created after the constructor: `finish` registers its outputs once the run has
    declared everything."""

    def __init__(
        self, name: str, args: InfraArgs, opts: pulumi.ResourceOptions | None = None
    ) -> None:
        super().__init__("coral:infra:Infra", name, None, opts)
        self.stack, self.deploy = args.stack, args.deploy
        self.order = list(args.order)
        self.recorded_images = dict(args.images)
        self.images: dict[str, str] = {}  # `aws_image` key -> the AMI new nodes boot with
        self.regions: dict[tuple[str, str], Region] = {}
        self.identity = Identity()
        # The gateway's addresses (`Gateway.peer`), set before any group exists.
        self.gateway: GatewayPeer | None = None
        # Whether GPU nodes check deploy.api_key_secret themselves: not behind a gateway, which
        # checks it alone (set before any region, so the nodes' identity may not read it).
        self.nodes_read_api_key = args.deploy.api_key_secret is not None
        self.aws_providers: dict[str, aws.Provider] = {}
        self._gcp_network: gcp.compute.Network | None = None

    def _child(self, provider: pulumi.ProviderResource | None = None) -> pulumi.ResourceOptions:
        """The options of every resource Infra declares: its child, through `provider`, with
        the URN it had at the stack's root as an alias (`ROOT_ALIAS`)."""
        return pulumi.ResourceOptions(parent=self, provider=provider, aliases=[ROOT_ALIAS])

    def finish(self) -> pulumi.Output[str]:
        """Registers the component's outputs, once the run has declared everything; returns the
        AMI per `aws_image` key as the stack's `images` output (JSON)."""
        keys = sorted(self.images)
        images = pulumi.Output.all(*(self.images[k] for k in keys)).apply(
            lambda amis: json.dumps(dict(zip(keys, amis, strict=True)), sort_keys=True)
        )
        networks: dict[str, Any] = {
            f"{cloud}:{region}": r.network for (cloud, region), r in sorted(self.regions.items())
        }
        self.register_outputs({"images": images, "networks": networks})
        return images

    def region(self, cloud: str, region: str) -> Region:
        key = (cloud, region)
        if key not in self.regions:
            # distinct CIDRs per region; a region outside the list (the gateway's) gets 10.255
            index = self.order.index(key) if key in self.order else 255
            self.regions[key] = (
                self._aws(region, index) if cloud == "aws" else self._gcp(region, index)
            )
        return self.regions[key]

    # ---------------------------------------------------------------- AWS

    def aws_image(self, key: str, parameter: str, provider: pulumi.ProviderResource) -> str:
        """The AMI of the nodes recorded under `key` (an AWS region for GPU nodes,
        "gateway:<region>" for the gateway): the one recorded at the stack's first deploy, or
        (first deploy, or `deploy.refresh_images`) the SSM `parameter`'s current value, read
        when the run starts. A new image release then never changes a running node's `ami`,
        which would replace it at once: GPU replicas move to a new one through the
        reconfiguration states (`rollout_images`)."""
        if key not in self.images:
            recorded = self.recorded_images.get(key)
            if recorded and not self.deploy.refresh_images:
                self.images[key] = recorded
            else:
                self.images[key] = aws.ssm.get_parameter(
                    name=parameter, opts=pulumi.InvokeOptions(provider=provider)
                ).value
        return self.images[key]

    def aws_provider(self, region: str) -> aws.Provider:
        """The provider of an AWS region, one per region (a run may need it before the
        region's network, to read the gateway's health report)."""
        if region not in self.aws_providers:
            self.aws_providers[region] = aws.Provider(
                f"aws-{region}", region=region, opts=self._child()
            )
        return self.aws_providers[region]

    def _aws(self, region: str, index: int) -> Region:
        provider = self.aws_provider(region)
        opts = self._child(provider)
        image = self.aws_image(region, self.deploy.aws_ami_parameter, provider)
        tags = {"coral:stack": self.stack}
        cidr = f"10.{index}.0.0/16"
        vpc = aws.ec2.Vpc(
            f"vpc-{region}", cidr_block=cidr, enable_dns_hostnames=True, tags=tags, opts=opts
        )
        gateway = aws.ec2.InternetGateway(f"igw-{region}", vpc_id=vpc.id, tags=tags, opts=opts)
        subnet = aws.ec2.Subnet(
            f"subnet-{region}",
            vpc_id=vpc.id,
            cidr_block=f"10.{index}.0.0/20",
            map_public_ip_on_launch=True,
            tags=tags,
            opts=opts,
        )
        routes = aws.ec2.RouteTable(
            f"routes-{region}",
            vpc_id=vpc.id,
            routes=[{"cidr_block": "0.0.0.0/0", "gateway_id": gateway.id}],
            tags=tags,
            opts=opts,
        )
        aws.ec2.RouteTableAssociation(
            f"routes-{region}", subnet_id=subnet.id, route_table_id=routes.id, opts=opts
        )
        if self.identity.aws_instance_profile is None:
            self.identity.aws_instance_profile = self._aws_identity(provider)
        r = Region("aws", region, provider, image, subnet.id, index=index)
        r.network = vpc.id
        r.routes = routes.id
        return r

    def aws_node_subnet(self, r: Region, instance_types: list[str]) -> pulumi.Output[str]:
        """The subnet of a replica's AWS nodes: one in the first availability zone (by name)
        that offers every one of its instance types (EC2's instance type offerings), so a
        launch never fails with "not supported in your requested Availability Zone" (a
        region's default subnet sits in a zone AWS picks). One subnet per zone, created on
        first use, 10.<region>.<16 (k + 1)>.0/20 for zone letter k (a-g; `ZONE_LETTER_SLOTS`).

        Raises:
            pulumi.RunError: no zone of the region offers all of them, or the one that does is
                past letter g.
        """
        types = sorted(set(instance_types))
        zones, where = self._aws_zones(r), self._aws_offered(r, types)
        fit = sorted(z for z in zones if all(z in where[t] for t in types))
        if not fit:
            raise pulumi.RunError(
                f"no availability zone of aws:{r.region} offers {', '.join(types)} together "
                f"(offered: {', '.join(f'{t} in {sorted(where.get(t, set()))}' for t in types)}); "
                "plan without those node configs there (e.g. remove them from "
                "coral:fleet.availability for this region)"
            )
        zone = fit[0]
        k = ord(zone[-1]) - ord("a")
        if not 0 <= k < ZONE_LETTER_SLOTS:
            raise pulumi.RunError(
                f"availability zone {zone} of aws:{r.region} offers {', '.join(types)}, but "
                f"Coral numbers subnets for zone letters a-{chr(ord('a') + ZONE_LETTER_SLOTS - 1)} "
                "only (ZONE_LETTER_SLOTS in coral_iac/infra.py); plan without those node configs "
                "there (coral:fleet.availability for this region)"
            )
        return self._aws_zone_subnet(r, zone, 1 + k)

    def aws_spot_subnet(
        self, r: Region, zone_id: str, instance_types: list[str]
    ) -> pulumi.Output[str]:
        """The subnet of a spot replica's AWS nodes: in the availability zone its plan names
        (`Instance.zone`), an AZ ID such as use2-az1, as the SkyPilot catalog prices spot per
        zone ID (a zone's name, us-east-2a, is a different physical zone in each account). One
        subnet per zone ID, created on first use and declared by `availability_zone_id`, so no
        name lookup stands between the plan and the launch. It may share its zone with a
        zone-letter subnet (`aws_node_subnet`); their CIDRs never overlap: zone ID az<n> gets
        10.<region>.<16 (n + 7)>.0/20 (n 1-8; `ZONE_ID_SLOTS`).

        Raises:
            pulumi.RunError: the zone ID is not one of the region's, its number is past 8, or
                EC2 does not offer every one of the instance types there.
        """
        types = sorted(set(instance_types))
        self._aws_zones(r)
        if zone_id not in r.zone_names:
            raise pulumi.RunError(
                f"spot zone {zone_id} is not an availability zone of aws:{r.region} (its zone "
                f"IDs: {', '.join(sorted(r.zone_names))}); plan again with `coral plan`, which "
                "places spot instances in the catalog's spot zones of their region"
            )
        n = int(m.group(1)) if (m := re.fullmatch(r"[a-z0-9-]+-az(\d+)", zone_id)) else 0
        if not 1 <= n <= ZONE_ID_SLOTS:
            raise pulumi.RunError(
                f"spot zone {zone_id} of aws:{r.region}: Coral numbers subnets for zone IDs az1-"
                f"az{ZONE_ID_SLOTS} only (ZONE_ID_SLOTS in coral_iac/infra.py); plan without spot "
                "(coral:fleet.allocation.spot.enabled: false)"
            )
        name, where = r.zone_names[zone_id], self._aws_offered(r, types)
        if missing := [t for t in types if name not in where[t]]:
            raise pulumi.RunError(
                f"spot zone {zone_id} of aws:{r.region} ({name} in this account) does not offer "
                f"{', '.join(missing)} (EC2's instance type offerings); refresh the catalog's "
                "spot zones and plan again, or plan without spot "
                "(coral:fleet.allocation.spot.enabled: false)"
            )
        return self._aws_zone_subnet(r, zone_id, ZONE_LETTER_SLOTS + n, by_id=True)

    def _aws_zones(self, r: Region) -> list[str]:
        """The region's availability zones by name (read once; `r.zone_names` maps their AZ IDs,
        which the same call lists in the same order)."""
        if r.zones is None:
            found = aws.get_availability_zones(
                state="available",
                filters=[{"name": "opt-in-status", "values": ["opt-in-not-required"]}],
                opts=pulumi.InvokeOptions(provider=r.provider),
            )
            r.zones = list(found.names)
            r.zone_names = dict(zip(found.zone_ids, found.names, strict=True))
        return r.zones

    def _aws_offered(self, r: Region, types: list[str]) -> dict[str, set[str]]:
        """Instance type -> the zones (by name) EC2 offers it in, read once per type."""
        if missing := [t for t in types if t not in r.offered]:
            offered = aws.ec2.get_instance_type_offerings(
                location_type="availability-zone",
                filters=[{"name": "instance-type", "values": missing}],
                opts=pulumi.InvokeOptions(provider=r.provider),
            )
            r.offered.update({t: set() for t in missing})
            for t, zone in zip(offered.instance_types, offered.locations, strict=True):
                r.offered[t].add(zone)
        return r.offered

    def _aws_zone_subnet(
        self, r: Region, zone: str, slot: int, by_id: bool = False
    ) -> pulumi.Output[str]:
        """The subnet `subnet-<zone>` in that zone (a name, or an AZ ID when `by_id`), the /20
        at `slot` of the region's /16, with its route to the internet; declared on first use."""
        if zone not in r.zone_subnets:
            opts = self._child(r.provider)
            subnet = aws.ec2.Subnet(
                f"subnet-{zone}",
                vpc_id=r.network,
                availability_zone=None if by_id else zone,
                availability_zone_id=zone if by_id else None,
                cidr_block=f"10.{r.index}.{16 * slot}.0/20",
                map_public_ip_on_launch=True,
                tags={"coral:stack": self.stack},
                opts=opts,
            )
            aws.ec2.RouteTableAssociation(
                f"routes-{zone}", subnet_id=subnet.id, route_table_id=r.routes, opts=opts
            )
            r.zone_subnets[zone] = subnet.id
        return r.zone_subnets[zone]

    def _aws_identity(self, provider: pulumi.ProviderResource) -> pulumi.Output[str]:
        opts = self._child(provider)
        role = aws.iam.Role(
            "node-role",
            assume_role_policy=EC2_ASSUME_ROLE,
            tags={"coral:stack": self.stack},
            opts=opts,
        )
        aws.iam.RolePolicy(
            "node-read-hf-token",
            role=role.id,
            policy=json.dumps(
                {
                    "Version": "2012-10-17",
                    "Statement": [
                        {
                            "Effect": "Allow",
                            "Action": "secretsmanager:GetSecretValue",
                            "Resource": _secret_arns(self.deploy, self.nodes_read_api_key),
                        }
                    ],
                }
            ),
            opts=opts,
        )
        profile = aws.iam.InstanceProfile("node-profile", role=role.name, opts=opts)
        return profile.name

    def aws_group(
        self, r: Region, model: str, public: bool, clients: bool = True
    ) -> pulumi.Output[str]:
        """Security group of one model's nodes in one region (see the module doc); `clients`
        false: the API port is open to the gateway only (an endpoint that checks no API key)."""
        if model not in r.groups:
            ingress = [
                aws.ec2.SecurityGroupIngressArgs(
                    protocol="-1",
                    from_port=0,
                    to_port=0,
                    self=True,
                    description="nodes of this model in this region (vLLM, NCCL, NIXL)",
                )
            ]
            if public and clients and self.deploy.api_cidrs:
                port = self.deploy.api_port
                ingress.append(
                    aws.ec2.SecurityGroupIngressArgs(
                        protocol="tcp",
                        from_port=port,
                        to_port=port,
                        cidr_blocks=list(self.deploy.api_cidrs),
                        description="OpenAI-compatible API",
                    )
                )
            if public and self.gateway is not None:
                ingress.append(self._gateway_rule(r))
            group = aws.ec2.SecurityGroup(
                f"sg-{model}-{r.region}",
                description=f"Coral {self.stack}: {model} nodes in {r.region}",
                vpc_id=r.network,
                ingress=ingress,
                egress=[
                    aws.ec2.SecurityGroupEgressArgs(
                        protocol="-1",
                        from_port=0,
                        to_port=0,
                        cidr_blocks=["0.0.0.0/0"],
                        description="weights, packages",
                    )
                ],
                tags={"coral:stack": self.stack, "coral:model": model},
                opts=self._child(r.provider),
            )
            r.groups[model] = group.id
        return r.groups[model]

    def _gateway_rule(self, r: Region) -> aws.ec2.SecurityGroupIngressArgs:
        """The API port open to the gateway: by its security group in its own region, by its
        Elastic IP elsewhere."""
        assert self.gateway is not None
        port, gw = self.deploy.api_port, self.gateway
        same_region = (gw.cloud, gw.region) == ("aws", r.region)
        return aws.ec2.SecurityGroupIngressArgs(
            protocol="tcp",
            from_port=port,
            to_port=port,
            description="Coral gateway",
            security_groups=[gw.group_id] if same_region else None,
            cidr_blocks=None if same_region else [gw.public_ip.apply(lambda ip: f"{ip}/32")],
        )

    # ---------------------------------------------------------------- GCP

    def _gcp(self, region: str, index: int) -> Region:
        provider = gcp.Provider(f"gcp-{region}", region=region, opts=self._child())
        opts = self._child(provider)
        if self._gcp_network is None:
            self._gcp_network = gcp.compute.Network(
                "network",
                auto_create_subnetworks=False,
                description=f"Coral {self.stack}",
                opts=opts,
            )
            account = gcp.serviceaccount.Account(
                "node-account",
                account_id=f"coral-{self.stack}"[:28].rstrip("-"),
                display_name=f"Coral {self.stack} GPU nodes",
                opts=opts,
            )
            gcp.secretmanager.SecretIamMember(
                "node-read-hf-token",
                secret_id=secret_name("gcp", self.deploy.hf_token_secret),
                role="roles/secretmanager.secretAccessor",
                member=account.email.apply(lambda e: f"serviceAccount:{e}"),
                opts=opts,
            )
            if self.deploy.api_key_secret and self.nodes_read_api_key:  # vLLM reads it at boot
                gcp.secretmanager.SecretIamMember(
                    "node-read-api-key",
                    secret_id=secret_name("gcp", self.deploy.api_key_secret),
                    role="roles/secretmanager.secretAccessor",
                    member=account.email.apply(lambda e: f"serviceAccount:{e}"),
                    opts=opts,
                )
            self.identity.gcp_service_account = account.email
        subnet = gcp.compute.Subnetwork(
            f"subnet-{region}",
            region=region,
            network=self._gcp_network.id,
            ip_cidr_range=f"10.{100 + index}.0.0/20",
            opts=opts,
        )
        zone = self.deploy.gcp_zones.get(region, f"{region}-a")
        r = Region(
            "gcp", region, provider, self.deploy.gcp_image, subnet.id, self._gcp_network.id, zone
        )
        return r

    def gcp_tag(self, r: Region, model: str, public: bool, clients: bool = True) -> str:
        """Network tag of one model's nodes in one region, with its firewall rules (`clients`:
        as in `aws_group`)."""
        name = gcp_name(model)
        tag = f"coral-{self.stack}-{name}"[:63].replace(".", "-").rstrip("-")
        if model not in r.groups:
            opts = self._child(r.provider)
            gcp.compute.Firewall(
                f"fw-{name}-{r.region}-internal",
                network=r.network,
                direction="INGRESS",
                allows=[{"protocol": "tcp"}, {"protocol": "udp"}],
                source_tags=[tag],
                target_tags=[tag],
                description="nodes of this model (vLLM, NCCL, NIXL)",
                opts=opts,
            )
            if public and clients and self.deploy.api_cidrs:
                gcp.compute.Firewall(
                    f"fw-{name}-{r.region}-api",
                    network=r.network,
                    direction="INGRESS",
                    allows=[{"protocol": "tcp", "ports": [str(self.deploy.api_port)]}],
                    source_ranges=list(self.deploy.api_cidrs),
                    target_tags=[tag],
                    description="OpenAI-compatible API",
                    opts=opts,
                )
            if public and self.gateway is not None:
                gcp.compute.Firewall(
                    f"fw-{name}-{r.region}-gateway",
                    network=r.network,
                    direction="INGRESS",
                    allows=[{"protocol": "tcp", "ports": [str(self.deploy.api_port)]}],
                    source_ranges=[self.gateway.public_ip.apply(lambda ip: f"{ip}/32")],
                    target_tags=[tag],
                    description="Coral gateway",
                    opts=opts,
                )
            r.groups[model] = pulumi.Output.from_input(tag)
        return tag


def gcp_node_zones(region: str, offers: list[Offer], chosen: str | None = None) -> list[str]:
    """The zone of each of a replica's GCP nodes (same order as `offers`): the first zone (by
    name) that sells every offer, so that a launch never fails for a machine type or GPU the
    zone lacks (europe-west4 sells A100-80GB only in zone a, H100 only in b and c). Where no
    zone sells them all, each node goes to the first zone that sells its own offer: the
    replica spans zones of one regional subnet (the caller warns). Offers without recorded
    zones go anywhere; with none recorded at all, `<region>-a`.

    Args:
        region: the GCP region.
        offers: the replica's offers, one per node.
        chosen: `deploy.gcp_zones[region]`, the user's zone for the region, if any.

    Raises:
        InputError: `chosen` is a zone where the catalog says an offer is not sold.
    """
    if chosen is not None:
        for o in offers:
            if o.zones and chosen not in o.zones:
                raise InputError(
                    f"coral:fleet.deploy.gcp_zones.{region}",
                    f"{chosen} does not sell {o.instance_type} (the catalog: {', '.join(o.zones)})",
                    f"remove the key so that Coral picks a zone per node, or choose one of "
                    f"{', '.join(o.zones)}",
                )
        return [chosen] * len(offers)
    recorded = [set(o.zones) for o in offers if o.zones]
    if not recorded:
        return [f"{region}-a"] * len(offers)
    common = sorted(set.intersection(*recorded))
    if common:
        return [common[0]] * len(offers)
    first = sorted(set.union(*recorded))[0]
    return [min(o.zones) if o.zones else first for o in offers]


def spot_zone(key: str, zone: str | None, offers: list[Offer]) -> str:
    """A spot replica's zone, where every one of its nodes runs: the plan's (`Instance.zone`; an
    AZ ID on AWS, a zone name on GCP), checked against the catalog's spot zones of each offer,
    so that a plan made from another catalog fails the preview rather than the launch.

    Raises:
        InputError: the instance names no zone, or the catalog lists no spot price for one of
            its offers there.
    """
    where = f"plan instance {key}"
    fix = (
        "plan again with `coral plan`, which places spot instances in the catalog's spot "
        "zones, or turn spot off (coral:fleet.allocation.spot.enabled: false)"
    )
    if zone is None:
        raise InputError(where, "a spot instance with no zone", fix)
    for o in offers:
        if zone not in o.spot_zones:
            raise InputError(
                where,
                f"spot zone {zone}: the catalog lists no spot price for {o.instance_type} in "
                f"it (its spot zones: {', '.join(o.spot_zones) or 'none'})",
                fix,
            )
    return zone


def gcp_name(model: str) -> str:
    """A model id as part of a GCP resource name, which allows only lowercase letters, digits
    and "-": a length bucket's "@" becomes "-" (<model>@b<i> -> <model>-b<i>); any other
    character GCP refuses (the "." of llama3.1-70b) too, with a digest of the id appended so
    that two ids never share a name."""
    name = model.replace("@", "-")
    safe = re.sub(r"[^a-z0-9-]", "-", name.lower())
    return name if safe == name else f"{safe}-{hashlib.sha256(model.encode()).hexdigest()[:6]}"


# Secrets Manager appends "-" and six random characters to a secret's name in its ARN: matching
# exactly those keeps a policy for coral/hf-token off coral/hf-token-old or coral/hf-token-2.
SECRET_SUFFIX = "-??????"


def _secret_arns(deploy: DeploySettings, api_key: bool = True) -> str | list[str]:
    """The secrets nodes may read: the Hugging Face token, and the API key when one is set and
    `api_key` (the nodes check it themselves: no gateway does)."""
    arns = [f"arn:aws:secretsmanager:*:*:secret:{deploy.hf_token_secret}{SECRET_SUFFIX}"]
    if deploy.api_key_secret and api_key:
        arns.append(f"arn:aws:secretsmanager:*:*:secret:{deploy.api_key_secret}{SECRET_SUFFIX}")
    return arns[0] if len(arns) == 1 else arns

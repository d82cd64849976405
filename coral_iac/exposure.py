"""Who can reach the fleet's API: warnings for an empty or world-open `deploy.api_cidrs`."""

from __future__ import annotations

import ipaddress

from coral_iac.deploy_settings import DeploySettings

WORLD = ipaddress.IPv4Network("0.0.0.0/0")


def world_open(cidrs: list[str]) -> bool:
    """Whether the CIDRs together cover every IPv4 address (0.0.0.0/0, or e.g. its two halves)."""
    networks = [ipaddress.IPv4Network(c, strict=False) for c in cidrs]
    return list(ipaddress.collapse_addresses(networks)) == [WORLD]


def exposure_warnings(deploy: DeploySettings) -> list[str]:
    """What `coral preview` and `pulumi preview` warn about the API port's reach.

    Args:
        deploy: `coral:fleet.deploy` (its CIDRs are already checked to be IPv4 networks).

    Returns:
        One line per problem, each naming the key and the fix; empty when the API is open to
        some, not all, addresses.
    """
    key = deploy.api_key_secret
    if not deploy.api_cidrs:
        return [
            "coral:fleet.deploy.api_cidrs is empty: the API port is open to no one, so nothing "
            "outside the VPCs can reach the endpoints or the gateway printed here; add your "
            "clients' CIDRs, e.g. api_cidrs: [203.0.113.0/24]"
        ]
    if not world_open(list(deploy.api_cidrs)):
        return []
    line = (
        f"coral:fleet.deploy.api_cidrs {list(deploy.api_cidrs)} opens the API port to the whole "
        "internet"
    )
    if key:
        plain = (
            ""
            if deploy.gateway.tls_secret
            else " (sent in plain HTTP: set coral:fleet.deploy.gateway.tls_secret for HTTPS)"
        )
        return [f"{line}; every request needs the API key in secret '{key}'{plain}"]
    return [
        f"{line} with no API key: anyone can use the GPUs you pay for; list your clients' "
        "CIDRs, or set coral:fleet.deploy.api_key_secret to a secret holding an API key"
    ]

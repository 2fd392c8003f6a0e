"""The harness only ever binds or dials loopback addresses (127.0.0.0/8).

Fake pods get loopback IPs, Service ClusterIPs are labels nothing routes, and this machine's
network beyond loopback is off limits: everything that starts or dials something checks here
first and refuses loudly otherwise.
"""

from __future__ import annotations

import ipaddress
import os
from urllib.parse import urlsplit

LOOPBACK = ipaddress.ip_network("127.0.0.0/8")

#: Set by the local cluster's pod runtime in every pod process: code that dials URLs taken from user
#: input (the autoscaler's Prometheus URL) checks them with `guard_url` first.
LOOPBACK_ONLY_ENV = "XPYD_LOOPBACK_ONLY"


class NonLoopbackAddress(RuntimeError):
    """Raised instead of binding or dialling anything outside 127.0.0.0/8."""


def require_loopback(host: str, what: str = "address") -> str:
    """Return `host` when it is a loopback IP (or localhost); raise NonLoopbackAddress otherwise."""
    if host == "localhost":
        return host
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        raise NonLoopbackAddress(f"refusing {what} {host!r}: not an IP address on loopback "
                                 "(the local cluster resolves no names; nothing may leave 127.0.0.0/8)") from None
    if address not in LOOPBACK:
        raise NonLoopbackAddress(f"refusing {what} {host}: outside 127.0.0.0/8 (Service ClusterIPs and "
                                 "other networks are never dialled by the local cluster)")
    return host


def require_loopback_url(url: str) -> str:
    """Check the host of a URL before dialling it."""
    host = urlsplit(url).hostname or ""
    require_loopback(host, f"URL {url}")
    return url


def guard_url(url: str) -> str:
    """`require_loopback_url` inside the local cluster (LOOPBACK_ONLY_ENV set), else `url` unchanged:
    on a real cluster the same code dials whatever the user configured."""
    return require_loopback_url(url) if os.environ.get(LOOPBACK_ONLY_ENV) else url

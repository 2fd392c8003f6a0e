"""Ports for the engines and proxies tests and benchmarks start on several loopback addresses."""

from __future__ import annotations

import socket

REPLAY_OFFSET = 100
"""How far above a KV-event port its replay port is taken (the pair must both be free)."""


def common_ports(hosts: list[str], count: int) -> list[int]:
    """`count` ports free on every one of `hosts`, each with the port `REPLAY_OFFSET` above it free
    too, and no two of them a replay offset apart."""
    found: list[int] = []
    for _ in range(200):
        with socket.socket() as probe:
            probe.bind((hosts[0], 0))
            port = int(probe.getsockname()[1])
        if port + REPLAY_OFFSET > 65535 or any(abs(port - other) in (0, REPLAY_OFFSET) for other in found):
            continue
        try:
            for host in hosts:
                for candidate in (port, port + REPLAY_OFFSET):
                    with socket.socket() as other:
                        other.bind((host, candidate))
        except OSError:
            continue
        found.append(port)
        if len(found) == count:
            return found
    raise RuntimeError(f"no {count} common free ports on {', '.join(hosts)}")

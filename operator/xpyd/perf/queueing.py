"""Queueing formulas the sizing models share."""

from __future__ import annotations


def erlang_c(servers: int, offered_load: float) -> float:
    """Probability that an arrival waits in an M/M/c queue with `servers` and load `a = rate · S`."""
    if offered_load <= 0:
        return 0.0
    if offered_load >= servers:
        return 1.0
    blocking = 1.0  # Erlang B by its stable recursion
    for k in range(1, servers + 1):
        blocking = offered_load * blocking / (k + offered_load * blocking)
    utilisation = offered_load / servers
    return blocking / (1.0 - utilisation * (1.0 - blocking))

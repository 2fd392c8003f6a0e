"""Timestamps as Kubernetes writes them: RFC 3339, UTC, in whole seconds (`2026-12-01T13:05:12Z`,
a Time) or with microseconds (`2026-12-01T13:05:12.345678Z`, a MicroTime, as a Lease holds)."""

from __future__ import annotations

import datetime


def rfc3339(seconds: float | None = None, *, microseconds: bool = False) -> str:
    """`seconds` since the epoch (default: now) as an RFC 3339 UTC timestamp, e.g. for
    `lastTransitionTime`, Events and status stamps; with `microseconds`, a MicroTime (a Lease's
    `acquireTime` and `renewTime`)."""
    moment = (datetime.datetime.now(datetime.UTC) if seconds is None
              else datetime.datetime.fromtimestamp(seconds, datetime.UTC))
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ" if microseconds else "%Y-%m-%dT%H:%M:%SZ")


def parse_rfc3339(text: object) -> float | None:
    """A timestamp as Kubernetes writes it, in seconds since the epoch; None when `text` is not one."""
    if not isinstance(text, str):
        return None
    try:
        return datetime.datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.UTC).timestamp()
    except ValueError:
        return None

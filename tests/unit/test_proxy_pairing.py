"""Pairing by KV compatibility hash (`xpyd.proxy.picking.pairable` / `partners`), where discovery
reads the hash, and readiness: the proxy's pure parts."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from xpyd.api.naming import KV_COMPAT_LABEL, Role
from xpyd.proxy.config import ProxyConfig
from xpyd.proxy.discovery import pod_endpoints
from xpyd.proxy.picking import pairable, partners
from xpyd.proxy.pool import Endpoint
from xpyd.proxy.server import Proxy

pytestmark = pytest.mark.unit

# An instance is (name, compat); None: no hash (a fixed URL or an unlabelled pod).
Instances = list[tuple[str, str | None]]


def _compat(instance: tuple[str, str | None]) -> str | None:
    return instance[1]


@pytest.mark.parametrize(("prefills", "decodes", "paired"), [
    ([("p1", "a"), ("p2", "b")], [("d1", "a"), ("d2", "b")], ["p1", "p2"]),   # a rollout half done
    ([("p1", "a"), ("p2", "b")], [("d1", "b")], ["p2"]),                       # old decode gone
    ([("p1", "a")], [("d1", "b")], []),                                        # nothing pairs
    ([("p1", None), ("p2", "a")], [("d1", None)], ["p1"]),                     # no hash pairs with no hash
    ([("p1", None)], [("d1", "a")], []),                                       # ...and never with a hash
    ([("p1", "a")], [("d1", None)], []),
    ([("p1", "a"), ("p2", "a")], [("d1", "a")], ["p1", "p2"]),
    ([], [("d1", "a")], []),
    ([("p1", "a")], [], []),
])
def test_only_prefills_with_a_decode_of_their_hash_are_pairable(prefills: Instances, decodes: Instances,
                                                               paired: list[str]) -> None:
    assert [name for name, _ in pairable(prefills, decodes, _compat)] == paired


@pytest.mark.parametrize(("decodes", "kind", "expected"), [
    ([("d1", "a"), ("d2", "b"), ("d3", "a")], "a", ["d1", "d3"]),
    ([("d1", "a"), ("d2", None)], None, ["d2"]),
    ([("d1", "a")], "b", []),
    ([("d1", None)], "a", []),
])
def test_a_prefills_partners_share_its_hash(decodes: Instances, kind: str | None, expected: list[str]) -> None:
    assert [name for name, _ in partners(decodes, kind, _compat)] == expected


def _pod(ip: str, labels: dict[str, str]) -> dict[str, Any]:
    return {"metadata": {"name": ip, "labels": labels},
            "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]}}


def test_discovery_reads_the_hash_label() -> None:
    pods = [_pod("10.0.0.1", {KV_COMPAT_LABEL: "abc", "xpyd.io/role": "decode"}),
            _pod("10.0.0.2", {"xpyd.io/role": "decode"}), {**_pod("10.0.0.3", {}), "metadata": {"name": "x"}}]
    assert [e.compat for e in pod_endpoints(pods, 8000)] == ["abc", None, None]


def test_a_second_source_without_a_hash_keeps_discoverys() -> None:
    async def merged() -> str | None:
        proxy = Proxy(ProxyConfig())
        proxy.set_endpoints("decode", [Endpoint("http://d", compat="abc")])
        proxy.set_endpoints("decode", [Endpoint("http://d", zmq_address="d:1")], source="registration")
        await proxy.close()  # cancels the probes set_endpoints started
        return proxy.pools["decode"].instances["http://d"].compat

    assert asyncio.run(merged()) == "abc"


@pytest.mark.parametrize(("prefill", "decode", "pair"), [
    (["a"], ["a"], True),
    (["a", "b"], ["b"], True),
    (["a"], ["b"], False),
    ([None], [None], True),
    ([None], ["a"], False),
])
def test_readiness_needs_a_compatible_pair(prefill: list[str | None], decode: list[str | None], pair: bool) -> None:
    proxy = Proxy(ProxyConfig())
    roles: list[tuple[Role, list[str | None]]] = [("prefill", prefill), ("decode", decode)]
    for role, kinds in roles:
        endpoints = [Endpoint(f"http://{role}-{index}", compat=kind) for index, kind in enumerate(kinds)]
        for instance in proxy.pools[role].update(endpoints, 0.0, 0.0):
            instance.healthy = True
    assert proxy.missing_roles() == []
    assert proxy.pairing.compatible_pair() is pair

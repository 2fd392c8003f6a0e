"""Fuzzing the running proxy (real HTTP on loopback, stub engines behind it): whatever a client
sends, the proxy answers with a 2xx or a JSON 4xx, never a 500, and keeps serving. Bounded: a
fixed number of examples, each with a short timeout."""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.integration.rig import HOST, Rig, rig

pytestmark = pytest.mark.integration

KEYS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "min_tokens", "stream",
        "stream_options", "n", "temperature", "top_p", "kv_transfer_params", "logprobs", "seed", "extra"]
SCALARS = (st.none() | st.booleans() | st.integers(min_value=-2**70, max_value=2**70)
           | st.floats(allow_nan=False) | st.text(max_size=40))
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                       max_size=4), max_leaves=15)
#: Plausible requests, so the fuzzer gets past the first checks often.
PLAUSIBLE = st.fixed_dictionaries(
    {"model": st.just("m")},
    optional={"prompt": st.text(max_size=50) | st.lists(st.integers(0, 50000), max_size=20),
              "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system"])},
                                                         optional={"content": st.text(max_size=30) | VALUES}),
                                   max_size=3),
              "max_tokens": st.integers(-2, 40) | VALUES, "stream": st.booleans() | VALUES,
              "stream_options": st.just({"include_usage": True}) | VALUES, "n": st.integers(0, 3),
              "temperature": st.floats(allow_nan=False) | VALUES, "kv_transfer_params": VALUES})
BODIES = (st.binary(max_size=200) | st.dictionaries(st.sampled_from(KEYS), VALUES, max_size=8).map(json.dumps)
          .map(str.encode) | PLAUSIBLE.map(json.dumps).map(str.encode))
HEADER_VALUES = st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7e), max_size=300)


@pytest.fixture(scope="module")
def running() -> Iterator[Rig]:
    """One proxy with stub engines in a background event loop, for all examples."""
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    holder: dict[str, Any] = {}

    async def main() -> None:
        async with rig(prefill=2, decode=2) as the_rig:
            holder["rig"] = the_rig
            holder["stop"] = asyncio.Event()
            ready.set()
            await holder["stop"].wait()

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    assert ready.wait(30), "the proxy did not start"
    yield holder["rig"]
    loop.call_soon_threadsafe(holder["stop"].set)
    thread.join(30)


def _request(url: str, method: str, path: str, body: bytes | None, headers: dict[str, str]) -> tuple[int, bytes, str]:
    host, port = url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        connection.request(method, path, body=body, headers=headers)
        response = connection.getresponse()
        return response.status, response.read(), response.getheader("Content-Type") or ""
    finally:
        connection.close()


@settings(max_examples=400, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(body=BODIES, path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
       request_id=st.none() | HEADER_VALUES, authorization=st.none() | HEADER_VALUES)
def test_no_input_makes_the_proxy_fail(running: Rig, body: bytes, path: str, request_id: str | None,
                                       authorization: str | None) -> None:
    assert HOST in running.url
    headers = {"Content-Type": "application/json"}
    if request_id is not None:
        headers["X-Request-Id"] = request_id
    if authorization is not None:
        headers["Authorization"] = authorization
    status, data, content_type = _request(running.url, "POST", path, body, headers)
    assert status < 500, (status, data[:300])
    if status >= 400:
        assert content_type.startswith("application/json")
        assert json.loads(data)["error"]["code"] == status


def test_the_proxy_still_serves_after_the_fuzzing(running: Rig) -> None:
    status, data, _ = _request(running.url, "GET", "/health", None, {})
    assert status == 200 and json.loads(data)["decode"]["eligible"] == 2
    body = json.dumps({"model": "m", "prompt": "still fine", "max_tokens": 3}).encode()
    assert _request(running.url, "POST", "/v1/completions", body, {})[0] == 200
    assert running.proxy.in_flight == 0

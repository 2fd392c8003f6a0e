"""Pure parts of the proxy's data-parallel handling and of its stop sequence: the Mooncake bootstrap
server's answer per rank, the rank picked for a leg, the drain flags and their bounds, and what a
signal does to readiness and to the drain period, the event loop (no sockets: the proxy is never
started)."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import time
from typing import Any

import pytest

from xpyd.api.models import MAX_PROXY_DRAIN_SECONDS, MAX_PROXY_FINISH_SECONDS, DisaggregatedServingSpec
from xpyd.proxy import protocol
from xpyd.proxy.breaker import Breaker
from xpyd.proxy.config import ProxyConfig
from xpyd.proxy.main import (
    Stopping,
    _check,
    add_arguments,
    config_from_args,
    event_loop,
    run,
)
from xpyd.proxy.pool import Instance
from xpyd.proxy.server import Proxy
from xpyd.render.proxy import proxy_args

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("answer", "engines"), [
    ({"0": {"engine_id": "e_dp0", "worker_addr": {}}, "1": {"engine_id": "e_dp1"}}, {0: "e_dp0", 1: "e_dp1"}),
    ({"1": {"engine_id": "b"}}, {1: "b"}),
    ({"0": {"engine_id": ""}, "x": {"engine_id": "a"}, "-1": {"engine_id": "c"}, "2": "d"}, {}),
    ({"0": {"engine_id": 7}, "1": None}, {}),
    ([], {}),
    (None, {}),
])
def test_mooncake_engine_ids_per_rank(answer: Any, engines: dict[int, str]) -> None:
    assert protocol.mooncake_engine_ids(answer) == engines


def _instance() -> Instance:
    return Instance(url="http://10.0.0.1:8000", role="prefill", breaker=Breaker())


def test_an_idle_instance_spreads_legs_over_its_ranks() -> None:
    instance = _instance()
    assert sorted(instance.pick_rank([0, 1, 2]) for _ in range(6)) == [0, 0, 1, 1, 2, 2]
    assert instance.pick_rank([5]) == 5
    with pytest.raises(ValueError):
        instance.pick_rank([])


def test_the_least_busy_rank_gets_the_leg() -> None:
    instance = _instance()
    for rank in (0, 0, 1):
        instance.acquire_rank(rank)
    assert [instance.pick_rank([0, 1, 2]) for _ in range(3)] == [2, 2, 2]
    instance.acquire_rank(2)
    instance.acquire_rank(2)
    assert instance.pick_rank([0, 1, 2]) == 1
    for rank in (0, 0, 1, 2, 2):
        instance.release_rank(rank)
    assert instance.rank_outstanding == {}


def test_forget_identity_drops_the_learnt_engine_ids() -> None:
    instance = _instance()
    instance.mooncake_engines = {0: "a"}
    instance.forget_identity()
    assert instance.mooncake_engines is None


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["--prefill", "http://a", "--decode", "http://b", *argv])


@pytest.mark.parametrize(("argv", "problem"), [
    ((), None),
    (("--drain-seconds", "0", "--finish-timeout", "0.5"), None),
    (("--drain-seconds", str(MAX_PROXY_DRAIN_SECONDS)), None),
    (("--drain-seconds", "-1"), "--drain-seconds"),
    (("--drain-seconds", str(MAX_PROXY_DRAIN_SECONDS + 1)), "--drain-seconds"),
    (("--drain-seconds", "nan"), "--drain-seconds"),
    (("--finish-timeout", "0"), "--finish-timeout"),
    (("--finish-timeout", str(MAX_PROXY_FINISH_SECONDS + 1)), "--finish-timeout"),
    (("--prefill-data-parallel-size", "8"), None),
    (("--prefill-data-parallel-size", "0"), "--prefill-data-parallel-size"),
    (("--prefill-data-parallel-size", "65"), "--prefill-data-parallel-size"),
    (("--decode-tensor-parallel-size", "8", "--lmcache-init-port", "65528"), None),
    (("--decode-tensor-parallel-size", "0"), "--decode-tensor-parallel-size"),
    (("--decode-tensor-parallel-size", "65"), "--decode-tensor-parallel-size"),
    (("--decode-tensor-parallel-size", "8", "--lmcache-init-port", "65529"), "--lmcache-init-port"),
    (("--lmcache-alloc-port", "0"), "--lmcache-alloc-port"),
    (("--kv-metrics-interval", "0"), None),
    (("--kv-metrics-interval", "30"), None),
    (("--kv-metrics-interval", "0.5"), "--kv-metrics-interval"),
    (("--kv-metrics-interval", "-1"), "--kv-metrics-interval"),
    (("--kv-metrics-interval", "nan"), "--kv-metrics-interval"),
])
def test_flags_are_bounded(argv: tuple[str, ...], problem: str | None) -> None:
    message = _check(_parse(*argv))
    assert (message is None) if problem is None else (message is not None and problem in message)


@pytest.mark.parametrize(("kv", "port", "dp"), [
    ({"connector": "MooncakeConnector", "mooncake": {"bootstrapPort": 9100}}, 9100, 1),   # it asks /query
    ({"connector": "NixlPushConnector"}, protocol.MOONCAKE_BOOTSTRAP_PORT, 4),
])
def test_connector_settings_reach_the_proxy_from_the_spec(kv: dict[str, Any], port: int, dp: int) -> None:
    spec = DisaggregatedServingSpec.model_validate({
        "model": {"name": "m"}, "kvTransfer": kv, "engine": {"vllmVersion": "0.33.0"},
        "prefill": {"dataParallelSize": 4, "gpu": {"count": 4}}})
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(proxy_args("llama", "ns", spec))
    config = config_from_args(args)
    assert (config.mooncake_bootstrap_port, config.prefill_data_parallel_size) == (port, dp)
    assert _check(args) is None


def test_lmcache_flags_reach_the_config() -> None:
    config = config_from_args(_parse("--connector", "LMCacheConnectorV1", "--lmcache-init-port", "8300",
                                     "--lmcache-alloc-port", "8400", "--decode-tensor-parallel-size", "2"))
    assert (config.lmcache_init_port, config.lmcache_alloc_port, config.decode_tensor_parallel_size) == \
        (8300, 8400, 2)
    defaults = config_from_args(_parse())
    assert (defaults.lmcache_init_port, defaults.lmcache_alloc_port, defaults.decode_tensor_parallel_size) == \
        (7300, 7400, 1)


async def test_sigterm_fails_readiness_and_drains_for_the_period() -> None:
    proxy = Proxy(ProxyConfig())
    stopping = Stopping(proxy)
    assert not proxy.draining
    stopping.signalled(signal.SIGTERM)
    assert proxy.draining
    started = time.monotonic()
    await asyncio.wait_for(stopping.drain(0.3), 5)
    assert 0.25 <= time.monotonic() - started < 2.0


async def test_a_second_signal_cuts_the_drain_short() -> None:
    proxy = Proxy(ProxyConfig())
    stopping = Stopping(proxy)
    stopping.signalled(signal.SIGTERM)
    asyncio.get_running_loop().call_later(0.1, stopping.signalled, signal.SIGTERM)
    started = time.monotonic()
    await asyncio.wait_for(stopping.drain(30), 5)
    assert time.monotonic() - started < 2.0


async def test_sigint_drains_without_waiting() -> None:
    proxy = Proxy(ProxyConfig())
    stopping = Stopping(proxy)
    stopping.signalled(signal.SIGINT)
    assert proxy.draining
    await asyncio.wait_for(stopping.drain(30), 1)


async def test_no_signal_no_drain() -> None:
    stopping = Stopping(Proxy(ProxyConfig()))
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(stopping.drain(0), 0.2)
    assert not stopping.proxy.draining


def test_the_event_loop_is_uvloop_unless_asked_otherwise(monkeypatch: pytest.MonkeyPatch) -> None:
    import uvloop

    assert event_loop("auto") == ("uvloop", uvloop.new_event_loop)
    assert event_loop("uvloop") == ("uvloop", uvloop.new_event_loop)
    assert event_loop("asyncio") == ("asyncio", asyncio.new_event_loop)
    monkeypatch.setitem(sys.modules, "uvloop", None)          # not installed: import fails
    assert event_loop("auto") == ("asyncio", asyncio.new_event_loop)
    assert event_loop("uvloop") is None
    assert run(_parse("--event-loop", "uvloop")) == 2

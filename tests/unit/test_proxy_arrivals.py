"""How prompt work bunches on arrival, as the proxy measures it: the slots of `xpyd.common.bunching`
alone, the proxy's `xpyd_proxy_arrival_prompt_tokens` and `xpyd_proxy_prompt_tokens_total` as its
`/metrics` renders them (a clock of the test's own), and, through the real proxy in front of stub
engines on loopback, which requests they count."""

from __future__ import annotations

import math
import time
from typing import Any, cast

import pytest

from tests.integration.rig import COMPLETION, Rig, rig
from xpyd.common.bunching import WINDOWS_S, ArrivalSlots, window_label
from xpyd.proxy.metrics import ProxyMetrics, wall_clock
from xpyd.proxy.server import Proxy, ProxyConfig

HISTOGRAM = "xpyd_proxy_arrival_prompt_tokens"
COUNTER = "xpyd_proxy_prompt_tokens_total"


class Clock:
    """A clock the test moves by hand (seconds)."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _slots(windows: tuple[float, ...]) -> tuple[ArrivalSlots, list[tuple[float, float, int]]]:
    emitted: list[tuple[float, float, int]] = []
    return ArrivalSlots(lambda window, tokens, requests: emitted.append((window, tokens, requests)), windows), emitted


# -- the slots alone ------------------------------------------------------------------------------


@pytest.mark.unit
def test_each_window_closes_its_slots_by_itself_at_the_first_arrival_past_their_end() -> None:
    slots, emitted = _slots((1.0, 2.0))
    slots.add(0.5, 10)
    slots.add(0.9, 5)
    assert emitted == []                                          # both slots still open
    slots.add(1.2, 7)                                             # past [0, 1): the 1 s slot closes, not the 2 s one
    assert emitted == [(1.0, 15.0, 2)]
    slots.add(2.1, 3)                                             # past [1, 2) and [0, 2)
    assert emitted[1:] == [(1.0, 7.0, 1), (2.0, 22.0, 3)]
    slots.add(9.5, 4)                                             # the empty slots between are never emitted
    assert emitted[3:] == [(1.0, 3.0, 1), (2.0, 3.0, 1)]


@pytest.mark.unit
def test_flush_closes_only_the_slots_that_ended_and_nothing_twice() -> None:
    slots, emitted = _slots((1.0, 2.0))
    slots.add(2.25, 100)
    slots.add(2.75, 50)
    slots.flush(2.9)                                              # [2, 3) and [2, 4) still open
    assert emitted == []
    slots.flush(3.0)                                              # [2, 3) ended exactly now
    assert emitted == [(1.0, 150.0, 2)]
    slots.flush(3.5)
    assert emitted == [(1.0, 150.0, 2)]                           # not again
    slots.flush(4.0)
    assert emitted == [(1.0, 150.0, 2), (2.0, 150.0, 2)]
    slots.add(4.5, 20)                                            # a flushed slot is not emitted by the next arrival
    assert emitted == [(1.0, 150.0, 2), (2.0, 150.0, 2)]
    slots.add(5.0, 30)                                            # [4, 5) closes; [4, 6) holds both
    assert emitted[2:] == [(1.0, 20.0, 1)]
    slots.flush(6.0)
    assert emitted[3:] == [(1.0, 30.0, 1), (2.0, 50.0, 2)]


@pytest.mark.unit
def test_an_arrival_at_a_slot_boundary_opens_the_new_slot() -> None:
    slots, emitted = _slots((0.25,))
    slots.add(0.0, 1)
    slots.add(0.125, 2)
    slots.add(0.25, 4)                                            # the end of [0, 0.25) is the start of [0.25, 0.5)
    assert emitted == [(0.25, 3.0, 2)]
    slots.flush(0.4999)
    assert emitted == [(0.25, 3.0, 2)]
    slots.flush(0.5)
    assert emitted == [(0.25, 3.0, 2), (0.25, 4.0, 1)]


@pytest.mark.unit
def test_a_late_arrival_counts_in_the_open_slot() -> None:
    slots, emitted = _slots((1.0,))
    slots.add(3.5, 10)
    slots.add(2.5, 5)                                             # out of order: counted in [3, 4), as documented
    slots.flush(4.0)
    assert emitted == [(1.0, 15.0, 2)]


@pytest.mark.unit
@pytest.mark.parametrize("windows", [(), (0.0,), (-1.0,), (1.0, 0.0), (math.inf,), (math.nan,)])
def test_slot_lengths_must_be_positive_seconds(windows: tuple[float, ...]) -> None:
    with pytest.raises(ValueError, match="slot lengths"):
        ArrivalSlots(lambda window, tokens, requests: None, windows)


@pytest.mark.unit
def test_the_windows_and_their_labels() -> None:
    assert WINDOWS_S == (0.25, 1.0, 4.0)
    assert [window_label(w) for w in WINDOWS_S] == ["0.25", "1", "4"]
    assert ArrivalSlots(lambda window, tokens, requests: None).windows_s == WINDOWS_S


# -- the proxy's metrics ----------------------------------------------------------------------------


def _samples(text: str) -> dict[str, float]:
    """The exposition's samples by name and labels as written (`name{a="x",b="y"}`)."""
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            series, value = line.rsplit(" ", 1)
            samples[series] = float(value)
    return samples


async def _scrape(proxy: Proxy) -> dict[str, float]:
    """What the proxy's /metrics answers, rendered by its own handler."""
    response: Any = await proxy.metrics_page(cast(Any, None))  # the handler reads no request
    return _samples(response.body.decode())


def _buckets(samples: dict[str, float], window: str) -> dict[str, float]:
    prefix = HISTOGRAM + '_bucket{le="'
    suffix = f'",window="{window}"}}'
    return {series[len(prefix):-len(suffix)]: value for series, value in samples.items()
            if series.startswith(prefix) and series.endswith(suffix)}


@pytest.mark.unit
def test_the_clock_is_the_wall_clock_unless_given() -> None:
    assert ProxyMetrics().clock is wall_clock   # the wall clock at start-up, advanced monotonically
    clock = Clock(42.0)
    metrics = ProxyMetrics(clock=clock)
    metrics.arrival(10)
    clock.now = 46.0
    metrics.flush_arrivals()
    assert metrics.arrival_tokens.count("0.25") == metrics.arrival_tokens.count("4") == 1
    assert metrics.prompt_tokens.value() == 10


@pytest.mark.unit
async def test_slot_work_is_observed_once_per_request_when_the_slot_closes() -> None:
    proxy = Proxy(ProxyConfig())
    clock = Clock(0.0)
    proxy.metrics.clock = clock
    for now, tokens in ((10.0, 100), (10.1, 200), (10.3, 300), (11.2, 1000)):
        clock.now = now
        proxy.metrics.arrival(tokens)

    # At 11.2 the arrival closed 0.25 s slots [10, 10.25) (300 tokens, 2 requests) and [10.25, 10.5)
    # (300, 1), and the 1 s slot [10, 11) (600, 3); [11, 11.25), [11, 12) and the 4 s slot [8, 12) are open.
    samples = await _scrape(proxy)
    assert samples[COUNTER] == 600.0                               # counted as the 0.25 s slots close
    assert samples[HISTOGRAM + '_count{window="0.25"}'] == 3.0
    assert samples[HISTOGRAM + '_sum{window="0.25"}'] == 900.0
    assert samples[HISTOGRAM + '_count{window="1"}'] == 3.0
    assert samples[HISTOGRAM + '_sum{window="1"}'] == 1800.0
    assert HISTOGRAM + '_count{window="4"}' not in samples

    clock.now = 12.0                                              # every slot ended; no arrival closed them
    samples = await _scrape(proxy)
    assert samples[COUNTER] == 1600.0
    # 0.25 s: 300, 300, 300 and 1000 tokens; 1 s: 600 three times and 1000; 4 s: 1600 four times.
    assert samples[HISTOGRAM + '_count{window="0.25"}'] == 4.0
    assert samples[HISTOGRAM + '_sum{window="0.25"}'] == 1900.0
    assert samples[HISTOGRAM + '_count{window="1"}'] == 4.0
    assert samples[HISTOGRAM + '_sum{window="1"}'] == 2800.0
    assert samples[HISTOGRAM + '_count{window="4"}'] == 4.0
    assert samples[HISTOGRAM + '_sum{window="4"}'] == 6400.0
    quarter, second, four = (_buckets(samples, w) for w in ("0.25", "1", "4"))
    assert len(quarter) == len(second) == len(four) == 36          # 128 to 16.8M tokens by sqrt(2), and +Inf
    assert {le: quarter[le] for le in ("128.0", "256.0", "362.0", "512.0", "724.0", "1024.0", "+Inf")} == {
        "128.0": 0.0, "256.0": 0.0, "362.0": 3.0, "512.0": 3.0, "724.0": 3.0, "1024.0": 4.0, "+Inf": 4.0}
    assert {le: second[le] for le in ("512.0", "724.0", "1024.0", "1448.0", "+Inf")} == {
        "512.0": 0.0, "724.0": 3.0, "1024.0": 4.0, "1448.0": 4.0, "+Inf": 4.0}
    assert {le: four[le] for le in ("1024.0", "1448.0", "2048.0", "2896.0", "+Inf")} == {
        "1024.0": 0.0, "1448.0": 0.0, "2048.0": 4.0, "2896.0": 4.0, "+Inf": 4.0}

    clock.now = 20.0                                              # nothing observed twice
    assert await _scrape(proxy) == samples


# -- through the proxy --------------------------------------------------------------------------------


async def _metrics(r: Rig) -> dict[str, float]:
    async with r.session.get(r.url + "/metrics") as response:
        return _samples(await response.text())


@pytest.mark.integration
async def test_the_proxy_counts_the_requests_it_offers_to_the_pool_and_not_the_invalid_ones() -> None:
    clock = Clock(100.0)
    async with rig(served_model_name="m") as r:
        r.proxy.metrics.clock = clock
        assert (await r.post("/v1/completions", {**COMPLETION, "prompt": "x" * 400}))[0] == 200     # 100 tokens
        assert (await r.post("/v1/completions", b"{not json"))[0] == 400
        assert (await r.post("/v1/completions", {**COMPLETION, "model": "other"}))[0] == 404
        assert (await r.post("/v1/completions", {**COMPLETION, "max_tokens": 0}))[0] == 400
        samples = await _metrics(r)
        assert samples[COUNTER] == 0.0                                            # its slots are still open
        assert HISTOGRAM + '_count{window="0.25"}' not in samples
        clock.now = 104.0
        samples = await _metrics(r)
        assert samples[COUNTER] == 100.0
        for window in ("0.25", "1", "4"):
            assert samples[HISTOGRAM + f'_count{{window="{window}"}}'] == 1.0
            assert samples[HISTOGRAM + f'_sum{{window="{window}"}}'] == 100.0


@pytest.mark.integration
async def test_a_request_held_in_the_waiting_room_counts_even_when_it_expires() -> None:
    async with rig(engines=([], []), wait_timeout=0.2) as r:
        clock = Clock(100.0)
        r.proxy.metrics.clock = clock
        status, answer, _ = await r.post("/v1/completions", {**COMPLETION, "prompt": "y" * 40})   # 10 tokens
        assert (status, answer["error"]["code"]) == (503, 503)
        clock.now = 101.0
        assert (await _metrics(r))[COUNTER] == 10.0


@pytest.mark.unit
def test_the_wall_clock_follows_the_monotonic_clock_not_a_stepped_wall_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    monotonic = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: monotonic[0])
    before = wall_clock()
    monkeypatch.setattr(time, "time", lambda: 0.0)   # the wall clock stepped back to the epoch
    monotonic[0] += 2.5
    assert wall_clock() == pytest.approx(before + 2.5, abs=1e-6)

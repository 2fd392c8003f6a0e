"""The open-loop run of `xpyd bench`, and its library entry points `run_bench` / `run_bench_sync`.

Open loop: every request is sent at its arrival time whether or not earlier ones were answered, so
a slow server shows up as latency and failures, never as a lower offered load. Requests beyond
`max_concurrency` in flight are not queued (that would quietly turn the load closed-loop): they are
recorded at once as failed with `error_kind` `dropped`. The run stops by itself: after the last
arrival (bounded by the trace window, `duration_s` and `max_requests`) it waits for the requests in
flight, each bounded by `timeout_s`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from xpyd.bench.client import send_completion
from xpyd.bench.load import Arrival, completion_body, poisson_arrivals, trace_arrivals
from xpyd.bench.report import RequestRecord, SloMs, build_report, summarize
from xpyd.common.netguard import NonLoopbackAddress, require_loopback_url
from xpyd.traces import TraceError, TraceRequest, load_trace

log = logging.getLogger(__name__)

KEEPALIVE_S = 4.0
"""Idle connections are closed before uvicorn's (vLLM's) 5 s keep-alive would reset them."""
MODELS_TIMEOUT_S = 10.0


class BenchError(ValueError):
    """A run that cannot start: bad configuration, an unreadable trace, no model to ask for."""


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark run. The load is exactly one of `trace`, `rate_rps` or `requests`.

    - `trace`: a trace file (Azure CSV or Mooncake JSONL); `start_s` and `duration_s` choose a window
      in trace seconds (as `xpyd sim` does) and `speedup` compresses it: the run lasts about
      `duration_s / speedup` wall seconds.
    - `rate_rps`: a Poisson load of `isl`-token prompts and `osl`-token answers for `duration_s` wall
      seconds and/or `max_requests` requests.
    - `requests`: an explicit workload, arrival times in wall seconds from the start (for callers
      that shape their own load).

    `url` is the server's base URL (`/v1/completions` is appended unless the URL already ends in
    `/completions`). `model` None: the first model `/v1/models` lists. `loopback_only`: refuse a URL
    outside 127.0.0.0/8 (for tests on machines whose only permitted network is loopback).
    """

    url: str
    model: str | None = None
    trace: str | Path | None = None
    rate_rps: float | None = None
    requests: Sequence[TraceRequest] | None = None
    isl: int = 1024
    osl: int = 128
    speedup: float = 1.0
    start_s: float = 0.0
    duration_s: float | None = None
    max_requests: int | None = None
    max_concurrency: int = 1024
    timeout_s: float = 600.0
    api_key: str | None = None
    slo: SloMs = field(default_factory=SloMs)
    seed: int = 0
    loopback_only: bool = False

    def __post_init__(self) -> None:
        loads = [name for name, value in (("trace", self.trace), ("rate", self.rate_rps),
                                          ("requests", self.requests)) if value is not None]
        if len(loads) != 1:
            raise BenchError("give exactly one load: a trace, a rate (synthetic Poisson load) or requests"
                             + (f", not {' and '.join(loads)}" if loads else ""))
        if self.trace is None and (self.speedup != 1.0 or self.start_s != 0.0):
            raise BenchError("speedup and start apply to a trace only")
        for name, value in (("max_requests", self.max_requests), ("max_concurrency", self.max_concurrency)):
            if value is not None and value < 1:
                raise BenchError(f"{name.replace('_', '-')} must be at least 1, not {value}")
        if not self.timeout_s > 0 or not math.isfinite(self.timeout_s):
            raise BenchError(f"timeout must be a positive number of seconds, not {self.timeout_s}")
        if self.duration_s is not None and not self.duration_s > 0:
            raise BenchError(f"duration must be a positive number of seconds, not {self.duration_s}")
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise BenchError(f"url must be an http(s) URL like http://127.0.0.1:8000, not {self.url!r}")

    @property
    def completions_url(self) -> str:
        """The URL requests are posted to."""
        base = self.url.rstrip("/")
        return base if base.endswith("/completions") else base + "/v1/completions"

    @property
    def models_url(self) -> str:
        """The URL of the server's model list."""
        return self.completions_url.removesuffix("/completions").removesuffix("/v1") + "/v1/models"

    def describe(self) -> dict[str, Any]:
        """The configuration as JSON-ready data for the report (no API key)."""
        return {"url": self.completions_url, "model": self.model,
                "trace": str(self.trace) if self.trace is not None else None, "rate_rps": self.rate_rps,
                "isl": self.isl if self.rate_rps is not None else None,
                "osl": self.osl if self.rate_rps is not None else None,
                "speedup": self.speedup, "start_s": self.start_s, "duration_s": self.duration_s,
                "max_requests": self.max_requests, "max_concurrency": self.max_concurrency,
                "timeout_s": self.timeout_s, "seed": self.seed,
                "slo_ttft_ms": self.slo.ttft_ms, "slo_tpot_ms": self.slo.tpot_ms}


def plan_arrivals(config: BenchConfig) -> list[Arrival]:
    """The run's arrivals: the trace's window, the Poisson load or the given requests; BenchError when
    the trace cannot be read or the window is empty."""
    if config.rate_rps is not None:
        try:
            return poisson_arrivals(config.rate_rps, config.isl, config.osl, duration_s=config.duration_s,
                                    max_requests=config.max_requests, seed=config.seed)
        except ValueError as error:
            raise BenchError(str(error)) from None
    if config.requests is not None:
        requests = [r for r in config.requests if config.duration_s is None or r.arrival_s < config.duration_s]
        if not requests:
            raise BenchError("no requests to send")
        return trace_arrivals(requests, config.max_requests)
    assert config.trace is not None
    try:
        window = load_trace(config.trace, speedup=config.speedup, start_s=config.start_s,
                            duration_s=config.duration_s)
    except (TraceError, ValueError) as error:
        raise BenchError(str(error)) from None
    return trace_arrivals(window, config.max_requests)


@dataclass(frozen=True)
class BenchResult:
    """A finished run: every request's record (by arrival), the summary, and what was run."""

    config: BenchConfig
    model: str | None
    records: tuple[RequestRecord, ...]
    summary: Mapping[str, Any]
    wall_s: float

    @property
    def attainment(self) -> float:
        """Share of requests that succeeded within both SLOs (0-1)."""
        return float(self.summary["attainment"])

    def report(self) -> dict[str, Any]:
        """The `--report` JSON: the summary, the configuration and the per-request records."""
        return build_report(self.summary, self.records, {**self.config.describe(), "model": self.model})


async def discover_model(session: aiohttp.ClientSession, models_url: str) -> str:
    """The first model id `/v1/models` lists; BenchError when there is none to be had."""
    try:
        async with session.get(models_url, timeout=aiohttp.ClientTimeout(total=MODELS_TIMEOUT_S)) as response:
            payload = await response.json(content_type=None) if response.status == 200 else None
            status = response.status
    except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as error:
        raise BenchError(f"cannot list the models at {models_url} ({type(error).__name__}: {error}); "
                         "give --model") from None
    data = payload.get("data") if isinstance(payload, dict) else None
    if not isinstance(data, list) or not data or not isinstance(data[0], dict) or "id" not in data[0]:
        raise BenchError(f"{models_url} lists no model (HTTP {status}); give --model")
    return str(data[0]["id"])


def _dropped(arrival: Arrival, sent_s: float, limit: int) -> RequestRecord:
    return RequestRecord(arrival.index, arrival.at_s, sent_s, arrival.isl, arrival.osl, ok=False,
                         error_kind="dropped", error=f"{limit} requests already in flight (--max-concurrency)")


async def run_bench(config: BenchConfig, on_result: Callable[[RequestRecord], None] | None = None,
                    stop: asyncio.Event | None = None) -> BenchResult:
    """Run the load against `config.url` and measure it.

    `on_result` is called with each record as its request finishes (or is dropped), in completion
    order, for live views; its exceptions are logged, never raised. Setting `stop` ends the arrivals
    early; requests in flight still finish. Raises BenchError before sending anything when the run
    cannot start; connection failures and server errors are counted in the records instead.
    """
    arrivals = plan_arrivals(config)
    if config.loopback_only:
        try:
            require_loopback_url(config.url)
        except NonLoopbackAddress as error:
            raise BenchError(str(error)) from None
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    records: list[RequestRecord] = []
    in_flight: set[asyncio.Task[None]] = set()

    def finish(record: RequestRecord) -> None:
        records.append(record)
        if on_result is not None:
            try:
                on_result(record)
            except Exception:
                log.exception("the on_result callback failed on request %d", record.index)

    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S)
    timeout = aiohttp.ClientTimeout(total=config.timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, headers=headers) as session:
        model = config.model if config.model is not None else await discover_model(session, config.models_url)
        origin = time.perf_counter()

        async def one(arrival: Arrival) -> None:
            body = completion_body(arrival, model, config.seed)
            finish(await send_completion(session, config.completions_url, body, arrival, origin))

        try:
            for arrival in arrivals:
                delay = origin + arrival.at_s - time.perf_counter()
                if stop is None:
                    await asyncio.sleep(max(delay, 0.0))
                elif delay > 0:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), delay)
                if stop is not None and stop.is_set():
                    break
                if len(in_flight) >= config.max_concurrency:
                    finish(_dropped(arrival, time.perf_counter() - origin, config.max_concurrency))
                    continue
                task = asyncio.create_task(one(arrival), name=f"xpyd-bench-{arrival.index}")
                in_flight.add(task)
                task.add_done_callback(in_flight.discard)
            if in_flight:
                await asyncio.gather(*in_flight)
        finally:
            for task in in_flight:
                task.cancel()
        wall_s = time.perf_counter() - origin
    ordered = tuple(sorted(records, key=lambda r: r.index))
    return BenchResult(config, model, ordered, summarize(ordered, config.slo, wall_s), wall_s)


def run_bench_sync(config: BenchConfig, on_result: Callable[[RequestRecord], None] | None = None) -> BenchResult:
    """`run_bench` in a fresh event loop, for callers without one."""
    return asyncio.run(run_bench(config, on_result))

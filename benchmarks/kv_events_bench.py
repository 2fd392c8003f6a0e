"""KVAware routing's Events index against the engines' own caches, and how late it is (issue 29's
targets: the index agrees with the engines' caches on at least 99% of blocks; event-to-index lag p99
under 50 ms).

A slice of the Mooncake trace (`xpyd bench --trace`, its prompts sharing text where `hash_ids` share
blocks, time-compressed) goes through the proxy's KVAware policy with the Events index, run in this
process (its aiohttp app and its ZMQ subscribers on one event loop, uvloop where installed, as `xpyd
proxy` runs), in front of `xpyd engine-sim` processes on their own loopback addresses, each
publishing its KV events (PUB and replay sockets) as vLLM does. The prefill engines are given a small
KV cache (`--num-gpu-blocks-override`) so that they evict all along: the index must follow removals
as well as stores.

- Agreement: every `--sample-s` seconds during the replay, and once after it when every engine is
  idle, each engine's cached prompt blocks (`GET /xpyd/kv/blocks`, the emulator's pool as its KV
  events name the blocks) are compared with the proxy's index of that engine, read the moment the
  answer arrives: agreement is the blocks both hold over the blocks either holds. During the replay
  an answer includes the step under way, whose events are not out yet, and the index has what
  arrived since the answer left, so the samples count the lag's disagreement too; after the replay
  there is none left to count.
- Lag: for every batch the proxy applies, the time from the engine's step (the batch's timestamp)
  to the index holding it (`xpyd_proxy_kv_event_lag_seconds`, each observation kept here). It counts
  whatever holds the proxy's event loop: requests with 100,000-token prompts (their JSON, hashing),
  steps that evict thousands of blocks, and this process's full garbage collections, which walk the
  50,000 objects the proxy's imports leave (aiohttp, the Kubernetes client, pydantic) for 20-40 ms
  each unless they are frozen out of the collector's way (`gc.freeze()` once the proxy is set up, as
  `xpyd proxy` does once it listens; `--no-gc-freeze` shows what that saves), and the full
  collections are printed either way. Everything shares this machine's CPUs with the
  engines and the load generator.

    python benchmarks/kv_events_bench.py [--requests 600] [--start 782.145] [--speedup 2] [--time-scale 2]
                                         [--no-gc-freeze] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from array import array
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from xpyd.api.models import KVIndex, RoutingPolicy
from xpyd.proxy.config import ProxyConfig
from xpyd.proxy.discovery import static_endpoints
from xpyd.proxy.kvaware import KVAwareSettings
from xpyd.proxy.server import Proxy
from xpyd.testing.ports import common_ports

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / "data" / "traces" / "mooncake_synthetic.jsonl"
MODEL = "llama-8b"
BLOCK = 16
TOPIC = "kv-events"


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def quantile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass
class Engine:
    role: str
    host: str
    url: str
    process: subprocess.Popen[bytes]


@contextmanager
def engines(args: argparse.Namespace, log: Path) -> Iterator[tuple[list[Engine], int]]:
    """The engine-sim processes, on 127.0.0.21 and up, and their KV events port."""
    roles = ["prefill"] * args.prefill + ["decode"] * args.decode
    hosts = [f"127.0.0.{21 + i}" for i in range(len(roles))]
    http, side, events = common_ports(hosts, 3)
    config = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{events}",
                         "replay_endpoint": f"tcp://*:{events + 100}", "topic": TOPIC})
    started: list[Engine] = []
    try:
        for role, host in zip(roles, hosts, strict=True):
            argv = [sys.executable, "-m", "xpyd.cli", "engine-sim", "--role", role, "--host", host, "--port",
                    str(http), "--served-model-name", MODEL, "--time-scale", str(args.time_scale), "--max-model-len",
                    str(args.max_model_len), "--kv-events-config", config]
            if role == "prefill":
                argv += ["--num-gpu-blocks-override", str(args.prefill_blocks)]
            out = (log / f"{role}-{host}.log").open("w")
            process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                       env={**os.environ, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side)})
            started.append(Engine(role, host, f"http://{host}:{http}", process))
        yield started, events
    finally:
        for engine in started:
            engine.process.terminate()
        for engine in started:
            try:
                engine.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                engine.process.kill()
                engine.process.wait()


@dataclass
class Sample:
    at_s: float
    url: str
    engine: int
    index: int
    both: int

    @property
    def agreement(self) -> float:
        either = self.engine + self.index - self.both
        return 1.0 if either == 0 else self.both / either


@dataclass
class Run:
    lags_s: dict[str, list[float]] = field(default_factory=lambda: {"prefill": [], "decode": []})
    samples: list[Sample] = field(default_factory=list)
    final: list[Sample] = field(default_factory=list)
    duplicated: int = 0
    #: Full collections of this process's garbage collector during the replay, each its seconds.
    full_collections_s: list[float] = field(default_factory=list)


async def wait_healthy(session: aiohttp.ClientSession, started: list[Engine], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    for engine in started:
        while True:
            if engine.process.poll() is not None:
                raise RuntimeError(f"engine-sim at {engine.url} exited ({engine.process.returncode})")
            try:
                async with session.get(engine.url + "/health") as response:
                    if response.status == 200:
                        break
            except aiohttp.ClientError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"engine-sim at {engine.url} never became healthy")
            await asyncio.sleep(0.1)


async def compare(session: aiohttp.ClientSession, proxy: Proxy, engine: Engine, started: float,
                  run: Run) -> tuple[Sample, int]:
    """One engine's cached blocks against the proxy's index of it, read as the answer arrives; and the
    engine's KV event batches so far."""
    async with session.get(engine.url + "/xpyd/kv/blocks", params={"format": "u64"}) as response:
        body = await response.read()
        duplicated, batches = int(response.headers["X-KV-Duplicated"]), int(response.headers["X-KV-Batches"])
    keys = array("Q", body)
    if sys.byteorder == "little":
        keys.byteswap()   # big-endian on the wire
    cached = set(keys)
    assert proxy.kv is not None
    indexes = proxy.kv.router.indexes.get(engine.url) or []
    # PrefixIndex has no public listing: its runs, each one block of token-id keys, are its keys.
    indexed = set(indexes[0]._held) if indexes else set()
    run.duplicated = max(run.duplicated, duplicated)
    sample = Sample(time.monotonic() - started, engine.url, len(cached), len(indexed), len(cached & indexed))
    return sample, batches


async def replay(args: argparse.Namespace, started: list[Engine], events_port: int, report: Path) -> Run:
    run = Run()
    kv = KVAwareSettings(index=KVIndex.EVENTS, block_size=BLOCK, events_port=events_port,
                         events_replay_port=events_port + 100, events_topic=TOPIC)
    proxy = Proxy(ProxyConfig(routing_policy=RoutingPolicy.KV_AWARE, served_model_name=MODEL, kv=kv,
                              health_interval=0.5, seed=0))
    runner = web.AppRunner(proxy.app(), access_log=None, handler_cancellation=True, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    proxy_url = f"http://127.0.0.1:{port}"
    prefills = [e for e in started if e.role == "prefill"]
    decodes = [e for e in started if e.role == "decode"]
    proxy.set_endpoints("prefill", static_endpoints([e.url for e in prefills]))
    proxy.set_endpoints("decode", static_endpoints([e.url for e in decodes]))
    assert proxy.kv is not None and proxy.kv.hub is not None
    lag = proxy.kv.hub.metrics.lag
    observe = lag.observe

    def keep(value: float, *labels: str) -> None:
        run.lags_s[labels[0]].append(value)
        observe(value, *labels)

    lag.observe = keep  # type: ignore[method-assign]
    if args.gc_freeze:
        gc.freeze()   # what the process holds from its start-up leaves the collector's generations
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=2.0)
    try:
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as session:
            deadline = time.monotonic() + 30
            while any(pool.counts()["eligible"] < n for pool, n in ((proxy.pools["prefill"], len(prefills)),
                                                                     (proxy.pools["decode"], len(decodes)))):
                if time.monotonic() > deadline:
                    raise RuntimeError("the proxy never saw every engine healthy")
                await asyncio.sleep(0.1)
            bench = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "xpyd.cli", "bench", "--url", proxy_url, "--model", MODEL, "--trace", str(TRACE),
                "--start", str(args.start), "--max-requests", str(args.requests), "--speedup", str(args.speedup),
                "--max-concurrency", "512", "--timeout", "120", "--loopback-only", "--report", str(report),
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            started_at = time.monotonic()
            collecting: list[float] = []

            def timed(phase: str, info: dict[str, Any]) -> None:
                if info["generation"] == 2:
                    if phase == "start":
                        collecting[:] = [time.perf_counter()]
                    elif collecting:
                        run.full_collections_s.append(time.perf_counter() - collecting[0])

            gc.callbacks.append(timed)
            rng = random.Random(0)
            while bench.returncode is None:
                try:
                    await asyncio.wait_for(bench.wait(), args.sample_s * rng.uniform(0.5, 1.5))
                except TimeoutError:
                    for engine in started:
                        sample, _ = await compare(session, proxy, engine, started_at, run)
                        run.samples.append(sample)
            gc.callbacks.remove(timed)
            # Every request answered: no step runs, every batch is out. Compare once the index has
            # every batch the engines published (the batch count stays put).
            for engine in started:
                for _ in range(100):
                    await asyncio.sleep(0.05)
                    sample, batches = await compare(session, proxy, engine, started_at, run)
                    _, again = await compare(session, proxy, engine, started_at, run)
                    if batches == again and sample.agreement == 1.0:
                        break
                run.final.append(sample)
    finally:
        await runner.cleanup()
    return run


def summarize(args: argparse.Namespace, run: Run, report: dict[str, Any], wall_s: float) -> dict[str, Any]:
    summary = report.get("summary", report)
    requests, failed = int(summary.get("requests", 0)), int(summary.get("failed", 0))
    say(f"replay: {requests} requests of mooncake_synthetic.jsonl from {args.start:g} s at x{args.speedup:g}, "
        f"{failed} failed, {wall_s:.1f} s; engines at time scale {args.time_scale:g}, prefill KV "
        f"{args.prefill_blocks - 1:,} blocks of {BLOCK}")
    out: dict[str, Any] = {"requests": requests, "failed": failed, "wall_s": round(wall_s, 1),
                           "start_s": args.start, "speedup": args.speedup, "time_scale": args.time_scale,
                           "prefill": args.prefill, "decode": args.decode, "prefill_blocks": args.prefill_blocks}
    say("\nagreement of the index with the engine's cache (blocks both hold / blocks either holds)")
    say(f"{'':28} {'during the replay':>32}   {'after it':>24}")
    say(f"{'engine':28} {'samples':>8} {'min':>7} {'pooled':>7} {'blocks':>8}   {'agreement':>10} {'blocks':>8}")
    rows = []
    for final in run.final:
        during = [s for s in run.samples if s.url == final.url]
        agreements = [s.agreement for s in during] or [1.0]
        both_during = sum(s.both for s in during)
        either_during = sum(s.engine + s.index - s.both for s in during)
        pooled = 1.0 if either_during == 0 else both_during / either_during
        row = {"engine": final.url, "samples": len(during), "min": round(min(agreements), 5),
               "pooled": round(pooled, 5), "blocks_during": either_during, "final": round(final.agreement, 5),
               "final_blocks": final.engine, "final_index_blocks": final.index}
        rows.append(row)
        say(f"{final.url:28} {len(during):8d} {min(agreements):7.2%} {pooled:7.2%} {either_during:8,d}   "
            f"{final.agreement:10.2%} {final.engine:8,d}")
    all_both = sum(s.both for s in run.samples)
    all_either = sum(s.engine + s.index - s.both for s in run.samples)
    out["agreement"] = {"engines": rows, "during": round(all_both / all_either, 5) if all_either else 1.0,
                        "after": round(sum(s.both for s in run.final) /
                                       max(1, sum(s.engine + s.index - s.both for s in run.final)), 5),
                        "duplicated_blocks_max": run.duplicated}
    say(f"all engines: {out['agreement']['during']:.2%} of {all_either:,} block-samples during the replay, "
        f"{out['agreement']['after']:.2%} after it; at most {run.duplicated} blocks cached twice on one engine")
    say("\nevent-to-index lag (the batch's timestamp to the index holding it)")
    out["lag_ms"] = {}
    for role, lags in run.lags_s.items():
        if not lags:
            continue
        figures = {"batches": len(lags), "p50": round(1e3 * quantile(lags, 0.5), 2),
                   "p99": round(1e3 * quantile(lags, 0.99), 2), "max": round(1e3 * max(lags), 2)}
        out["lag_ms"][role] = figures
        say(f"{role:8} {figures['batches']:7,d} batches  p50 {figures['p50']:6.2f} ms  p99 {figures['p99']:6.2f} ms  "
            f"max {figures['max']:7.2f} ms")
    pauses = sorted(run.full_collections_s)
    out["full_collections"] = {"count": len(pauses), "gc_freeze": args.gc_freeze,
                               "p50_ms": round(1e3 * quantile(pauses, 0.5), 2) if pauses else None,
                               "max_ms": round(1e3 * pauses[-1], 2) if pauses else None}
    if pauses:
        say(f"the proxy process's full garbage collections during the replay: {len(pauses)}, p50 "
            f"{1e3 * quantile(pauses, 0.5):.1f} ms, max {1e3 * pauses[-1]:.1f} ms (each holds the event loop)"
            + (" with gc.freeze() after start-up" if args.gc_freeze else ""))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=600, help="requests of the trace to replay (default 600)")
    parser.add_argument("--start", type=float, default=782.145, help="trace seconds to start at (default 782.145, "
                        "request 3,000: prompts sharing more blocks than the trace's start)")
    parser.add_argument("--speedup", type=float, default=2.0, help="time compression of the trace (default 2)")
    parser.add_argument("--time-scale", type=float, default=2.0, help="the engines' --time-scale (default 2: "
                        "the engines' steps, which each cost CPU, come as often as on a GPU twice as fast)")
    parser.add_argument("--prefill", type=int, default=4, help="prefill engines (default 4)")
    parser.add_argument("--decode", type=int, default=1, help="decode engines (default 1)")
    parser.add_argument("--prefill-blocks", type=int, default=25_001, help="the prefill engines' "
                        "--num-gpu-blocks-override (default 25,001: 400,000 tokens, so they evict)")
    parser.add_argument("--max-model-len", type=int, default=200_000, help="the engines' --max-model-len")
    parser.add_argument("--sample-s", type=float, default=5.0, help="seconds between samples of the agreement")
    parser.add_argument("--gc-freeze", action=argparse.BooleanOptionalAction, default=True,
                        help="gc.freeze() once the proxy is set up, as `xpyd proxy` does (default): its start-up "
                        "objects (some 50,000: aiohttp, the Kubernetes client, pydantic) are no longer walked by "
                        "every full collection, which otherwise holds the event loop 20-40 ms")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here as JSON")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kv-events-bench-") as directory:
        log = Path(directory)
        with engines(args, log) as (started, events_port):
            async def go() -> tuple[Run, float]:
                async with aiohttp.ClientSession() as session:
                    await wait_healthy(session, started)
                began = time.monotonic()
                result = await replay(args, started, events_port, log / "bench.json")
                return result, time.monotonic() - began

            try:
                import uvloop
                run, wall_s = uvloop.run(go())
            except ImportError:
                run, wall_s = asyncio.run(go())
        report = json.loads((log / "bench.json").read_text()) if (log / "bench.json").exists() else {}
    figures = summarize(args, run, report, wall_s)
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

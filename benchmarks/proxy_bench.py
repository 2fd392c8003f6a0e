"""What the xPyD proxy costs, against stub engines that answer at once (`xpyd.testing.stubengine`), on
this machine: requests per second and the latency the proxy adds over calling the decode engine
directly (p50/p99), unstreamed and streamed (64 tokens), at 1, 64 and 512 concurrent clients;
then the proxy's memory over a bounded soak.

    python benchmarks/proxy_bench.py [--seconds 3] [--stacks xpyd,xpyd+asyncio,aiohttp,starlette]
                                     [--soak-seconds 60]

Stacks, each a separate process in front of the same engines, sending the NIXL pull protocol
(prefill leg, then decode with the prefill's `kv_transfer_params`):

- `xpyd`: the proxy as deployed (`python -m xpyd.proxy`: aiohttp server and client, uvloop).
- `xpyd+asyncio`: the same code on asyncio's own loop (`--event-loop asyncio`).
- `aiohttp`: a bare aiohttp forwarder with the same two legs and nothing else (no checks, picking,
  retries or metrics): what the HTTP stack alone costs.
- `starlette`: the same bare forwarder on uvicorn + starlette + httpx (only if installed), the
  stack vLLM's own example proxies use.

Clients are closed loops (each sends its next request when the last one finished), so at high
concurrency latency is mostly queueing; "added" is p(stack) - p(direct) at the same concurrency,
where `direct` calls the decode engine alone. The NIXL pull protocol itself costs a whole extra
round trip (the prefill leg, before decode can start), so `direct P+D` is a client that makes both
legs itself, one after the other, and "own" is p(stack) - p(direct P+D): what the proxy's hop and
its work cost on top of the protocol.
A paced row (64 clients sharing `--paced-rps`, below saturation) shows the added latency without
queueing. Engines, proxy and the load generator share this machine's cores: the figures are for
comparison, not capacity planning.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp
from procstats import rss_kib

from xpyd.cluster.controlplane import free_port
from xpyd.proxy import protocol

HOST = "127.0.0.1"
PROMPT = "the quick brown fox jumps over the lazy dog " * 12
STREAM_TOKENS = 64
UNSTREAMED_TOKENS = 16


# -- the bare forwarders (run in their own processes) ---------------------------------------------


def _serve_aiohttp(port: int, prefill: str, decode: str) -> None:
    from aiohttp import web

    from xpyd.proxy import protocol

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        session: aiohttp.ClientSession = request.app["session"]
        headers = {"X-Request-Id": str(uuid.uuid4()), "Content-Type": "application/json"}
        leg = json.dumps(protocol.prefill_body(body, protocol.NIXL_PREFILL_PARAMS))
        async with session.post(prefill + "/v1/completions", data=leg, headers=headers) as answer:
            params = (await answer.json()).get("kv_transfer_params")
        leg = json.dumps(protocol.decode_body(body, params))
        async with session.post(decode + "/v1/completions", data=leg, headers=headers) as upstream:
            if not body.get("stream"):
                return web.Response(body=await upstream.read(), content_type="application/json")
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    async def start(app: web.Application) -> None:
        app["session"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=4))

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.on_startup.append(start)
    web.run_app(app, host=HOST, port=port, access_log=None, print=None)


def _serve_starlette(port: int, prefill: str, decode: str) -> None:
    import httpx
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response, StreamingResponse
    from starlette.routing import Route

    from xpyd.proxy import protocol

    client = httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=None,
                                                                 max_keepalive_connections=None, keepalive_expiry=4))

    async def completions(request: Request) -> Response:
        body = await request.json()
        headers = {"X-Request-Id": str(uuid.uuid4())}
        answer = await client.post(prefill + "/v1/completions", headers=headers,
                                   json=protocol.prefill_body(body, protocol.NIXL_PREFILL_PARAMS))
        leg = protocol.decode_body(body, answer.json().get("kv_transfer_params"))
        if not body.get("stream"):
            upstream = await client.post(decode + "/v1/completions", json=leg, headers=headers)
            return Response(upstream.content, media_type="application/json")
        upstream = await client.send(client.build_request("POST", decode + "/v1/completions", json=leg,
                                                          headers=headers), stream=True)

        async def relay() -> Any:
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            finally:
                await upstream.aclose()

        return StreamingResponse(relay(), media_type="text/event-stream")

    app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])
    uvicorn.run(app, host=HOST, port=port, log_level="warning", access_log=False)


SERVERS = {"aiohttp": _serve_aiohttp, "starlette": _serve_starlette}


# -- orchestration ----------------------------------------------------------------------------------


def _available(stack: str) -> bool:
    needs = {"starlette": ("uvicorn", "starlette", "httpx")}.get(stack, ())
    return all(importlib.util.find_spec(module) is not None for module in needs)


@contextlib.contextmanager
def _process(argv: list[str]) -> Iterator[subprocess.Popen[bytes]]:
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield process
    finally:
        process.send_signal(signal.SIGINT)  # the proxy drains on SIGTERM; SIGINT stops it at once
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _wait(url: str, path: str = "/health", timeout: float = 30.0) -> None:
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + path, timeout=1):
                return
        except urllib.error.HTTPError:
            return  # it answers
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{url} did not come up")


def _stack_argv(stack: str, port: int, prefill: str, decode: str) -> list[str]:
    if stack in ("xpyd", "xpyd+asyncio"):
        loop = "asyncio" if stack == "xpyd+asyncio" else "uvloop"
        return [sys.executable, "-m", "xpyd.proxy", "--host", HOST, "--port", str(port), "--prefill", prefill,
                "--decode", decode, "--max-concurrency", "100000", "--event-loop", loop]
    return [sys.executable, __file__, "serve", stack, str(port), prefill, decode]


@dataclass
class Result:
    """One measurement cell."""

    rps: float
    p50_ms: float
    p99_ms: float
    errors: int


def _percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * share))] * 1000


async def _measure(url: str, clients: int, stream: bool, seconds: float, paced_rps: float | None = None,
                   prefill: str | None = None) -> Result:
    """Latency and throughput of `clients` clients posting to `url` (with `prefill`: a prefill leg
    there first, and its `kv_transfer_params` in the request to `url`, as the proxy does)."""
    request = {"model": "m", "prompt": PROMPT, "stream": stream,
               "max_tokens": STREAM_TOKENS if stream else UNSTREAMED_TOKENS}
    body = json.dumps(request).encode()
    prefill_body = json.dumps(protocol.prefill_body(request, protocol.NIXL_PREFILL_PARAMS)).encode()
    headers = {"Content-Type": "application/json"}
    latencies: list[float] = []
    errors = 0
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=4)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as session:
        warmup_end = time.monotonic() + min(1.0, seconds / 3)
        end = warmup_end + seconds
        interval = clients / paced_rps if paced_rps else 0.0

        async def client(index: int) -> None:
            nonlocal errors
            next_send = time.monotonic() + (interval * index / clients if interval else 0.0)
            while (now := time.monotonic()) < end:
                if interval:
                    if next_send > now:
                        await asyncio.sleep(next_send - now)
                    next_send += interval
                started = time.monotonic()
                try:
                    data = body
                    if prefill is not None:
                        async with session.post(prefill + "/v1/completions", data=prefill_body,
                                                headers=headers) as response:
                            answer = await response.json()
                        data = json.dumps(protocol.decode_body(request, answer.get("kv_transfer_params"))).encode()
                    async with session.post(url + "/v1/completions", data=data, headers=headers) as response:
                        await response.read()
                        ok = response.status == 200
                except aiohttp.ClientError:
                    ok = False
                finished = time.monotonic()
                if warmup_end <= finished <= end:  # completions inside the measured window count
                    if ok:
                        latencies.append(finished - started)
                    else:
                        errors += 1

        await asyncio.gather(*(client(i) for i in range(clients)))
    if not latencies:
        return Result(0.0, float("nan"), float("nan"), errors)
    return Result(len(latencies) / seconds, _percentile(latencies, 0.5), _percentile(latencies, 0.99), errors)


async def _soak(url: str, pid: int, seconds: float, clients: int) -> list[tuple[float, int]]:
    samples: list[tuple[float, int]] = []
    started = time.monotonic()

    async def sample() -> None:
        while time.monotonic() - started < seconds:
            samples.append((time.monotonic() - started, rss_kib(pid)))
            await asyncio.sleep(max(1.0, seconds / 12))

    sampler = asyncio.ensure_future(sample())
    half = seconds / 2
    await _measure(url, clients, False, half)
    await _measure(url, clients, True, seconds - half - 1)
    await sampler
    samples.append((time.monotonic() - started, rss_kib(pid)))
    return samples


def main() -> int:
    """Print the comparison table and the soak."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=3.0, help="measured seconds per cell (after a warm-up)")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 64, 512])
    parser.add_argument("--stacks", default="xpyd,xpyd+asyncio,aiohttp,starlette",
                        help="comma-separated: xpyd, xpyd+asyncio, aiohttp, starlette")
    parser.add_argument("--paced-rps", type=float, default=400.0, help="offered load of the paced 64-client row")
    parser.add_argument("--soak-seconds", type=float, default=60.0, help="memory soak of the xpyd proxy (600 for "
                        "ten minutes; 0 skips it)")
    parser.add_argument("--no-table", action="store_true", help="only the soak")
    args = parser.parse_args()
    stacks = [s for s in args.stacks.split(",") if s]
    skipped = [s for s in stacks if not _available(s)]
    stacks = [s for s in stacks if s not in skipped]
    prefill_port, decode_port = free_port(), free_port()
    prefill, decode = f"http://{HOST}:{prefill_port}", f"http://{HOST}:{decode_port}"
    out = sys.stdout
    stub = [sys.executable, "-m", "xpyd.testing.stubengine", "--host", HOST, "--port"]
    with _process([*stub, str(prefill_port)]), _process([*stub, str(decode_port)]):
        _wait(prefill)
        _wait(decode)
        rows: list[tuple[str, int, str, Result]] = []
        direct: dict[tuple[str, int], Result] = {}
        both_legs: dict[tuple[str, int], Result] = {}
        cells = [] if args.no_table else [(mode, clients) for mode in ("unstreamed", "stream64")
                                          for clients in args.clients]
        # Every stack runs at once and each cell measures the direct baseline and then every stack, so a
        # change in the machine's background load hits all of them alike (an idle proxy costs only its
        # health probes).
        urls = {stack: f"http://{HOST}:{free_port()}" for stack in (stacks if cells else [])}
        with contextlib.ExitStack() as running:
            for stack, url in urls.items():
                running.enter_context(_process(_stack_argv(stack, int(url.rsplit(":", 1)[1]), prefill, decode)))
            for stack, url in urls.items():
                _wait(url, "/health" if stack.startswith("xpyd") else "/")
            time.sleep(0.5)  # first health probes
            for mode, clients in [*cells, ("paced", 64)] if cells else []:
                paced = args.paced_rps if mode == "paced" else None
                direct[(mode, clients)] = asyncio.run(_measure(decode, clients, mode == "stream64", args.seconds,
                                                               paced))
                both_legs[(mode, clients)] = asyncio.run(_measure(decode, clients, mode == "stream64", args.seconds,
                                                                  paced, prefill=prefill))
                for stack, url in urls.items():
                    rows.append((mode, clients, stack, asyncio.run(
                        _measure(url, clients, mode == "stream64", args.seconds, paced))))
        if cells:
            out.write(f"proxy benchmark: stub engines answering at once, {args.seconds:.0f} s per cell, NIXL pull "
                      f"(prefill then decode); stream64 = {STREAM_TOKENS} streamed tokens; paced = 64 clients sharing "
                      f"{args.paced_rps:.0f} req/s\n")
            if skipped:
                out.write(f"skipped (not installed): {', '.join(skipped)}\n")
            out.write(f"\n{'mode':<11} {'clients':>7} {'target':<12} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} "
                      f"{'added p50':>10} {'added p99':>10} {'own p50':>8} {'own p99':>8} {'errors':>7}\n")
            blank = ""
            for (mode, clients), result in direct.items():
                for target, base in (("direct", result), ("direct P+D", both_legs[(mode, clients)])):
                    out.write(f"{mode:<11} {clients:>7} {target:<12} {base.rps:>8.0f} {base.p50_ms:>8.2f} "
                              f"{base.p99_ms:>8.2f} {blank:>10} {blank:>10} {blank:>8} {blank:>8} {base.errors:>7}\n")
            for mode, clients, stack, result in sorted(rows, key=lambda r: (r[0], r[1])):
                base, pair = direct[(mode, clients)], both_legs[(mode, clients)]
                out.write(f"{mode:<11} {clients:>7} {stack:<12} {result.rps:>8.0f} {result.p50_ms:>8.2f} "
                          f"{result.p99_ms:>8.2f} {result.p50_ms - base.p50_ms:>10.2f} "
                          f"{result.p99_ms - base.p99_ms:>10.2f} {result.p50_ms - pair.p50_ms:>8.2f} "
                          f"{result.p99_ms - pair.p99_ms:>8.2f} {result.errors:>7}\n")
        out.flush()
        if args.soak_seconds > 0:
            port = free_port()
            url = f"http://{HOST}:{port}"
            with _process(_stack_argv("xpyd", port, prefill, decode)) as proxy:
                _wait(url)
                time.sleep(0.5)
                samples = asyncio.run(_soak(url, proxy.pid, args.soak_seconds, 64))
            out.write(f"\nmemory soak: xpyd proxy, 64 clients, {args.soak_seconds:.0f} s (half unstreamed, half "
                      "streamed); RSS MiB at t seconds:\n  " +
                      "  ".join(f"{t:.0f}s={kib / 1024:.1f}" for t, kib in samples) + "\n")
            first = samples[1][1] if len(samples) > 2 else samples[0][1]
            out.write(f"  growth after warm-up: {(samples[-1][1] - first) / 1024:+.1f} MiB\n")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "serve":
        _, _, stack_name, port_text, prefill_url, decode_url = sys.argv
        SERVERS[stack_name](int(port_text), prefill_url, decode_url)
        raise SystemExit(0)
    raise SystemExit(main())

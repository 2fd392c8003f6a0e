"""How much one `xpyd engine-sim` process can carry: requests/s, tokens/s and its CPU cost per token at
1, 64 and 256 concurrent streams, and how closely it keeps real time.

    python benchmarks/engine_sim_bench.py [--streams 1 64 256] [--tokens 128] [--prompt 512]

Two rows per concurrency, each against a fresh engine process on loopback, driven by closed-loop
streaming clients in this process (a lean SSE reader):

- `flat out` (`--time-scale 1e6`): the modelled durations vanish, so the rates are the emulator's own
  ceiling (HTTP, SSE and the scheduling loop); `engine us/token` is the engine process's CPU time
  (user + system, from /proc) per generated token.
- `real time` (`--time-scale 1`) and `10x` (`--time-scale 10`): the mean inter-token latency clients
  see against the one the engine modelled (its `vllm:inter_token_latency_seconds`, wall seconds), and
  how many times the loop fell behind its schedule (a lag warning in its log). `engine us/token`
  includes the sub-millisecond spin that keeps steps on time (see `xpyd.sim.emulator`).

Bounded: every run has a fixed number of requests and a timeout. Loopback only.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import aiohttp
from procstats import cpu_seconds

HOST = "127.0.0.1"
RUN_TIMEOUT_S = 180.0


@dataclass
class Row:
    """One benchmark run."""

    mode: str
    streams: int
    requests: int
    wall_s: float
    tokens: int
    engine_cpu_s: float
    client_itl_ms: float
    engine_itl_ms: float
    lag_warnings: int


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


async def wait_ready(session: aiohttp.ClientSession, url: str, process: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError("engine-sim exited during start-up")
        try:
            async with session.get(f"{url}/health") as response:
                if response.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.05)
    raise RuntimeError("engine-sim did not become ready")


async def one_stream(session: aiohttp.ClientSession, url: str, prompt: list[int], tokens: int) -> tuple[int, float]:
    """One streamed completion: (tokens received, mean gap between them in seconds)."""
    body = {"prompt": prompt, "max_tokens": tokens, "stream": True}
    times: list[float] = []
    async with session.post(f"{url}/v1/completions", json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {await response.text()}")
        async for line in response.content:
            if line.startswith(b'data: {"id"'):
                times.append(time.perf_counter())
    gap = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 0.0
    return len(times), gap


async def engine_itl_ms(session: aiohttp.ClientSession, url: str) -> float:
    async with session.get(f"{url}/metrics") as response:
        text = await response.text()
    values = {}
    for line in text.splitlines():
        if line.startswith(("vllm:inter_token_latency_seconds_sum", "vllm:inter_token_latency_seconds_count")):
            name, value = line.split("{")[0], float(line.rsplit(" ", 1)[1])
            values[name] = value
    count = values.get("vllm:inter_token_latency_seconds_count", 0.0)
    return values.get("vllm:inter_token_latency_seconds_sum", 0.0) / count * 1e3 if count else float("nan")


async def run(mode: str, streams: int, requests: int, prompt_tokens: int, tokens: int, time_scale: float) -> Row:
    with tempfile.TemporaryFile(mode="w+") as log:
        port = free_port()
        process = subprocess.Popen([sys.executable, "-m", "xpyd.sim.emulator", f"--port={port}", f"--host={HOST}",
                                    f"--time-scale={time_scale}", f"--max-num-seqs={max(256, streams)}"],
                                   stdout=log, stderr=subprocess.STDOUT, text=True)
        try:
            row = await drive(mode, process, f"http://{HOST}:{port}", streams, requests, prompt_tokens, tokens)
        finally:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=30)
        log.seek(0)
        row.lag_warnings = log.read().count("fell")
    return row


async def drive(mode: str, process: subprocess.Popen[str], url: str, streams: int, requests: int,
                prompt_tokens: int, tokens: int) -> Row:
    """Closed-loop: `streams` clients share `requests` requests, each starting the next when one ends."""
    prompt = list(range(1, prompt_tokens + 1))
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=2.0)
    async with aiohttp.ClientSession(connector=connector) as session:
        await wait_ready(session, url, process)
        remaining = requests
        gaps: list[float] = []
        received = 0

        async def worker() -> None:
            nonlocal remaining, received
            while remaining > 0:
                remaining -= 1
                count, gap = await one_stream(session, url, prompt, tokens)
                received += count
                gaps.append(gap)

        cpu_before = cpu_seconds(process.pid)
        started = time.perf_counter()
        await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(streams))), RUN_TIMEOUT_S)
        wall_s = time.perf_counter() - started
        cpu_s = cpu_seconds(process.pid) - cpu_before
        modelled_itl = await engine_itl_ms(session, url)
    return Row(mode, streams, requests, wall_s, received, cpu_s, sum(gaps) / len(gaps) * 1e3, modelled_itl, 0)


def main() -> int:
    """Run the table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--tokens", type=int, default=128, help="output tokens per request")
    parser.add_argument("--prompt", type=int, default=512, help="prompt tokens per request")
    parser.add_argument("--rounds", type=int, default=4, help="requests per stream in the flat-out run")
    args = parser.parse_args()

    rows: list[Row] = []
    for streams in args.streams:
        rows.append(asyncio.run(run("flat out", streams, streams * args.rounds, args.prompt, args.tokens, 1e6)))
        rows.append(asyncio.run(run("real time", streams, streams, args.prompt, args.tokens, 1.0)))
        rows.append(asyncio.run(run("10x", streams, streams, args.prompt, args.tokens, 10.0)))
    out = sys.stdout
    out.write(f"one engine-sim, prompt {args.prompt} tokens, {args.tokens} output tokens per request, "
              f"{os.cpu_count()} CPUs (clients share them)\n")
    out.write(f"{'mode':<10} {'streams':>7} {'requests':>8} {'wall s':>7} {'req/s':>8} {'tokens/s':>9} "
              f"{'engine us/token':>15} {'client ITL ms':>13} {'modelled ITL ms':>15} {'lags':>4}\n")
    for row in rows:
        out.write(f"{row.mode:<10} {row.streams:>7} {row.requests:>8} {row.wall_s:>7.2f} "
                  f"{row.requests / row.wall_s:>8.1f} {row.tokens / row.wall_s:>9.0f} "
                  f"{row.engine_cpu_s / row.tokens * 1e6:>15.1f} {row.client_itl_ms:>13.2f} "
                  f"{row.engine_itl_ms:>15.2f} {row.lag_warnings:>4}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

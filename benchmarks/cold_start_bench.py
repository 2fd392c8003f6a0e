"""The proxy's waiting room at zero (issue 31), timed: how fast a full room answers 429, and how soon
held requests go on once a prefill and decode pair is there.

    python benchmarks/cold_start_bench.py [--held 64] [--overflow 2000] [--rounds 3]

`xpyd proxy` runs as deployed (its own process, uvloop) with fixed engine URLs whose engines are not
listening yet (`xpyd.testing.stubengine` processes started later), the waiting room on
(`--wait-timeout 300 --wait-max-requests HELD`) and probes every 0.1 s. Per round:

1. HELD requests are sent and held (the proxy's /metrics says so);
2. OVERFLOW more are sent one after the other: each is refused with 429 by the full room; the
   figure is the client-side time from sending to the whole answer, p50/p99/max over every
   round (the target: under 10 ms);
3. the two stub engines start: the figure is the time from both listening to the first held
   request's first byte, and to the last one's, which includes the proxy's health probe (every
   0.1 s; in Kubernetes a pod turning Ready counts at once, see docs/proxy.md) and the poll of the
   waiting room (0.1 s).

Client, proxy and engines share this machine's cores; the figures are for comparison.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from proxy_bench import HOST, _process, _wait, free_port

REQUEST = {"model": "m", "prompt": "a cold start", "max_tokens": 4}


async def _held(session: aiohttp.ClientSession, proxy: str) -> int:
    async with session.get(proxy + "/metrics") as response:
        text = await response.text()
    return int(next(float(line.split()[-1]) for line in text.splitlines()
                    if line.startswith("xpyd_proxy_waiting_requests ")))


async def _first_byte(session: aiohttp.ClientSession, proxy: str) -> tuple[int, float]:
    async with session.post(proxy + "/v1/completions", json=REQUEST) as response:
        await response.content.readany()
        first = time.monotonic()
        await response.read()
        return response.status, first


async def round_(held: int, overflow: int) -> tuple[list[float], float, float, int]:
    """One round: (overflow latencies in s, first and last release after the engines listen, failures)."""
    prefill_port, decode_port, proxy_port = free_port(), free_port(), free_port()
    prefill, decode, proxy = (f"http://{HOST}:{port}" for port in (prefill_port, decode_port, proxy_port))
    argv = [sys.executable, "-m", "xpyd.proxy", "--host", HOST, "--port", str(proxy_port), "--prefill", prefill,
            "--decode", decode, "--wait-timeout", "300", "--wait-max-requests", str(held), "--health-interval",
            "0.1", "--health-timeout", "0.5"]
    stub = [sys.executable, "-m", "xpyd.testing.stubengine", "--host", HOST, "--port"]
    with _process(argv):
        _wait(proxy, "/ready")
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            waiting = [asyncio.ensure_future(_first_byte(session, proxy)) for _ in range(held)]
            deadline = time.monotonic() + 30
            while await _held(session, proxy) < held:
                assert time.monotonic() < deadline, "the requests were not held"
                await asyncio.sleep(0.05)
            latencies = []
            for _ in range(overflow):
                sent = time.perf_counter()
                async with session.post(proxy + "/v1/completions", json=REQUEST) as response:
                    await response.read()
                    assert response.status == 429, response.status
                latencies.append(time.perf_counter() - sent)
            with _process([*stub, str(prefill_port)]), _process([*stub, str(decode_port)]):
                _wait(prefill)
                _wait(decode)
                listening = time.monotonic()
                answers = await asyncio.gather(*waiting)
    failures = sum(status != 200 for status, _ in answers)
    firsts = [first for status, first in answers if status == 200]
    return latencies, min(firsts) - listening, max(firsts) - listening, failures


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--held", type=int, default=64, help="requests held per round (the room's size)")
    parser.add_argument("--overflow", type=int, default=2000, help="requests refused per round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    latencies: list[float] = []
    releases: list[tuple[float, float]] = []
    failures = 0
    for _ in range(args.rounds):
        overflow, first, last, failed = asyncio.run(round_(args.held, args.overflow))
        latencies += overflow
        releases.append((first, last))
        failures += failed
    ordered = sorted(latencies)

    def at(share: float) -> float:
        return 1000.0 * ordered[min(len(ordered) - 1, int(share * len(ordered)))]

    say(f"overflow (429 from a full waiting room of {args.held}): {len(ordered)} requests, p50 {at(0.5):.2f} ms, "
          f"p99 {at(0.99):.2f} ms, max {1000 * ordered[-1]:.2f} ms, mean {1000 * statistics.fmean(ordered):.2f} ms")
    say(f"release ({args.held} held, engines listening -> first byte): first "
          + ", ".join(f"{first * 1000:.0f}" for first, _ in releases) + " ms; last "
          + ", ".join(f"{last * 1000:.0f}" for _, last in releases) + f" ms; failed {failures}")
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())

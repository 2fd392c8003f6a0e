"""What recording a proxied request's metrics costs: the proxy's `ProxyMetrics` (prometheus_client
behind cached label children, `xpyd.proxy.metrics`) against the hand-written counters and
histograms it replaced, in one run, in this process.

    python benchmarks/metrics_bench.py [--requests 20000] [--rounds 7]

One request records what a streamed, successful request records in `xpyd.proxy.server`: one
`xpyd_proxy_requests_total` increment and five histogram observations (time to first byte, time
to first token, duration, the prefill leg, the decode leg), with latencies spread over the
buckets (log-uniform, 1 ms to 20 s; prometheus_client finds a bucket by a linear scan, the
hand-written one by bisection). Rounds alternate between the two, so a change in the machine's
load hits both alike; each figure is the best round (ns per request), and the ratio is
prometheus_client's over the hand-written one.
"""

from __future__ import annotations

import argparse
import bisect
import random
import sys
import time
from collections.abc import Callable, Sequence

from xpyd.proxy.metrics import LATENCY_BUCKETS
from xpyd.proxy.server import ProxyMetrics

Labels = tuple[str, ...]
CONNECTOR, ENDPOINT = "NixlConnector", "completions"


# -- the baseline: the recording half of the hand-written metrics (xpyd.proxy.metrics at 78a088b) ---


class HandCounter:
    """A value per label tuple in a dict."""

    def __init__(self) -> None:
        self.values: dict[Labels, float] = {}

    def inc(self, *labels: str, amount: float = 1.0) -> None:
        self.values[labels] = self.values.get(labels, 0.0) + amount


class HandHistogram:
    """Per label tuple: per-bucket counts (found by bisection) and the sum."""

    def __init__(self, buckets: Sequence[float] = LATENCY_BUCKETS) -> None:
        self.buckets = tuple(buckets)
        self.series: dict[Labels, tuple[list[int], list[float]]] = {}

    def observe(self, value: float, *labels: str) -> None:
        series = self.series.get(labels)
        if series is None:
            series = self.series[labels] = ([0] * (len(self.buckets) + 1), [0.0])
        series[0][bisect.bisect_left(self.buckets, value)] += 1
        series[1][0] += value


class HandMetrics:
    """The proxy's metrics, hand-written (the attributes server.py records into)."""

    def __init__(self) -> None:
        self.requests = HandCounter()
        self.ttft, self.stream_ttft, self.duration, self.legs = (HandHistogram() for _ in range(4))


# -- the measurement ------------------------------------------------------------------------------


Metrics = ProxyMetrics | HandMetrics


def record(metrics: Metrics, latencies: Sequence[tuple[float, float, float, float]]) -> None:
    """What server.py records for each of these streamed requests."""
    for first_byte, total, prefill, decode in latencies:
        metrics.ttft.observe(first_byte, CONNECTOR, ENDPOINT)
        metrics.stream_ttft.observe(first_byte, CONNECTOR, ENDPOINT)
        metrics.requests.inc(CONNECTOR, ENDPOINT, "success")
        metrics.duration.observe(total, CONNECTOR, ENDPOINT)
        metrics.legs.observe(prefill, "prefill", "success")
        metrics.legs.observe(decode, "decode", "success")


def sample_latencies(count: int, seed: int = 1) -> list[tuple[float, float, float, float]]:
    """(first byte, duration, prefill leg, decode leg) seconds, log-uniform from 1 ms to 20 s."""
    rng = random.Random(seed)

    def latency() -> float:
        return float(10 ** rng.uniform(-3, 1.3))

    return [(latency(), latency(), latency(), latency()) for _ in range(count)]


def best_ns_per_request(kinds: dict[str, Callable[[], Metrics]], requests: int,
                        rounds: int) -> dict[str, float]:
    """The best round of each kind (fresh metrics each round, kinds alternating), ns per request."""
    latencies = sample_latencies(requests)
    best = dict.fromkeys(kinds, float("inf"))
    for _ in range(rounds):
        for name, make in kinds.items():
            metrics = make()
            record(metrics, latencies[:10])           # the label children exist, as in a running proxy
            started = time.perf_counter_ns()
            record(metrics, latencies)
            best[name] = min(best[name], (time.perf_counter_ns() - started) / requests)
    return best


def main() -> int:
    """Print ns per request of both and their ratio."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=20000, help="requests recorded per round")
    parser.add_argument("--rounds", type=int, default=7, help="rounds of each (the best one counts)")
    args = parser.parse_args()
    best = best_ns_per_request({"hand-written": HandMetrics, "prometheus_client": ProxyMetrics}, args.requests,
                               args.rounds)
    out = sys.stdout
    out.write(f"metrics of one streamed request (1 counter increment, 5 histogram observations), best of "
              f"{args.rounds} rounds of {args.requests} requests\n\n{'implementation':<18} {'ns/request':>10}\n")
    for name, ns in best.items():
        out.write(f"{name:<18} {ns:>10.0f}\n")
    out.write(f"\nratio prometheus_client / hand-written: {best['prometheus_client'] / best['hand-written']:.2f}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

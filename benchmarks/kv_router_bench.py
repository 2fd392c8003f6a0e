"""What KVAware routing costs the proxy per request, in this process (docs/proxy.md, "KV-aware routing"):

1. The routing decision: `KVAwareRouter.choose` for prefill and for decode over `--instances` instances
   whose indexes hold `--blocks` blocks in all (filled the way KV events fill them, each instance with
   its own conversations' prefixes), for prompts that hit one instance in part: p50, p99 and max in µs.
2. Hashing a prompt into its block keys (`kvcache.hashing`, sha256), per prompt length.
3. Getting the token ids, both ways:
   - in the proxy with the `tokenizers` library and the tiny model's tokenizer (`make tools` builds it
     under ~/.cache/xpyd/models; skipped when either is missing);
   - from an engine's `POST /tokenize` over loopback HTTP (a stub engine answering with one id per
     four characters: the round trip and the JSON of the ids, without the engine's own tokenizer,
     which costs what the first way costs, on the engine's CPU instead).

    python benchmarks/kv_router_bench.py [--instances 8] [--blocks 100000] [--decisions 20000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

import aiohttp
from aiohttp import web

from xpyd.api.models import KVIndex
from xpyd.proxy.breaker import Breaker
from xpyd.proxy.kvaware import KVAwareRequest, KVAwareRouter, KVAwareSettings, block_keys
from xpyd.proxy.pool import Instance

BLOCK = 16
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dogs", "while", "seven", "wizards", "quietly",
         "hex", "jovial", "sphinx"]


def say(line: str) -> None:
    sys.stdout.write(line + "\n")


def percentiles(samples: list[float]) -> str:
    ordered = sorted(samples)

    def p(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return f"p50 {p(0.5):8.1f}  p99 {p(0.99):8.1f}  max {ordered[-1]:9.1f}"


def decision_cost(instances: int, blocks: int, decisions: int, prompt_tokens: int) -> None:
    rng = random.Random(0)
    router = KVAwareRouter(KVAwareSettings(index=KVIndex.EVENTS, block_size=BLOCK, index_blocks=blocks), rng)
    nodes = [Instance(url=f"http://10.0.0.{i}:8000", role="prefill", breaker=Breaker()) for i in range(instances)]
    decodes = [Instance(url=f"http://10.0.1.{i}:8000", role="decode", breaker=Breaker()) for i in range(2)]
    prompts: list[list[int]] = []
    per_instance = blocks // instances
    blocks_per_prompt = prompt_tokens // BLOCK
    for i, node in enumerate(nodes):            # each instance holds its own conversations' prefixes
        held = 0
        while held < per_instance:
            tokens = [rng.randrange(128_000) for _ in range(prompt_tokens)]
            for key in block_keys(router.hasher, tokens).ids:
                router.index(node.url, "prefill").store(key, 0.0)
            held += blocks_per_prompt
            if len(prompts) < 1000 and i % 2 == 0:
                prompts.append(tokens)
        node.outstanding_computed = rng.randrange(0, 4 * prompt_tokens)
    total = sum(router.blocks(node.url) for node in nodes)
    requests = []
    for tokens in prompts:                       # half the prefix cached somewhere, then a new question
        cut = rng.randrange(prompt_tokens // 4, prompt_tokens)
        asked = tokens[:cut] + [rng.randrange(128_000) for _ in range(prompt_tokens - cut)]
        keys = block_keys(router.hasher, asked)
        requests.append(KVAwareRequest(len(asked), keys))
    samples = []
    for n in range(decisions):
        request = requests[n % len(requests)]
        request.hits.clear()
        started = time.perf_counter_ns()
        router.choose("prefill", nodes, request, 1.0)
        router.choose("decode", decodes, request, 1.0)
        samples.append((time.perf_counter_ns() - started) / 1000)
    say(f"decision (prefill over {instances}, decode over 2), {total:,} blocks indexed, "
          f"{prompt_tokens}-token prompts: {percentiles(samples)} µs")


def hashing_cost(lengths: list[int], rounds: int) -> None:
    router = KVAwareRouter(KVAwareSettings(block_size=BLOCK), random.Random(0))
    for length in lengths:
        tokens = list(range(length))
        samples = []
        for _ in range(rounds):
            started = time.perf_counter_ns()
            block_keys(router.hasher, tokens)
            samples.append((time.perf_counter_ns() - started) / 1000)
        say(f"hashing {length:6d} tokens ({length // BLOCK} blocks, sha256): {percentiles(samples)} µs")


def text(tokens: int, rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(tokens))


def tokenizers_cost(lengths: list[int], rounds: int) -> None:
    try:
        import tokenizers
    except ModuleNotFoundError:
        say("tokenizers in the proxy: the tokenizers package is not installed (pip install tokenizers)")
        return
    models = sorted((Path.home() / ".cache" / "xpyd" / "models").glob("*/tokenizer.json"))
    if not models:
        say("tokenizers in the proxy: no tokenizer.json under ~/.cache/xpyd/models (make tools builds one)")
        return
    tokenizer = tokenizers.Tokenizer.from_file(str(models[0]))
    rng = random.Random(0)
    for length in lengths:
        prompt = text(length, rng)
        count = len(tokenizer.encode(prompt).ids)
        samples = []
        for _ in range(rounds):
            started = time.perf_counter_ns()
            tokenizer.encode(prompt)
            samples.append((time.perf_counter_ns() - started) / 1000)
        say(f"tokenizers {tokenizers.__version__} in the proxy ({models[0].parent.name}), {count:6d} tokens: "
              f"{percentiles(samples)} µs")


async def tokenize_endpoint_cost(lengths: list[int], rounds: int) -> None:
    async def tokenize(request: web.Request) -> web.Response:
        body = json.loads(await request.read())
        prompt = body["prompt"]
        ids = [hash(prompt[i:i + 4]) & 0xFFFF for i in range(0, len(prompt), 4)]
        return web.json_response({"count": len(ids), "max_model_len": 131072, "tokens": ids})

    app = web.Application(client_max_size=64 << 20)
    app.router.add_post("/tokenize", tokenize)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    rng = random.Random(0)
    try:
        async with aiohttp.ClientSession() as session:
            for length in lengths:
                prompt = text(length, rng)
                samples = []
                for _ in range(rounds):
                    started = time.perf_counter_ns()
                    async with session.post(f"http://127.0.0.1:{port}/tokenize",
                                            json={"model": "m", "prompt": prompt}) as response:
                        await response.json()
                    samples.append((time.perf_counter_ns() - started) / 1000)
                say(f"/tokenize round trip over loopback, {length:6d} words: {percentiles(samples)} µs")
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--instances", type=int, default=8)
    parser.add_argument("--blocks", type=int, default=100_000, help="blocks indexed over all instances")
    parser.add_argument("--decisions", type=int, default=20_000)
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=200, help="rounds of each hashing and tokenizing row")
    args = parser.parse_args(argv)
    lengths = [256, 2048, 16384]
    run: list[Callable[[], None]] = [
        lambda: decision_cost(args.instances, args.blocks, args.decisions, args.prompt_tokens),
        lambda: hashing_cost(lengths, args.rounds),
        lambda: tokenizers_cost(lengths, args.rounds),
        lambda: asyncio.run(tokenize_endpoint_cost(lengths, args.rounds)),
    ]
    for step in run:
        step()
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""KVAware routing: each prompt goes to the instance that holds most of its prefix in its prefix
cache, weighed against load (`xpyd.kvcache.scoring`, the formula the simulator replays).

Per request (`KVRouter.prepare`, before the first pick):
1. The prompt's token ids, as the engine will see them: a prompt of token ids as it is; text and chat
   messages from a prefill engine's own `POST /tokenize` (chat with the request's template fields),
   so the ids are the engine's by construction, chat template included. Only the first prompt of a
   batch is looked at. A failed or slow `/tokenize` (`tokenize_timeout`) leaves the request without
   ids: it is scored by load alone, never failed.
2. vLLM's block hashes of those ids (`kvcache.hashing.BlockHasher`: the engines' block size, hash
   algorithm and NONE_HASH seed, the request's `cache_salt`; Routed, which compares only its own keys,
   sha256 whatever the engines use), kept as the low 64 bits vLLM publishes in its KV events
   (`kvcache.events.external_block_hash`): one key per full block.

Per pick (`choose`, among the candidates pairing and health left): each candidate's hit is the run of
the prompt's blocks from the first that its index holds (`kvcache.index.PrefixIndex.match`, at most
the blocks before the last token), in tokens; prefill scores `outstanding computed + kv_weight x
(prompt - hit)`, decode `outstanding requests - decode_credit x hit / prompt`; the lowest wins, ties at
random. The prefill instance is then charged the tokens it is expected to compute (`Instance.acquire`'s
`computed`), which later picks weigh.

What each instance holds (`index`):
- `Routed`: what this proxy sent there (`record` on every pick), forgotten `ttl_s` after the last
  request that carried it; each proxy replica knows only its own traffic.
- `Events`: the engine's own KV events (`xpyd.proxy.kvevents`), one index per data-parallel rank; an
  instance holds what its best rank holds.

Each index is capped at `index_blocks`, least recently touched forgotten first, and dropped when its
instance leaves the pool.
"""

from __future__ import annotations

import argparse
import logging
import math
import random
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

import aiohttp

from xpyd.api.models import KVIndex
from xpyd.api.naming import Role
from xpyd.common.args import positive_float, positive_int
from xpyd.common.jsontypes import JSON
from xpyd.kvcache import scoring
from xpyd.kvcache.hashing import CRYPTOGRAPHIC_HASH_ALGOS, DEFAULT_NONE_HASH_SEED, HASH_ALGOS, BlockHasher
from xpyd.kvcache.index import PrefixIndex
from xpyd.kvcache.pool import BlockKeys
from xpyd.proxy.metrics import Counter, Gauge, GaugeSample, Histogram
from xpyd.proxy.pool import Instance, Pool

if TYPE_CHECKING:
    from prometheus_client.registry import Collector

    from xpyd.proxy.kvevents import Hub
    from xpyd.proxy.legs import Context

log = logging.getLogger(__name__)

#: A block hash as vLLM publishes it: the low 64 bits of its digest.
HASH_MASK: Final = (1 << 64) - 1
#: Fields of a chat request that change its token ids and that `/tokenize` takes (vLLM's
#: `TokenizeChatRequest`, 0.13 to 0.33: it has no `documents`), passed on as they are.
CHAT_TOKENIZE_FIELDS: Final = ("add_generation_prompt", "continue_final_message", "add_special_tokens",
                               "chat_template", "chat_template_kwargs", "tools", "mm_processor_kwargs")
#: Seconds a `/tokenize` may take before the request is routed without its ids.
TOKENIZE_TIMEOUT_S: Final = 2.0
TOKENIZE_BUCKETS: Final = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0)


@dataclass(frozen=True)
class KVSettings:
    """What `xpyd proxy` is told about KVAware routing (`--kv-*`; `xpyd.render.kvaware` renders them)."""

    index: KVIndex = KVIndex.EVENTS
    kv_weight: float = 1.0
    decode_credit: float = 1.0
    ttl_s: float = 600.0
    index_blocks: int = 131072
    block_size: int = 16
    #: Events: the engines' `--prefix-caching-hash-algo` (Routed hashes with sha256 whatever it says).
    hash_algo: str = "sha256"
    #: Events: the engines' PYTHONHASHSEED (None: vLLM's fixed seed of sha256 and sha256_cbor).
    hash_seed: str | None = None
    events_port: int = 7557
    events_replay_port: int = 7657
    events_topic: str = "kv-events"
    #: Data-parallel ranks per engine pod, each publishing on the ports plus its rank.
    prefill_ranks: int = 1
    decode_ranks: int = 1
    tokenize_timeout_s: float = TOKENIZE_TIMEOUT_S

    def hasher(self) -> BlockHasher:
        """The block hashing of the index keys (raises ValueError for an algorithm or size vLLM refuses,
        and ModuleNotFoundError for xxhash without the package). Events: the engines' own, whose events
        carry their hashes. Routed compares only the keys this proxy made, so it hashes with sha256 and
        vLLM's default seed whatever `hash_algo` and `hash_seed` say: only the block size must be the
        engines'."""
        if self.index == KVIndex.ROUTED:
            return BlockHasher(self.block_size)
        hasher = BlockHasher(self.block_size, self.hash_algo, DEFAULT_NONE_HASH_SEED if self.hash_seed is None
                             else self.hash_seed)
        hasher.hashes([0] * self.block_size)   # the xxhash algorithms import their package on first use
        return hasher


@dataclass
class KVRequest:
    """One request's prompt as KVAware routing sees it."""

    #: Prompt tokens: the ids' count when known, else the proxy's estimate.
    prompt_tokens: int
    #: The prompt's block keys (None: its token ids are unknown; it is scored by load alone).
    keys: BlockKeys | None = None
    #: Hit tokens per instance URL, as last scored.
    hits: dict[str, int] = field(default_factory=dict)

    def computed(self, url: str) -> int:
        """The prompt tokens the instance at `url` is expected to compute (those it does not hold)."""
        return self.prompt_tokens - self.hits.get(url, 0)


def block_keys(hasher: BlockHasher, token_ids: Sequence[int], cache_salt: str | None = None) -> BlockKeys:
    """A prompt's block keys: vLLM's hashes of its full blocks, as the 64-bit integers its KV events carry."""
    return BlockKeys.of([int.from_bytes(digest, "big") & HASH_MASK for digest in hasher.hashes(token_ids, cache_salt)])


def event_key(block_hash: bytes | int) -> int:
    """A block hash of a KV event as the index keys it: an integer as it is, bytes as their low 64 bits
    (engines run with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0 publish the whole digest)."""
    if isinstance(block_hash, bytes):
        return int.from_bytes(block_hash, "big") & HASH_MASK
    return block_hash & HASH_MASK


def first_prompt(body: JSON, chat: bool) -> tuple[list[int] | None, JSON | None]:
    """The token ids of the request's (first) prompt when it carries them, else what `/tokenize` needs
    to make them (None and None: nothing to tokenize)."""
    model = body.get("model")
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return None, None
        ask: JSON = {"model": model, "messages": messages}
        ask.update({key: body[key] for key in CHAT_TOKENIZE_FIELDS if key in body})
        return None, ask
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, int) and not isinstance(first, bool):
            return list(prompt), None
        if isinstance(first, list):
            return list(first), None
        prompt = first
    if not isinstance(prompt, str) or not prompt:
        return None, None
    return None, {"model": model, "prompt": prompt, "add_special_tokens": body.get("add_special_tokens", True)}


def _token_ids(answer: Any) -> list[int] | None:
    tokens = answer.get("tokens") if isinstance(answer, dict) else None
    if isinstance(tokens, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        return tokens
    return None


class KVRouter:
    """The per-instance indexes and the scoring of KVAware routing (see the module docstring)."""

    def __init__(self, settings: KVSettings, rng: random.Random) -> None:
        self.settings = settings
        self.rng = rng
        self.hasher = settings.hasher()
        #: Per instance URL, one index per data-parallel rank (Routed: one).
        self.indexes: dict[str, list[PrefixIndex]] = {}
        self.prompt_tokens = Counter(
            "xpyd_proxy_kv_prompt_tokens_total", "Prompt tokens of the requests KVAware routing placed, by role "
            "(the predicted hit rate is xpyd_proxy_kv_predicted_hit_tokens_total over this, as vLLM's is "
            "vllm:prefix_cache_hits_total over vllm:prefix_cache_queries_total).", ("role",))
        self.predicted_hits = Counter(
            "xpyd_proxy_kv_predicted_hit_tokens_total", "Prompt tokens KVAware routing expected the chosen "
            "instance to hold in its prefix cache, by role.", ("role",))
        self.tokenize_failures = Counter(
            "xpyd_proxy_kv_tokenize_failures_total", "Requests KVAware routing placed by load alone because "
            "/tokenize failed, by reason.", ("reason",))
        self.tokenize_seconds = Histogram(
            "xpyd_proxy_kv_tokenize_seconds", "Time to a prompt's token ids from a prefill engine's /tokenize, "
            "by endpoint.", ("endpoint",), buckets=TOKENIZE_BUCKETS)

    # -- indexes ----------------------------------------------------------------------------------

    def ranks(self, role: Role) -> int:
        """The indexes an instance of `role` has: one per data-parallel rank with events, else one."""
        if self.settings.index != KVIndex.EVENTS:
            return 1
        return self.settings.prefill_ranks if role == "prefill" else self.settings.decode_ranks

    def index(self, url: str, role: Role, rank: int = 0) -> PrefixIndex:
        """The index of `url`'s data-parallel `rank`, made on first use."""
        indexes = self.indexes.get(url)
        if indexes is None:
            ttl = self.settings.ttl_s if self.settings.index == KVIndex.ROUTED else math.inf
            indexes = self.indexes[url] = [PrefixIndex(self.settings.index_blocks, ttl)
                                           for _ in range(self.ranks(role))]
        return indexes[rank]

    def forget(self, url: str) -> None:
        """The instance left the pool (or its events cannot be trusted): drop what is known of it."""
        self.indexes.pop(url, None)

    def keep_only(self, urls: set[str]) -> None:
        """Drop the indexes of every instance not in `urls`."""
        for url in [url for url in self.indexes if url not in urls]:
            del self.indexes[url]

    def blocks(self, url: str) -> int:
        """Blocks indexed for `url`, over its ranks."""
        return sum(index.blocks for index in self.indexes.get(url, ()))

    # -- a request ----------------------------------------------------------------------------------

    async def prepare(self, body: JSON, chat: bool, estimate: int, tokenizers: Sequence[Instance],
                      session: aiohttp.ClientSession, headers: dict[str, str]) -> KVRequest:
        """The request's prompt for scoring: token ids from the body or from the `/tokenize` of one of
        `tokenizers` (prefill candidates; tried in random order, one at most after a failure), hashed."""
        ids, ask = first_prompt(body, chat)
        if ids is None and ask is not None and tokenizers:
            ids = await self._tokenize(ask, chat, tokenizers, session, headers)
        if ids is None:
            return KVRequest(estimate)
        salt = body.get("cache_salt")
        keys = block_keys(self.hasher, ids, salt if isinstance(salt, str) and salt else None)
        return KVRequest(len(ids), keys if keys.blocks else None)

    async def _tokenize(self, ask: JSON, chat: bool, tokenizers: Sequence[Instance],
                        session: aiohttp.ClientSession, headers: dict[str, str]) -> list[int] | None:
        order = self.rng.sample(list(tokenizers), min(2, len(tokenizers)))
        timeout = aiohttp.ClientTimeout(total=self.settings.tokenize_timeout_s)
        reason = "error"
        for instance in order:
            started = time.monotonic()
            try:
                async with session.post(instance.url + "/tokenize", json=ask, headers=headers,
                                        timeout=timeout) as response:
                    if response.status != 200:
                        reason = f"http_{response.status // 100}xx"
                        continue
                    ids = _token_ids(await response.json(content_type=None))
            except TimeoutError:
                reason = "timeout"
                continue
            except (aiohttp.ClientError, OSError, ValueError):
                reason = "error"
                continue
            if ids is None:
                reason = "malformed"
                continue
            self.tokenize_seconds.observe(time.monotonic() - started, "chat" if chat else "completions")
            return ids
        self.tokenize_failures.inc(reason)
        log.debug("KVAware: no token ids from /tokenize (%s): routed by load alone", reason)
        return None

    def hit_tokens(self, instance: Instance, request: KVRequest, now: float) -> int:
        """The prompt tokens `instance` holds from the first, as its index says (at most the blocks
        before the prompt's last token)."""
        keys = request.keys
        indexes = self.indexes.get(instance.url)
        if keys is None or not indexes:
            return 0
        limit = scoring.hit_limit(request.prompt_tokens, self.settings.block_size)
        return max(index.match(keys, now, limit) for index in indexes) * self.settings.block_size

    def choose(self, role: Role, candidates: Sequence[Instance], request: KVRequest, now: float) -> Instance:
        """The candidate KVAware routing picks for `request` (see the module docstring); `candidates`
        must not be empty. Records the hits it scored, and, with the Routed index, what it sent."""
        if not candidates:
            raise ValueError("no candidates to pick from")
        settings = self.settings
        prompt = request.prompt_tokens
        hits = [self.hit_tokens(c, request, now) for c in candidates]
        if role == "prefill":
            costs = [scoring.prefill_cost(c.outstanding_computed, prompt, hit, settings.kv_weight)
                     for c, hit in zip(candidates, hits, strict=True)]
        else:
            costs = [scoring.decode_cost(c.outstanding_requests, prompt, hit, settings.decode_credit)
                     for c, hit in zip(candidates, hits, strict=True)]
        position = scoring.least(costs, self.rng)
        chosen, hit = candidates[position], hits[position]
        request.hits[chosen.url] = hit
        self.prompt_tokens.inc(role, amount=prompt)
        if hit:
            self.predicted_hits.inc(role, amount=hit)
        if settings.index == KVIndex.ROUTED and request.keys is not None:
            self.index(chosen.url, role).record(request.keys, now)
        return chosen

    def chooser(self, role: Role, request: KVRequest | None) -> Callable[[Sequence[Instance]], Instance] | None:
        """A `Pool.choose` override for `request` (None: the request is picked by load alone)."""
        if request is None:
            return None
        return lambda candidates: self.choose(role, candidates, request, time.monotonic())


class KVRouting:
    """KVAware routing as the proxy's server uses it: the router, and with the Events index the
    subscribers to every engine's KV events (`xpyd.proxy.kvevents`)."""

    def __init__(self, settings: KVSettings, rng: random.Random) -> None:
        self.router = KVRouter(settings, rng)
        self.hub: Hub | None = None
        if settings.index == KVIndex.EVENTS:
            from xpyd.proxy.kvevents import Hub  # pyzmq, needed only here

            self.hub = Hub(self.router, settings)

    async def prepare(self, context: Context, prefills: Sequence[Instance],
                      session: aiohttp.ClientSession) -> KVRequest:
        """The request's prompt for scoring (`KVRouter.prepare`), tokenized by one of `prefills`."""
        parsed = context.parsed
        headers = {"X-Request-Id": context.request_id}
        if context.authorization:
            headers["Authorization"] = context.authorization
        try:
            return await self.router.prepare(parsed.body, parsed.endpoint == "chat", parsed.prompt_tokens, prefills,
                                             session, headers)
        except Exception:  # a bug here must cost the request its cache hits, never the request
            log.exception("KVAware: request %s routed by load alone", context.request_id)
            return KVRequest(parsed.prompt_tokens)

    def chooser(self, role: Role, request: KVRequest | None) -> Callable[[Sequence[Instance]], Instance] | None:
        return self.router.chooser(role, request)

    def update(self, pools: Mapping[Role, Pool]) -> None:
        """The pools changed: follow the engines listed now, forget the others."""
        if self.hub is not None:
            self.hub.update(pools.values())
        else:
            self.router.keep_only({url for pool in pools.values() for url in pool.instances})

    def collectors(self, pools: Mapping[Role, Pool]) -> list[Collector]:
        """The metrics of KVAware routing, for the proxy's registry."""
        router = self.router

        def blocks() -> Iterable[GaugeSample]:
            for role, pool in pools.items():
                for url in pool.instances:
                    yield (role, url), float(router.blocks(url))

        out: list[Collector] = [router.prompt_tokens, router.predicted_hits, router.tokenize_failures,
                                router.tokenize_seconds,
                                Gauge("xpyd_proxy_kv_index_blocks", "Blocks KVAware routing indexes per upstream "
                                      "(over its data-parallel ranks).", ("role", "upstream"), blocks)]
        if self.hub is not None:
            out += self.hub.metrics.collectors()
        return out

    async def close(self) -> None:
        if self.hub is not None:
            await self.hub.close()


# -- command line -----------------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `--kv-*` flags of KVAware routing (`xpyd.render.kvaware` renders them from the spec)."""
    defaults = KVSettings()
    group = parser.add_argument_group("KVAware routing (--routing-policy KVAware)")
    group.add_argument("--kv-index", default=defaults.index.value, choices=[i.value for i in KVIndex],
                       help="what the proxy knows the engines cache: Events (their KV events, subscribed to over "
                       "ZMQ) or Routed (what this proxy sent where, for --kv-ttl seconds)")
    group.add_argument("--kv-weight", type=_non_negative, default=defaults.kv_weight,
                       help="prefill score: expected compute outstanding + this x prompt tokens not cached there")
    group.add_argument("--kv-decode-credit", type=_non_negative, default=defaults.decode_credit,
                       help="decode score: outstanding requests - this x share of the prompt cached there")
    group.add_argument("--kv-ttl", type=positive_float, default=defaults.ttl_s,
                       help="Routed: seconds a prompt's blocks are remembered after the last request with them")
    group.add_argument("--kv-index-blocks", type=positive_int, default=defaults.index_blocks,
                       help="blocks indexed per engine (and data-parallel rank); least recently seen go first")
    group.add_argument("--kv-block-size", type=positive_int, default=defaults.block_size,
                       help="the engines' --block-size (tokens per KV block)")
    group.add_argument("--kv-hash-algo", default=defaults.hash_algo, choices=HASH_ALGOS,
                       help="Events: the engines' --prefix-caching-hash-algo (Routed hashes with sha256)")
    group.add_argument("--kv-hash-seed", default=None,
                       help="Events: the engines' PYTHONHASHSEED, which seeds vLLM's first block hash (unset: "
                       "vLLM's fixed seed, which sha256 and sha256_cbor use from 0.32 on; the xxhash algorithms "
                       "are seeded at random per process without it, and no hash would match)")
    group.add_argument("--kv-events-port", type=_port, default=defaults.events_port,
                       help="Events: the engines' KV event PUB port (rank r publishes on it + r)")
    group.add_argument("--kv-events-replay-port", type=_port, default=defaults.events_replay_port,
                       help="Events: the engines' KV event replay port (rank r answers on it + r)")
    group.add_argument("--kv-events-topic", default=defaults.events_topic, help="Events: the engines' topic")
    group.add_argument("--kv-events-prefill-ranks", type=positive_int, default=1, metavar="N",
                       help="Events: data-parallel ranks per prefill engine pod, each publishing on its own ports")
    group.add_argument("--kv-events-decode-ranks", type=positive_int, default=1, metavar="N",
                       help="Events: data-parallel ranks per decode engine pod")


def settings_from_args(args: argparse.Namespace) -> KVSettings:
    """`KVSettings` from the parsed `--kv-*` flags."""
    return KVSettings(index=KVIndex(args.kv_index), kv_weight=args.kv_weight, decode_credit=args.kv_decode_credit,
                      ttl_s=args.kv_ttl, index_blocks=args.kv_index_blocks, block_size=args.kv_block_size,
                      hash_algo=args.kv_hash_algo, hash_seed=args.kv_hash_seed, events_port=args.kv_events_port,
                      events_replay_port=args.kv_events_replay_port, events_topic=args.kv_events_topic,
                      prefill_ranks=args.kv_events_prefill_ranks, decode_ranks=args.kv_events_decode_ranks)


def problem(args: argparse.Namespace) -> str | None:
    """Why KVAware routing cannot run with these flags (None: it can, or another policy is chosen)."""
    if args.routing_policy != "KVAware":
        return None
    settings = settings_from_args(args)
    events = settings.index == KVIndex.EVENTS
    if events and settings.hash_algo not in CRYPTOGRAPHIC_HASH_ALGOS and settings.hash_seed is None:
        return (f"--kv-hash-algo {settings.hash_algo} with --kv-index Events needs --kv-hash-seed, the engines' "
                "PYTHONHASHSEED: without it vLLM seeds the xxhash algorithms at random per process, so no "
                "event would match the proxy's hashes")
    try:
        settings.hasher()
    except (ValueError, ModuleNotFoundError) as error:
        return f"--kv-hash-algo {settings.hash_algo}: {error}"
    if settings.events_port + settings.prefill_ranks > 65536 or settings.events_replay_port + max(
            settings.prefill_ranks, settings.decode_ranks) > 65536:
        return "--kv-events-port and --kv-events-replay-port plus the ranks must stay below 65536"
    if events:
        try:
            import zmq  # noqa: F401
        except ModuleNotFoundError:
            return "--kv-index Events subscribes to the engines' KV events over ZMQ, which needs pyzmq"
    return None


def _non_negative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (value >= 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a finite number of at least 0: {text!r}")
    return value


def _port(text: str) -> int:
    value = positive_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"not a port: {text!r}")
    return value

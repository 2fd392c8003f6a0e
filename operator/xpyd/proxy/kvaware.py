"""KVAware routing: each prompt goes to the instance that holds most of its prefix in its prefix
cache, weighed against load (`xpyd.kvcache.scoring`, the formula the simulator replays).

Per request (`KVAwareRouter.prepare`, before the first pick):
1. The prompt's token ids, as the engine will see them: a prompt of token ids as it is; text and chat
   messages from a prefill engine's own `POST /tokenize` (chat with the request's template fields),
   so the ids are the engine's by construction, chat template included. Only the first prompt of a
   batch is looked at. A `/tokenize` that fails or misses its deadline (`tokenize_timeout_s`, one for
   the request: a second engine is asked only after a fast failure, never after a timeout) leaves the
   request without ids, and so does a request whose ids `/tokenize` cannot give (`untokenizable`: a
   chat field vLLM's chat template is fed but `TokenizeChatRequest` does not take, a truncation):
   such a request is scored by load alone, counted by reason, never failed.
2. vLLM's block hashes of those ids (`kvcache.hashing.BlockHasher`: the engines' block size, hash
   algorithm and NONE_HASH seed, the request's `cache_salt`; Routed, which compares only its own keys,
   sha256 whatever the engines use), kept as the low 64 bits vLLM publishes in its KV events
   (`kvcache.events.block_hash_key`): one key per full block. Each role has its hashing: with the
   Events index a role takes the block size its engines publish (`learn_block_size`).

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
import asyncio
import logging
import math
import random
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

import aiohttp

from xpyd import vllm
from xpyd.api.models import KV_EVENTS_PORT, KV_EVENTS_REPLAY_PORT, KV_EVENTS_TOPIC, KVAwareSpec, KVIndex
from xpyd.api.naming import ROLES, Role
from xpyd.common.args import non_negative_float, port, positive_float, positive_int
from xpyd.common.jsontypes import JSON
from xpyd.kvcache import scoring
from xpyd.kvcache.events import block_hash_key
from xpyd.kvcache.hashing import CRYPTOGRAPHIC_HASH_ALGOS, DEFAULT_NONE_HASH_SEED, BlockHasher
from xpyd.kvcache.index import PrefixIndex
from xpyd.kvcache.pool import BlockKeys
from xpyd.proxy.metrics import Counter, Gauge, GaugeSample, Histogram
from xpyd.proxy.pool import Instance, Pool

if TYPE_CHECKING:
    from prometheus_client.registry import Collector

    from xpyd.proxy.kvevents import Hub
    from xpyd.proxy.legs import Context

log = logging.getLogger(__name__)

#: Fields of a chat request that change its token ids and that `/tokenize` takes (vLLM's
#: `TokenizeChatRequest`, 0.13 to 0.33), passed on as they are.
CHAT_TOKENIZE_FIELDS: Final = ("add_generation_prompt", "continue_final_message", "add_special_tokens",
                               "chat_template", "chat_template_kwargs", "tools", "mm_processor_kwargs")
#: Such fields that only later releases take, passed on when the request carries them: `/tokenize` and
#: the chat endpoints take `media_io_kwargs` from 0.18 on; before, neither has it (both ignore it alike).
CHAT_TOKENIZE_LATER_FIELDS: Final = ("media_io_kwargs",)
#: A `tool_choice` that renders as no `tool_choice` at all (with `tools`; 0.32+ drop it without them).
_PLAIN_TOOL_CHOICES: Final = (None, "auto")
#: Seconds a request's `/tokenize` may take, over every engine asked, before it is routed without its
#: ids (`--kv-tokenize-timeout`); the proxy's own round trip is about 0.3 ms plus the engine's
#: tokenization, tens of milliseconds for the longest prompts on an engine that is not overloaded.
TOKENIZE_TIMEOUT_S: Final = 0.25
#: The longest `--kv-tokenize-timeout`: every text and chat request waits for it before its first leg.
MAX_TOKENIZE_TIMEOUT_S: Final = 10.0
#: `/tokenize` answers after which the next engine is not asked: the request's own fault, which every
#: engine of the pool would answer alike.
_FINAL_STATUSES: Final = range(400, 500)
#: The largest block size taken from an engine's events (vLLM's are 1 to a few thousand tokens; a
#: hybrid model's attention blocks are made as large as its Mamba state).
MAX_BLOCK_SIZE: Final = 1 << 16
TOKENIZE_BUCKETS: Final = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0)
_API: Final = KVAwareSpec()   # the API's defaults, which the flags' defaults follow


@dataclass(frozen=True)
class KVAwareSettings:
    """What `xpyd proxy` is told about KVAware routing (`--kv-*`; `xpyd.render.kvaware` renders them)."""

    index: KVIndex = _API.index
    kv_weight: float = _API.kv_weight
    decode_credit: float = _API.decode_credit
    ttl_s: float = float(_API.ttl_seconds)
    index_blocks: int = _API.index_blocks
    block_size: int = vllm.DEFAULT_BLOCK_SIZE_GPU
    #: Events: the engines' `--prefix-caching-hash-algo` (Routed hashes with sha256 whatever it says).
    hash_algo: str = vllm.PREFIX_CACHING_HASH_ALGOS[0]
    #: Events: the engines' PYTHONHASHSEED (None: vLLM's fixed seed of sha256 and sha256_cbor).
    hash_seed: str | None = None
    events_port: int = KV_EVENTS_PORT
    events_replay_port: int = KV_EVENTS_REPLAY_PORT
    events_topic: str = KV_EVENTS_TOPIC
    #: Data-parallel ranks per engine pod, each publishing on the ports plus its rank.
    prefill_ranks: int = 1
    decode_ranks: int = 1
    tokenize_timeout_s: float = TOKENIZE_TIMEOUT_S

    def hasher(self, block_size: int | None = None) -> BlockHasher:
        """The block hashing of the index keys, at `block_size` (None: the configured one; raises
        ValueError for an algorithm or size vLLM refuses, and ModuleNotFoundError for xxhash without
        the package). Events: the engines' own, whose events carry their hashes. Routed compares only
        the keys this proxy made, so it hashes with sha256 and vLLM's default seed whatever `hash_algo`
        and `hash_seed` say: only the block size must be the engines'."""
        size = self.block_size if block_size is None else block_size
        if self.index == KVIndex.ROUTED:
            return BlockHasher(size)
        hasher = BlockHasher(size, self.hash_algo, DEFAULT_NONE_HASH_SEED if self.hash_seed is None
                             else self.hash_seed)
        hasher.hashes([0] * size)   # the xxhash algorithms import their package on first use
        return hasher

    def ranks(self, role: Role) -> int:
        """Data-parallel ranks per engine pod of `role`."""
        return self.prefill_ranks if role == "prefill" else self.decode_ranks


@dataclass
class KVAwareRequest:
    """One request's prompt as KVAware routing sees it."""

    #: Prompt tokens: the ids' count when known, else the proxy's estimate.
    prompt_tokens: int
    #: The prompt's block keys (None: its token ids are unknown; it is scored by load alone).
    keys: BlockKeys | None = None
    #: Hit tokens per instance URL, as last scored.
    hits: dict[str, int] = field(default_factory=dict)
    #: The block size `keys` were hashed at (None: whatever each role's is, as one hasher made them).
    block_size: int | None = None
    #: The keys at another role's block size, where the roles' sizes differ (None: no full block).
    other_keys: dict[int, BlockKeys | None] = field(default_factory=dict)

    def computed(self, url: str) -> int:
        """The prompt tokens the instance at `url` is expected to compute (those it does not hold)."""
        return self.prompt_tokens - self.hits.get(url, 0)

    def keys_at(self, block_size: int) -> BlockKeys | None:
        """The prompt's keys at `block_size` (None: not hashed at that size, or no full block)."""
        if self.block_size is None or self.block_size == block_size:
            return self.keys
        return self.other_keys.get(block_size)


def block_keys(hasher: BlockHasher, token_ids: Sequence[int], cache_salt: str | None = None) -> BlockKeys:
    """A prompt's block keys: vLLM's hashes of its full blocks, as the 64-bit integers its KV events carry."""
    return BlockKeys.of([block_hash_key(digest) for digest in hasher.hashes(token_ids, cache_salt)])


def untokenizable(body: JSON, chat: bool) -> str | None:
    """Why the request's token ids cannot be had as the engine will make them (None: they can), which
    is then the reason it is routed by load alone:

    - a chat field that vLLM feeds its chat template (`ChatCompletionRequest.build_chat_params`) but
      no release's `TokenizeChatRequest` takes, so `/tokenize` would render another prompt: `documents`
      (0.13+), `reasoning_effort` (into the template from 0.16, with `enable_thinking` from 0.23; GPT-OSS
      renders it before), `tool_choice` with `tools` other than `auto` (`none` leaves the tools out of
      the prompt on engines run with `--exclude-tools-when-tool-choice-none`; some renderers write it
      into the prompt from 0.32) and `response_format` (some renderers write it into the prompt from
      0.32). The proxy knows neither the engines' flags nor their renderer, so any such value counts.
    - `truncate_prompt_tokens` (chat or completion), which the engine applies to the ids and `/tokenize`
      does not."""
    if body.get("truncate_prompt_tokens") is not None:
        return "truncate_prompt_tokens"
    if not chat:
        return None
    for name in ("documents", "reasoning_effort", "response_format"):
        if body.get(name) is not None:
            return name
    if body.get("tools") and body.get("tool_choice") not in _PLAIN_TOOL_CHOICES:
        return "tool_choice"
    return None


def first_prompt(body: JSON, chat: bool) -> tuple[list[int] | None, JSON | None]:
    """The token ids of the request's (first) prompt when it carries them, else what `/tokenize` needs
    to make them (None and None: nothing to tokenize). See `untokenizable` for what `/tokenize` cannot
    make."""
    model = body.get("model")
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return None, None
        ask: JSON = {"model": model, "messages": messages}
        ask.update({key: body[key] for key in CHAT_TOKENIZE_FIELDS if key in body})
        ask.update({key: body[key] for key in CHAT_TOKENIZE_LATER_FIELDS if body.get(key) is not None})
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


class _Failed(Exception):
    """One engine's `/tokenize` failed fast (`reason`); `final`: no other engine is asked."""

    def __init__(self, reason: str, final: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.final = final


class KVAwareRouter:
    """The per-instance indexes and the scoring of KVAware routing (see the module docstring)."""

    def __init__(self, settings: KVAwareSettings, rng: random.Random) -> None:
        self.settings = settings
        self.rng = rng
        hasher = settings.hasher()
        #: Each role's block hashing (one at first; `learn_block_size` gives a role its engines' size).
        self.hashers: dict[Role, BlockHasher] = dict.fromkeys(ROLES, hasher)
        #: Per instance URL, one index per data-parallel rank (Routed: one).
        self.indexes: dict[str, list[PrefixIndex]] = {}
        #: The role of each indexed instance.
        self.roles: dict[str, Role] = {}
        self.prompt_tokens = Counter(
            "xpyd_proxy_kv_prompt_tokens_total", "Prompt tokens of the requests KVAware routing placed, by role "
            "(the predicted hit rate is xpyd_proxy_kv_predicted_hit_tokens_total over this, as vLLM's is "
            "vllm:prefix_cache_hits_total over vllm:prefix_cache_queries_total).", ("role",))
        self.predicted_hits = Counter(
            "xpyd_proxy_kv_predicted_hit_tokens_total", "Prompt tokens KVAware routing expected the chosen "
            "instance to hold in its prefix cache, by role.", ("role",))
        self.tokenize_failures = Counter(
            "xpyd_proxy_kv_tokenize_failures_total", "Requests KVAware routing placed by load alone for want of "
            "their token ids, by reason: /tokenize's failure (timeout, error, http_4xx, http_5xx, "
            "malformed) or a field /tokenize cannot take (documents, reasoning_effort, tool_choice, "
            "response_format, truncate_prompt_tokens).", ("reason",))
        self.tokenize_seconds = Histogram(
            "xpyd_proxy_kv_tokenize_seconds", "Time to a prompt's token ids from a prefill engine's /tokenize, "
            "by endpoint.", ("endpoint",), buckets=TOKENIZE_BUCKETS)
        self.block_size_changes = Counter(
            "xpyd_proxy_kv_block_size_changes_total", "Times a role's block hashing took the block size its "
            "engines' KV events carry instead of the one it had (--kv-block-size at first), by role.", ("role",))

    @property
    def hasher(self) -> BlockHasher:
        """The prefill engines' block hashing, which a request's keys are made with."""
        return self.hashers["prefill"]

    def block_size(self, role: Role) -> int:
        """Tokens per block of `role`'s engines, as far as the router knows."""
        return self.hashers[role].block_size

    # -- indexes ----------------------------------------------------------------------------------

    def ranks(self, role: Role) -> int:
        """The indexes an instance of `role` has: one per data-parallel rank with events, else one."""
        return self.settings.ranks(role) if self.settings.index == KVIndex.EVENTS else 1

    def index(self, url: str, role: Role, rank: int = 0) -> PrefixIndex:
        """The index of `url`'s data-parallel `rank`, made on first use."""
        indexes = self.indexes.get(url)
        if indexes is None:
            ttl = self.settings.ttl_s if self.settings.index == KVIndex.ROUTED else math.inf
            indexes = self.indexes[url] = [PrefixIndex(self.settings.index_blocks, ttl)
                                           for _ in range(self.ranks(role))]
            self.roles[url] = role
        return indexes[rank]

    def forget(self, url: str) -> None:
        """The instance left the pool (or its events cannot be trusted): drop what is known of it."""
        self.indexes.pop(url, None)
        self.roles.pop(url, None)

    def keep_only(self, urls: set[str]) -> None:
        """Drop the indexes of every instance not in `urls`."""
        for url in [url for url in self.indexes if url not in urls]:
            self.forget(url)

    def blocks(self, url: str) -> int:
        """Blocks indexed for `url`, over its ranks."""
        return sum(index.blocks for index in self.indexes.get(url, ()))

    def learn_block_size(self, role: Role, size: int) -> bool:
        """An engine of `role` published blocks of `size` tokens (its BlockStored's `block_size`). When
        that is not the size the role is hashed at and no engine of the role has a block indexed (so
        none is published at the current size: they would be lost), the role's hashing takes `size`
        (True). False: the size is already the role's, or is not taken (the engines of one role
        disagree: the blocks of the others' size are skipped), or is no block size (below 1, above
        `MAX_BLOCK_SIZE`)."""
        current = self.hashers[role]
        if size == current.block_size or not 1 <= size <= MAX_BLOCK_SIZE:
            return False
        if any(self.blocks(url) for url, owner in self.roles.items() if owner == role):
            return False
        self.hashers[role] = self.settings.hasher(size)
        self.block_size_changes.inc(role)
        return True

    # -- a request ----------------------------------------------------------------------------------

    async def prepare(self, body: JSON, chat: bool, estimate: int, tokenizers: Sequence[Instance],
                      session: aiohttp.ClientSession, headers: dict[str, str]) -> KVAwareRequest:
        """The request's prompt for scoring: token ids from the body or from the `/tokenize` of one of
        `tokenizers` (prefill candidates, in random order: another only after a fast failure, all
        within `tokenize_timeout_s`), hashed at each role's block size."""
        ids, ask = first_prompt(body, chat)
        if ids is None and ask is None:
            return KVAwareRequest(estimate)
        reason = untokenizable(body, chat)
        if reason is not None:
            self.tokenize_failures.inc(reason)
            return KVAwareRequest(estimate)
        if ids is None and ask is not None and tokenizers:
            ids = await self._tokenize(ask, chat, tokenizers, session, headers)
        if ids is None:
            return KVAwareRequest(estimate)
        salt = body.get("cache_salt")
        salt = salt if isinstance(salt, str) and salt else None
        hasher = self.hasher
        keys = block_keys(hasher, ids, salt)
        request = KVAwareRequest(len(ids), keys if keys.blocks else None, block_size=hasher.block_size)
        decode = self.hashers["decode"]
        if decode.block_size != hasher.block_size and self.settings.decode_credit > 0:
            more = block_keys(decode, ids, salt)   # the decode credit's, at the decode engines' size
            request.other_keys[decode.block_size] = more if more.blocks else None
        return request

    async def _tokenize(self, ask: JSON, chat: bool, tokenizers: Sequence[Instance],
                        session: aiohttp.ClientSession, headers: dict[str, str]) -> list[int] | None:
        """The ids of `/tokenize` from one of `tokenizers`, or None (counted by reason). One deadline
        for the request: after a timeout no other engine is asked; after a fast failure of an engine
        (refused, reset, 5xx, a malformed answer) one other is, in the time left."""
        order = self.rng.sample(list(tokenizers), min(2, len(tokenizers)))
        started = time.monotonic()
        reason = "error"
        try:
            async with asyncio.timeout(self.settings.tokenize_timeout_s):
                for instance in order:
                    try:
                        ids = await self._ask(instance, ask, session, headers)
                    except _Failed as failed:
                        reason = failed.reason
                        if failed.final:
                            break
                        continue
                    self.tokenize_seconds.observe(time.monotonic() - started, "chat" if chat else "completions")
                    return ids
        except TimeoutError:
            reason = "timeout"
        self.tokenize_failures.inc(reason)
        log.debug("KVAware: no token ids from /tokenize (%s): routed by load alone", reason)
        return None

    @staticmethod
    async def _ask(instance: Instance, ask: JSON, session: aiohttp.ClientSession,
                   headers: dict[str, str]) -> list[int]:
        """One engine's `/tokenize` ids; `_Failed` when it fails fast, TimeoutError when it times out."""
        try:
            async with session.post(instance.url + "/tokenize", json=ask, headers=headers) as response:
                if response.status != 200:
                    raise _Failed(f"http_{response.status // 100}xx", final=response.status in _FINAL_STATUSES)
                ids = _token_ids(await response.json(content_type=None))
        except TimeoutError:   # aiohttp's own timeouts too (ServerTimeoutError is a ClientError as well)
            raise
        except (aiohttp.ClientError, OSError, ValueError):
            raise _Failed("error") from None
        if ids is None:
            raise _Failed("malformed")
        return ids

    def hit_tokens(self, instance: Instance, request: KVAwareRequest, now: float) -> int:
        """The prompt tokens `instance` holds from the first, as its index says (at most the blocks
        before the prompt's last token), at its role's block size."""
        size = self.block_size(instance.role)
        return self._hits([instance], size, request.keys_at(size), request.prompt_tokens, now)[0]

    def _hits(self, candidates: Sequence[Instance], size: int, keys: BlockKeys | None, prompt_tokens: int,
              now: float) -> list[int]:
        """`hit_tokens` of each of `candidates`, instances of one role: `size` its block size, `keys`
        the prompt's keys at it (the block size, keys and limit depend on the role, not the instance)."""
        if keys is None:
            return [0] * len(candidates)
        limit = scoring.hit_limit(prompt_tokens, size)
        hits = []
        for candidate in candidates:
            indexes = self.indexes.get(candidate.url)
            hits.append(max(index.match(keys, now, limit) for index in indexes) * size if indexes else 0)
        return hits

    def choose(self, role: Role, candidates: Sequence[Instance], request: KVAwareRequest, now: float) -> Instance:
        """The candidate KVAware routing picks for `request` among `candidates`, instances of `role`
        (see the module docstring); `candidates` must not be empty. Records the hits it scored, and,
        with the Routed index, what it sent."""
        if not candidates:
            raise ValueError("no candidates to pick from")
        settings = self.settings
        prompt = request.prompt_tokens
        size = self.block_size(role)
        keys = request.keys_at(size)
        hits = self._hits(candidates, size, keys, prompt, now)
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
        if settings.index == KVIndex.ROUTED and keys is not None:
            self.index(chosen.url, role).record(keys, now)
        return chosen

    def chooser(self, role: Role, request: KVAwareRequest | None) -> Callable[[Sequence[Instance]], Instance] | None:
        """A `Pool.choose` override for `request` (None: the request is picked by load alone)."""
        if request is None:
            return None
        return lambda candidates: self.choose(role, candidates, request, time.monotonic())


class KVAware:
    """KVAware routing as the proxy's server uses it: the router, and with the Events index the
    subscribers to every engine's KV events (`xpyd.proxy.kvevents`)."""

    def __init__(self, settings: KVAwareSettings, rng: random.Random) -> None:
        self.router = KVAwareRouter(settings, rng)
        self.hub: Hub | None = None
        if settings.index == KVIndex.EVENTS:
            from xpyd.proxy.kvevents import Hub  # pyzmq, needed only here

            self.hub = Hub(self.router, settings)

    async def prepare(self, context: Context, prefills: Sequence[Instance],
                      session: aiohttp.ClientSession) -> KVAwareRequest:
        """The request's prompt for scoring (`KVAwareRouter.prepare`), tokenized by one of `prefills`."""
        parsed = context.parsed
        headers = {"X-Request-Id": context.request_id}
        if context.authorization:
            headers["Authorization"] = context.authorization
        try:
            return await self.router.prepare(parsed.body, parsed.api == "chat", parsed.prompt_tokens, prefills,
                                             session, headers)
        except Exception:  # a bug here must cost the request its cache hits, never the request
            log.exception("KVAware: request %s routed by load alone", context.request_id)
            return KVAwareRequest(parsed.prompt_tokens)

    def chooser(self, role: Role, request: KVAwareRequest | None) -> Callable[[Sequence[Instance]], Instance] | None:
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

        def block_sizes() -> Iterable[GaugeSample]:
            for role in pools:
                yield (role,), float(router.block_size(role))

        out: list[Collector] = [router.prompt_tokens, router.predicted_hits, router.tokenize_failures,
                                router.tokenize_seconds, router.block_size_changes,
                                Gauge("xpyd_proxy_kv_index_blocks", "Blocks KVAware routing indexes per upstream "
                                      "(over its data-parallel ranks).", ("role", "upstream"), blocks),
                                Gauge("xpyd_proxy_kv_block_size", "Tokens per block KVAware routing hashes a role's "
                                      "prompts at (--kv-block-size, or what its engines' KV events carry).",
                                      ("role",), block_sizes)]
        if self.hub is not None:
            out += self.hub.metrics.collectors()
        return out

    async def close(self) -> None:
        if self.hub is not None:
            await self.hub.close()


# -- command line -----------------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `--kv-*` flags of KVAware routing (`xpyd.render.kvaware` renders them from the spec)."""
    defaults = KVAwareSettings()
    group = parser.add_argument_group("KVAware routing (--routing-policy KVAware)")
    group.add_argument("--kv-index", default=defaults.index.value, choices=[i.value for i in KVIndex],
                       help="what the proxy knows the engines cache: Events (their KV events, subscribed to over "
                       "ZMQ) or Routed (what this proxy sent where, for --kv-ttl seconds)")
    group.add_argument("--kv-weight", type=non_negative_float, default=defaults.kv_weight,
                       help="prefill score: expected compute outstanding + this x prompt tokens not cached there")
    group.add_argument("--kv-decode-credit", type=non_negative_float, default=defaults.decode_credit,
                       help="decode score: outstanding requests - this x share of the prompt cached there")
    group.add_argument("--kv-ttl", type=positive_float, default=defaults.ttl_s,
                       help="Routed: seconds a prompt's blocks are remembered after the last request with them")
    group.add_argument("--kv-index-blocks", type=positive_int, default=defaults.index_blocks,
                       help="blocks indexed per engine and per data-parallel rank; least recently seen go first")
    group.add_argument("--kv-block-size", type=positive_int, default=defaults.block_size,
                       help="the engines' --block-size (tokens per KV block); with Events each role then takes "
                       "the size its engines' events carry")
    group.add_argument("--kv-hash-algo", default=defaults.hash_algo, choices=vllm.PREFIX_CACHING_HASH_ALGOS,
                       help="Events: the engines' --prefix-caching-hash-algo (Routed hashes with sha256)")
    group.add_argument("--kv-hash-seed", default=None,
                       help="Events: the engines' PYTHONHASHSEED, which seeds vLLM's first block hash (unset: "
                       "vLLM's fixed seed, which sha256 and sha256_cbor use from 0.32 on; the xxhash algorithms "
                       "are seeded at random per process without it, and no hash would match)")
    group.add_argument("--kv-tokenize-timeout", type=positive_float, default=defaults.tokenize_timeout_s,
                       metavar="SECONDS",
                       help="seconds a text or chat request may wait for its token ids from the prefill engines' "
                       f"/tokenize before it is routed by load alone (default {defaults.tokenize_timeout_s:g}, at "
                       f"most {MAX_TOKENIZE_TIMEOUT_S:g})")
    group.add_argument("--kv-events-port", type=port, default=defaults.events_port,
                       help="Events: the engines' KV event PUB port (rank r publishes on it + r)")
    group.add_argument("--kv-events-replay-port", type=port, default=defaults.events_replay_port,
                       help="Events: the engines' KV event replay port (rank r answers on it + r)")
    group.add_argument("--kv-events-topic", default=defaults.events_topic, help="Events: the engines' topic")
    group.add_argument("--kv-events-prefill-ranks", type=positive_int, default=defaults.prefill_ranks, metavar="N",
                       help="Events: data-parallel ranks per prefill engine pod, each publishing on its own ports")
    group.add_argument("--kv-events-decode-ranks", type=positive_int, default=defaults.decode_ranks, metavar="N",
                       help="Events: data-parallel ranks per decode engine pod")


def settings_from_args(args: argparse.Namespace) -> KVAwareSettings:
    """`KVAwareSettings` from the parsed `--kv-*` flags."""
    return KVAwareSettings(index=KVIndex(args.kv_index), kv_weight=args.kv_weight,
                           decode_credit=args.kv_decode_credit, ttl_s=args.kv_ttl,
                           index_blocks=args.kv_index_blocks, block_size=args.kv_block_size,
                           hash_algo=args.kv_hash_algo, hash_seed=args.kv_hash_seed, events_port=args.kv_events_port,
                           events_replay_port=args.kv_events_replay_port, events_topic=args.kv_events_topic,
                           prefill_ranks=args.kv_events_prefill_ranks, decode_ranks=args.kv_events_decode_ranks,
                           tokenize_timeout_s=args.kv_tokenize_timeout)


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
    if settings.tokenize_timeout_s > MAX_TOKENIZE_TIMEOUT_S:
        return f"--kv-tokenize-timeout must be at most {MAX_TOKENIZE_TIMEOUT_S:g} seconds"
    if events:
        if (ports := _ports_problem(settings)) is not None:
            return ports
        try:
            import zmq  # noqa: F401
        except ModuleNotFoundError:
            return "--kv-index Events subscribes to the engines' KV events over ZMQ, which needs pyzmq"
    return None


def _ports_problem(settings: KVAwareSettings) -> str | None:
    """Why the engines' KV event ports cannot be: each rank of either role publishes on the events port
    plus its rank and answers replays on the replay port plus its rank (vLLM's `offset_endpoint_port`)."""
    ranks = max(settings.prefill_ranks, settings.decode_ranks)
    for flag, first in (("--kv-events-port", settings.events_port),
                        ("--kv-events-replay-port", settings.events_replay_port)):
        if first + ranks > 65536:
            return (f"{flag} {first} plus the data-parallel ranks (--kv-events-prefill-ranks, "
                    f"--kv-events-decode-ranks: up to {ranks}) must stay below 65536")
    low, high = sorted((settings.events_port, settings.events_replay_port))
    if high < low + ranks:
        return (f"--kv-events-port {settings.events_port} and --kv-events-replay-port "
                f"{settings.events_replay_port} overlap over {ranks} data-parallel rank(s): every rank needs "
                "a port of each")
    return None

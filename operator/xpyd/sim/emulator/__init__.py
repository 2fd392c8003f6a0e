"""`xpyd engine-sim`: one process that behaves like one vLLM engine on the wire, in real time.

The engine is an `EngineCore` (the continuous-batching model the cluster simulator uses) driven by
the wall clock: the loop asks the core for the next step, sleeps through it, applies it and hands
the tokens to the HTTP handlers. Behind it is an aiohttp server with vLLM 0.33's OpenAI-compatible
surface: `/v1/completions`, `/v1/chat/completions` (streamed or not), `POST /tokenize`, `/v1/models`,
`/health`, `/ping`, `/version` and `/metrics` (the `vllm:*` families the engine model drives: see
`exposition`), and with VLLM_SERVER_DEV_MODE=1 `POST /reset_prefix_cache`. The engine keeps vLLM's prefix cache and
publishes its KV events (below). tests/conformance/test_emulator_vs_real.py holds the answers, the
`kv_transfer_params` and the metric families against recordings of real vLLM;
tests/conformance/test_kv_events_vs_real.py holds the prefix cache's hits, counters and KV events
against a real vLLM engine sent the same prompts.

Time
====

`--time-scale K` runs the model K times faster than real time: every modelled duration (prefill and
decode steps, KV transfers, the KV lease, `--startup-delay-s`) is divided by K. The core runs on the
process's monotonic clock in *wall seconds* with a performance model scaled by 1/K, so everything the
engine reports -- `/metrics` histograms, rates Prometheus derives from its counters -- is in the wall
seconds a client experiences; multiply by K for modelled seconds. (`--shutdown-timeout` and HTTP
keep-alive are real seconds: Kubernetes and clients count them.)

The loop keeps a nominal schedule: a step that ends at `t` starts the next one at `t` even when the
process woke up late, so wake-up jitter delays when tokens are delivered but never accumulates into
the modelled timeline. asyncio's timers are up to a millisecond late (epoll counts whole
milliseconds), so the loop sleeps to within `TIMER_SLACK_S` of a step's end and spins the event loop
(handlers keep running) for the rest: about 0.5 ms of CPU per step while the engine is busy. Arrivals wait in an inbox
stamped with their wall time and enter the core at the first step boundary at or after it, as in the
simulator. If the process falls more than `MAX_LAG_S` behind (CPU starvation, or a time scale the
process cannot keep up with), the schedule is reset to the wall clock and a warning logged.

Wire behaviour (vLLM 0.33 unless noted)
=======================================

- Every request generates exactly its `max_tokens` (for chat, `max_completion_tokens` wins when both
  are set; completions ignore it, as vLLM does) and finishes with `finish_reason: "length"`, as if
  `ignore_eos` were set. Defaults: 16 for completions, `max_model_len - prompt` for chat; a
  `max_tokens` that fits `--max-model-len` but not beside the prompt is lowered to what is left
  (vLLM's `get_max_tokens`). Each token's text is `" tok"`. A streamed response sends one SSE event
  per token; tokens that are ready together go out in one write.
- Answers have vLLM's fields, null where the emulator has nothing to say (`token_ids`,
  `routed_experts`, `weight_versions`, `ec_transfer_params`, `metrics`, ...), and its
  `system_fingerprint` (`vllm-0.33.0[-tp<n>]-<hash of the engine's configuration>`); SSE events carry
  the fields vLLM's serving code sets (`kv_transfer_params` among them, a prefill leg's on its final
  event), the usage event only its non-null ones. Random ids are vLLM's 16 hex digits.
- Prompt tokens (`tokens`): a prompt of token ids (`[1, 2, 3]`, or a one-element batch of it) is
  taken as it is (a negative id is "out of vocabulary", 400); text is one token per four characters
  (at least 1), each token's id a hash of its four characters; a chat prompt is framed like Llama 3's
  chat template with fixed ids: 1 (BOS) + per message (5 framing tokens + its text) + 4 (the assistant
  header). vLLM's chat fields `add_generation_prompt` (false: no assistant header),
  `continue_final_message` (the last message left open; refused beside `add_generation_prompt`, as in
  vLLM) and `add_special_tokens` (a second BOS) change a chat's tokens as they would Llama 3's
  (`tokens`). Batched prompts, `n > 1` and non-text chat content are rejected with 400 (not emulated).
- `POST /tokenize` (vLLM's `TokenizeCompletionRequest` with `prompt`, or `TokenizeChatRequest` with
  `messages` and the chat fields above) answers vLLM's `TokenizeResponse`: `{"count", "max_model_len",
  "tokens", "token_strs"}`, the ids exactly those the generation endpoints hash into prefix-cache
  blocks for the same prompt or chat (so a router hashing them finds the engine's blocks), and with
  `return_token_strs` each token's text (its four characters, or Llama 3's name of a special token).
  Text gets no special token from `add_special_tokens` (the emulated tokenizer adds none to text); a
  prompt longer than the context is tokenized all the same; `chat_template`, `chat_template_kwargs`,
  `tools` and `mm_processor_kwargs` are checked for their types and change nothing. A body vLLM's
  protocol models refuse (no `prompt` nor `messages`, a prompt of token ids, a field of the wrong
  type, both `continue_final_message` and `add_generation_prompt`) is a 400 of type `Bad Request`
  with the field as `param` (vLLM's validation handler); an unknown model a 404 as below. It is
  served while draining (vLLM tokenizes in its API server, without the engine).
  tests/conformance/test_tokenize_conformance.py holds the shapes to every release's protocol
  classes and the answers to vLLM's own `TokenizeResponse`.
- Errors use vLLM's envelope `{"error": {"message", "type", "param", "code"}}`: 400
  `BadRequestError` for bad JSON, bad types, `max_tokens < 1`, `stream_options` without `stream`,
  and with vLLM's messages and `param` for `max_tokens` (or `max_completion_tokens`) over
  `--max-model-len` (`param: "max_tokens"`), a prompt over it (`"input_tokens"`) or filling it (no
  room for one token); 404 `NotFoundError` ("The model `x` does not exist. Valid aliases: ...",
  `param: "model"`) for an unknown model (an absent `model` is the served model, as in vLLM); 503 while loading;
  500 `InternalServerError` when a KV load fails under `kv_load_failure_policy: fail` (in a
  stream: an error event, then `data: [DONE]`).
- `/health` and `/ping` answer 200 when ready, draining too (vLLM's handler answers 503 only for a
  dead engine), and 503 while "loading" (`--startup-delay-s`); so do the generation endpoints. Real
  vLLM refuses connections until loaded; the 503 window lets probes and proxies be tested against a
  loading engine. Idle keep-alive connections are closed after 5 s, as vLLM's uvicorn does.
- SIGTERM, as vLLM's launcher and EngineCore handle it: HTTP keeps serving -- `/health` 200, and a new
  generation request (once validated) is rejected at once as vLLM's EngineCore rejects requests in
  shutdown: 200 with `finish_reason: "abort"`, no text, 0 completion tokens and no
  `kv_transfer_params` (streamed: the same as one event, then usage if asked and `[DONE]`), counted in
  `vllm:request_success_total{finished_reason="abort"}` -- while in-flight requests finish and held KV
  is pulled (the NIXL side channel stays up), up to `--shutdown-timeout` (default 0: abort them at
  once); then the engine closes and exits 0. A proxy stops routing to a draining pod because discovery
  sees its deletionTimestamp, not through `/health`.

P/D (NixlConnector, pull), when a KV connector is configured (`--kv-transfer-config` or `--role`)
==============================================================================================

Roles follow the request, as in vLLM; `kv_role` only names the engine's intent.

- Request ids are vLLM's: the response's `id` is `cmpl-{X-Request-Id}` (`chatcmpl-` for chat; a random
  hex id without the header), and the engine's internal id adds the prompt index for completions
  (`-0`) and, as vLLM has since 0.16, 8 random hex digits (`cmpl-r1-0-1a2b3c4d`).
- `kv_transfer_params.do_remote_decode` (the prefill leg): the request stops after its first token and
  the response carries NixlConnector's (pull) `kv_transfer_params`: `{do_remote_prefill: true,
  do_remote_decode: false, remote_block_ids (synthetic, one per `--block-size` tokens, one list per
  KV-cache group: `[[...]]`), remote_engine_id, remote_request_id (the internal id), remote_host,
  remote_port, tp_size, dcp_size: 1, pp_size: 1, remote_num_tokens (the prompt's tokens),
  remote_blocks_expiry_time: null (vLLM sets it only for blocks pinned on a decode engine),
  transfer_mode: "pull", remote_registration_generation (new in 0.33; tp_size: one handshake payload
  published per rank), remote_prefill_cached_tokens (the prompt tokens the prefill engine found in its
  prefix cache)}`. The decode leg takes `remote_block_ids` per group or flat (before 0.18), and ignores
  the ids. `remote_host`/`remote_port` are the NIXL side channel: `VLLM_NIXL_SIDE_CHANNEL_HOST`
  (default `--host`) and `VLLM_NIXL_SIDE_CHANNEL_PORT` (default 5600; 0 picks a free port). The engine
  serves its HTTP API on that address too and holds the request's KV until the consumer releases it
  or the lease (`kv_lease_duration` from the connector's extra config, or `--kv-lease-s`, default 30 s)
  expires.
- `kv_transfer_params.do_remote_prefill` (the decode leg): the request is queued at once; admitted,
  it takes its longest prefix from its own prefix cache, waits the modelled KV transfer of the rest
  (`PerfModel.kv_transfer_seconds`, as NIXL asks for the prompt less the local hits), counts that
  rest as `external_kv_transfer` and decodes only; its `prompt_tokens_details.cached_tokens` is the
  prefill engine's `remote_prefill_cached_tokens`, as vLLM reports it. Beside the transfer, as NIXL's
  handshake and read would, the engine asks the producer's side channel
  (`GET /xpyd/kv/{remote_request_id}`, loopback only) whether it holds the KV and how long its lease
  has left (until it answers, the lease is taken to start at arrival); a transfer that ends before the
  answer waits for it (then loads again, which only matters when a round trip outlasts the transfer,
  i.e. at high time scales: the first landing caches nothing, since its KV is not known to exist yet,
  and the second lookup of the prefix cache is not counted in `vllm:prefix_cache_*`). When the KV has
  arrived the engine tells the producer (`POST /xpyd/kv/{remote_request_id}/release`), which frees
  the blocks before the lease ends, as NIXL's completion notification does.
- A KV load that cannot happen -- the producer is unreachable or outside loopback, it holds no such
  request (unknown, or its lease expired), the parameters are incomplete, or the lease expires while
  the request waits for admission -- follows `kv_load_failure_policy`: `fail` answers 500 (counted in
  `vllm:request_success_total{finished_reason="error"}` and `vllm:nixl_num_failed_transfers_total`);
  `recompute` prefills the prompt locally (`local_compute`, and a failed transfer).
- No `kv_transfer_params` on any engine: the prompt is computed locally (`local_compute`).
- Fault injection (not vLLM's): `PUT /xpyd/faults` `{"unreadable_from": [host, ...]}` makes every KV
  load from those prefill side-channel hosts fail as a broken link would (`"*"`: all hosts; `[]`
  repairs them); `GET` shows the list.

Prefix cache and KV events (vLLM 0.33's flags)
==============================================

- `--enable-prefix-caching` (the default) / `--no-enable-prefix-caching`, `--block-size` (16, vLLM's
  default on GPUs; vLLM's CPU backend takes 128, and multiples of 32 only), `--prefix-caching-hash-algo`
  (`sha256`, `sha256_cbor`, `xxhash`, `xxhash_cbor`; the xxhash ones need the xxhash package and a
  `PYTHONHASHSEED` to hash alike across engines), `--num-gpu-blocks-override N` (the KV capacity is
  `(N - 1) x --block-size` tokens: one block is vLLM's null block).
- Each request's full prompt blocks are keyed by vLLM's hash chain of its token ids
  (`kvcache.hashing`: parent hash, the block's ids, the `cache_salt` on the first block; the first
  parent is `NONE_HASH` of "vllm-none-hash", or `PYTHONHASHSEED`), so the engine model's block pool
  (`sim.core`, `kvcache.pool`) decides the hits, the LRU eviction and the capacity shared with the
  running requests; a request hits at most `prompt - 1` tokens, in whole blocks. `xpyd bench`'s
  prompts give equal text where a Mooncake trace's `hash_ids` are equal, so equal blocks, and an
  emulated engine hits exactly where the trace says (tests/integration/test_engine_sim_prefix_cache.py).
- `vllm:prefix_cache_queries`/`_hits` and the related families (see `exposition`);
  `usage.prompt_tokens_details` (`cached_tokens`, and for chat `created_cache_tokens`) with
  `--enable-prompt-tokens-details` only, as in vLLM; a prefill leg's `remote_prefill_cached_tokens`.
- `--kv-events-config` (vLLM's `KVEventsConfig`, JSON or dotted: `enable_kv_cache_events`,
  `publisher`, `endpoint`, `replay_endpoint`, `buffer_steps`, `hwm`, `max_queue_size`, `topic`)
  publishes vLLM 0.33's KV events (`kvcache.events`, `kvevents`): a `BlockStored` per caching of a
  request's blocks, a `BlockRemoved` per evicted block, `AllBlocksCleared` after a reset, one
  `EventBatch` per step on a ZMQ PUB socket (topic, sequence, msgpack payload), the last
  `buffer_steps` batches on the replay ROUTER; ports offset by `--data-parallel-rank`; hashes as
  integers unless VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0. An endpoint vLLM binds is bound on `--host`
  (loopback) rather than every interface. Blocks of generated tokens are neither announced nor
  removed (the engine model caches them only when a request ends, as blocks no prompt can hit; vLLM
  announces them as decode fills them); `kv_cache_report_mode: "full"` (announcing hits again) and
  preempting running requests to reset the cache are not emulated.
- `GET /xpyd/kv/blocks` (not vLLM's) lists the prompt blocks the cache holds, as the KV events name
  them, how many are cached twice (two requests computed them side by side) and the batches published:
  what a router's index of the engine should hold (`?format=u64`: the 64-bit keys in binary).
  benchmarks/kv_events_bench.py checks the proxy's Events index against it.
"""


# Modules: `config` (arguments and the scaled performance model), `engine` (the real-time engine),
# `tokens` (token ids without a tokenizer), `wire` (request parsing and response bodies), `http` (the
# aiohttp server), `exposition` (`/metrics`), `kvevents` (KV events and their ZMQ publisher), `main`
# (the command line; `python -m xpyd.sim.emulator`).

"""What each KV connector expects on the two legs of a disaggregated request. Pure: no I/O.

The proxy sends every client request twice: a prefill leg that computes the prompt's KV cache and
generates one token, and a decode leg that receives the KV cache and generates the answer the
client sees. The connectors differ in what the legs carry and whether they may run at once
(vLLM 0.33 unless noted; see `docs/proxy.md` and `docs/connectors.md`):

- NixlConnector (pull, `toy_proxy_server.py`): prefill first with
  `kv_transfer_params={do_remote_decode: true, ...}`; its answer's `kv_transfer_params` (block ids,
  engine id, side-channel address) go to decode, which reads the KV from prefill. Sequential.
- NixlPushConnector (vLLM 0.24+, `toy_push_proxy_server.py`, `nixl/push_scheduler.py`,
  `nixl/push_worker.py`): prefill first; decode gets the identity of the engine that ran it
  (`remote_engine_id`, `remote_host`, `remote_port`, `tp_size`, `pp_size`, `dcp_size`) and
  prefill's own internal request id (`remote_request_id`, from the answer: decode heartbeats it to
  extend prefill's lease), no block ids; it registers its blocks and prefill writes into them,
  matched by the X-Request-Id both legs share. Sequential.
- MooncakeConnector (`mooncake_connector_proxy.py`): both legs at once, tied by a `transfer_id`;
  decode gets prefill's bootstrap address and engine id. A prefill pod runs one bootstrap server
  (on its global rank 0, at VLLM_MOONCAKE_BOOTSTRAP_PORT) for all its data-parallel ranks;
  `GET /query` maps each DP rank to its engine id (`{"0": {"engine_id": ...}, "1": ...}`). The
  prefill leg is pinned to one rank with the `X-data-parallel-rank` header, and decode gets that
  rank's engine id (decode's connector resolves the rank's workers from the same `/query`).
- P2pNcclConnector (vLLM <= 0.23, `disagg_proxy_p2p_nccl_xpyd.py`): no `kv_transfer_params`; the
  request id `___prefill_addr_{P}___decode_addr_{D}_{uuid}` tells each side its peer's ZMQ address.
  Sequential.
- LMCacheConnectorV1 with `enable_pd` (vLLM's `lmcache_integration/vllm_v1_adapter.py`, LMCache's
  `lmcache/integration/vllm/vllm_v1_adapter.py` and `pd_backend.py`, LMCache's
  `disagg_proxy_server_first_token_from_prefiller_xpyd.py`): prefill carries
  `{ret_first_tok: true, disagg_spec: {req_id, receiver_host, receiver_init_port: [...],
  receiver_alloc_port: [...]}}` (a kv_producer asserts `disagg_spec` for every request it saves;
  the ports are lists indexed by tensor-parallel rank) and answers `{first_tok: <token id>}`;
  LMCache pushes the KV to the decode instance named there, which gets the client's body.
  Sequential.

Both legs of an attempt carry the same `X-Request-Id`, a fresh uuid4 per attempt (never the
client's: vLLM's internal request ids and the connectors' pairing derive from it).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Final

from xpyd.api.models import LMCACHE_PD_PEER_ALLOC_PORT, LMCACHE_PD_PEER_INIT_PORT, Connector
from xpyd.common.jsontypes import JSON

#: The prefill leg's `kv_transfer_params` for NIXL (pull and push), exactly as vLLM's proxies send them.
NIXL_PREFILL_PARAMS: Final[Mapping[str, Any]] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}

#: Fields the prefill leg must not carry: it generates one token and answers in one piece.
_PREFILL_DROPPED: Final = ("stream_options", "min_tokens", "min_completion_tokens")

#: The identity of a NixlPushConnector prefill engine, as its answers report it.
PUSH_IDENTITY_REQUIRED: Final = ("remote_engine_id", "remote_host", "remote_port", "tp_size")
PUSH_IDENTITY_OPTIONAL: Final = ("pp_size", "dcp_size")

#: vLLM's MooncakeConnector bootstrap port default (VLLM_MOONCAKE_BOOTSTRAP_PORT).
MOONCAKE_BOOTSTRAP_PORT: Final = 8998
#: LMCache P/D: the decode side's first `pd_peer_init_port` and `pd_peer_alloc_port` (tensor-parallel
#: rank i listens on port + i), as LMCache's P/D example configures them (one source: the API's).
LMCACHE_INIT_PORT: Final = LMCACHE_PD_PEER_INIT_PORT
LMCACHE_ALLOC_PORT: Final = LMCACHE_PD_PEER_ALLOC_PORT
#: The header that pins a request to one data-parallel rank of a vLLM server (internal load balancing).
DP_RANK_HEADER: Final = "X-data-parallel-rank"
#: vLLM's P2pNcclConnector first ZMQ port (kv_port; rank r listens on kv_port + r).
P2P_NCCL_KV_PORT: Final = 14579


@dataclass(frozen=True)
class ConnectorTraits:
    """How the proxy drives one connector."""

    #: Both legs are sent at once (once whatever decode needs up front is known).
    concurrent: bool
    #: A decode leg that failed before its first byte may be sent again to another decode instance
    #: with the same prefill result (the KV stays on prefill until decode reads it).
    decode_reuses_prefill: bool
    #: The prefill answer must carry `kv_transfer_params` (else the KV hand-off silently fails
    #: and decode would recompute the prompt: treated as a prefill failure).
    prefill_answer_has_params: bool


TRAITS: Final[Mapping[Connector, ConnectorTraits]] = {
    Connector.NIXL: ConnectorTraits(concurrent=False, decode_reuses_prefill=True, prefill_answer_has_params=True),
    Connector.NIXL_PUSH: ConnectorTraits(concurrent=False, decode_reuses_prefill=False,
                                         prefill_answer_has_params=True),
    Connector.MOONCAKE: ConnectorTraits(concurrent=True, decode_reuses_prefill=False,
                                        prefill_answer_has_params=False),
    # LMCache pushes the KV to the decode instance the prefill leg named: another decode instance
    # would not have it, so a failed decode is a new attempt.
    Connector.LMCACHE: ConnectorTraits(concurrent=False, decode_reuses_prefill=False,
                                       prefill_answer_has_params=True),
    Connector.P2P_NCCL: ConnectorTraits(concurrent=False, decode_reuses_prefill=False,
                                        prefill_answer_has_params=False),
}


def prefill_body(body: Mapping[str, Any], kv_transfer_params: Mapping[str, Any] | None) -> JSON:
    """The prefill leg: a copy of the client's body that generates one token, unstreamed, without
    the fields prefill must not see, with `kv_transfer_params` (or none)."""
    leg = {key: value for key, value in body.items() if key not in _PREFILL_DROPPED}
    leg["max_tokens"] = 1
    if "max_completion_tokens" in leg:
        leg["max_completion_tokens"] = 1
    leg["stream"] = False
    if kv_transfer_params is None:
        leg.pop("kv_transfer_params", None)
    else:
        leg["kv_transfer_params"] = dict(kv_transfer_params)
    return leg


def decode_body(body: Mapping[str, Any], kv_transfer_params: Mapping[str, Any] | None) -> JSON:
    """The decode leg: the client's body as sent, with the hand-off parameters (a client's own
    `kv_transfer_params` never reach an engine)."""
    leg = dict(body)
    if kv_transfer_params is None:
        leg.pop("kv_transfer_params", None)
    else:
        leg["kv_transfer_params"] = dict(kv_transfer_params)
    return leg


# -- NIXL push ---------------------------------------------------------------------------------


def push_identity(kv_transfer_params: Any) -> JSON | None:
    """The prefill engine's identity from a NixlPushConnector prefill answer, or None when the
    answer does not carry a complete one (then decode cannot register with it)."""
    if not isinstance(kv_transfer_params, dict):
        return None
    identity: JSON = {}
    for key in PUSH_IDENTITY_REQUIRED:
        value = kv_transfer_params.get(key)
        if value is None or isinstance(value, list | dict):
            return None
        identity[key] = value
    for key in PUSH_IDENTITY_OPTIONAL:
        if kv_transfer_params.get(key) is not None:
            identity[key] = kv_transfer_params[key]
    return identity


def push_decode_params(identity: Mapping[str, Any], prefill_request_id: str) -> JSON:
    """Decode's `kv_transfer_params` in push mode: prefill's identity, no block ids (decode
    allocates its own and registers them), and prefill's internal request id as its answer reports
    it (`remote_request_id`: what decode's heartbeats name; vLLM reads it unconditionally in
    `NixlConnectorMetadata.add_new_req_to_recv`)."""
    return {**identity, "do_remote_prefill": True, "do_remote_decode": False, "remote_request_id": prefill_request_id}


# -- Mooncake ----------------------------------------------------------------------------------


def mooncake_transfer_id(request_id: str) -> str:
    """The id that ties a Mooncake prefill and decode together (vLLM's proxy: `xfer-<request id>`)."""
    return f"xfer-{request_id}"


def mooncake_prefill_params(transfer_id: str) -> JSON:
    """Prefill's `kv_transfer_params` for Mooncake."""
    return {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": transfer_id}


def mooncake_decode_params(transfer_id: str, bootstrap_addr: str, engine_id: str) -> JSON:
    """Decode's `kv_transfer_params` for Mooncake: where prefill's bootstrap server is and which
    engine (data-parallel rank) holds the KV."""
    return {"do_remote_decode": False, "do_remote_prefill": True, "remote_bootstrap_addr": bootstrap_addr,
            "remote_engine_id": engine_id, "transfer_id": transfer_id}


def mooncake_engine_ids(query_answer: Any) -> dict[int, str]:
    """The engine id of every data-parallel rank in a bootstrap server's `GET /query` answer
    (`{"0": {"engine_id": ..., "worker_addr": ...}, "1": ...}`); entries that are not a rank with a
    non-empty string engine id are left out."""
    if not isinstance(query_answer, dict):
        return {}
    engines: dict[int, str] = {}
    for key, entry in query_answer.items():
        rank = _rank(key)
        engine_id = entry.get("engine_id") if isinstance(entry, dict) else None
        if rank is not None and isinstance(engine_id, str) and engine_id:
            engines[rank] = engine_id
    return engines


def _rank(key: Any) -> int | None:
    """A data-parallel rank from a JSON object key ("0", "1", ...), or None."""
    if isinstance(key, int) and not isinstance(key, bool):
        return key if key >= 0 else None
    if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 6:
        return int(key)
    return None


def mooncake_engine_id(query_answer: Any, rank: int = 0) -> str | None:
    """The engine id of data-parallel `rank` in a bootstrap server's `GET /query` answer, or None."""
    return mooncake_engine_ids(query_answer).get(rank)


# -- LMCache ----------------------------------------------------------------------------------


def lmcache_prefill_params(req_id: str, receiver_host: str, init_port: int = LMCACHE_INIT_PORT,
                           alloc_port: int = LMCACHE_ALLOC_PORT, decode_tp_size: int = 1) -> JSON:
    """Prefill's `kv_transfer_params` for LMCache P/D: ask for the first token back and say where
    to push the KV (the decode instance's host, one init and one alloc port per decode TP rank)."""
    return {"ret_first_tok": True, "disagg_spec": {
        "req_id": req_id,
        "receiver_host": receiver_host,
        "receiver_init_port": [init_port + rank for rank in range(decode_tp_size)],
        "receiver_alloc_port": [alloc_port + rank for rank in range(decode_tp_size)],
    }}


def lmcache_first_token(kv_transfer_params: Any) -> int | None:
    """The token id an LMCache P/D prefill answer reports as `first_tok`, or None."""
    if not isinstance(kv_transfer_params, dict):
        return None
    token = kv_transfer_params.get("first_tok")
    return token if isinstance(token, int) and not isinstance(token, bool) and token >= 0 else None


#: Completion fields that make the first-token hand-off unsafe: the answer would need prefill's token
#: in places the proxy does not rebuild (logprobs, echoed prompt, several choices, a suffix).
_SPLICE_UNSAFE: Final = ("echo", "logprobs", "prompt_logprobs", "suffix")


def lmcache_first_token_eligible(completions: bool, body: Mapping[str, Any]) -> bool:
    """Whether decode may start after prefill's first token (LMCache's first-token proxy): a
    completion of one prompt (text or token ids), one choice, at least 2 tokens, and none of the
    fields the proxy cannot splice the first token into."""
    prompt = body.get("prompt")
    token_ids = isinstance(prompt, list) and bool(prompt) and \
        all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    single = (isinstance(prompt, str) and prompt != "") or token_ids
    max_tokens = body.get("max_tokens")
    return (completions and single and body.get("n") in (None, 1) and body.get("best_of") in (None, 1)
            and isinstance(max_tokens, int) and not isinstance(max_tokens, bool) and max_tokens >= 2
            and all(body.get(key) is None or body.get(key) is False for key in _SPLICE_UNSAFE))


def lmcache_decode_body(body: Mapping[str, Any], prompt_ids: list[int], first_token: int) -> JSON:
    """Decode's body after prefill's first token: the prompt's token ids plus that token, one token
    fewer to generate (and to require), no `kv_transfer_params`."""
    leg = decode_body(body, None)
    leg["prompt"] = [*prompt_ids, first_token]
    leg["max_tokens"] = int(body["max_tokens"]) - 1
    if isinstance(body.get("min_tokens"), int) and body["min_tokens"] > 0:
        leg["min_tokens"] = body["min_tokens"] - 1
    return leg


class FirstTokenSplice:
    """Puts prefill's first token back into decode's completion answer: its text in front, and the
    usage counted as the client's request (decode saw that token as prompt)."""

    def __init__(self, text: str) -> None:
        self.text = text
        self._buffer = b""

    def _usage(self, usage: Any) -> None:
        if isinstance(usage, dict) and isinstance(usage.get("prompt_tokens"), int) and \
                isinstance(usage.get("completion_tokens"), int):
            usage["prompt_tokens"] -= 1
            usage["completion_tokens"] += 1

    def answer(self, data: bytes) -> bytes:
        """An unstreamed completion answer with the first token put back."""
        try:
            answer = json.loads(data)
            choice = answer["choices"][0]
            choice["text"] = self.text + str(choice.get("text") or "")
        except (ValueError, KeyError, IndexError, TypeError):
            return data
        self._usage(answer.get("usage"))
        return json.dumps(answer).encode()

    def lead(self, head: bytes) -> bytes:
        """The event that streams prefill's token first, shaped like decode's first event."""
        first: Any = {}
        for line in head.split(b"\n"):
            if line.startswith(b"data: {"):
                try:
                    first = json.loads(line[len(b"data: "):])
                except ValueError:
                    first = {}
                break
        first = first if isinstance(first, dict) else {}
        event = {"id": first.get("id"), "object": first.get("object", "text_completion"),
                 "created": first.get("created"), "model": first.get("model"),
                 "choices": [{"index": 0, "text": self.text, "logprobs": None, "finish_reason": None,
                              "stop_reason": None}]}
        return b"data: " + json.dumps(event).encode() + b"\n\n"

    def feed(self, chunk: bytes) -> bytes:
        """Decode's stream, whole events at a time, their usage counted as the client's request."""
        self._buffer += chunk
        complete, separator, rest = self._buffer.rpartition(b"\n\n")
        if not separator:
            return b""
        self._buffer = rest
        return b"".join(self._event(event) + b"\n\n" for event in complete.split(b"\n\n"))

    def flush(self) -> bytes:
        """What is left of the stream (an unterminated last event), as it came."""
        rest, self._buffer = self._buffer, b""
        return rest

    def _event(self, event: bytes) -> bytes:
        if not event.startswith(b"data: {") or b'"usage"' not in event:
            return event
        try:
            data = json.loads(event[len(b"data: "):])
        except ValueError:
            return event
        if not isinstance(data, dict) or not isinstance(data.get("usage"), dict):
            return event
        self._usage(data["usage"])
        return b"data: " + json.dumps(data).encode()


# -- P2pNccl -----------------------------------------------------------------------------------


def p2p_nccl_request_id(prefill_zmq: str, decode_zmq: str, unique: str | None = None) -> str:
    """The request id that tells a P2pNccl prefill engine where decode listens and vice versa.

    vLLM parses it with `___decode_addr_(.*):(\\d+)` (prefill side) and
    `___prefill_addr_(.*):(\\d+)___` (decode side), so the unique tail is hex without colons."""
    tail = unique if unique is not None else uuid.uuid4().hex
    return f"___prefill_addr_{prefill_zmq}___decode_addr_{decode_zmq}_{tail}"


def host_port(host: str, port: int) -> str:
    """`host:port`, with an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def aborted(answer: Any) -> bool:
    """Whether a completion or chat answer (unstreamed, or one stream event) is vLLM's abort of a
    request it never ran: every choice finished with `abort`, without output. An engine shutting
    down answers every new request so, 200 included (SIGTERM: `EngineCore._reject_add_in_shutdown`,
    vllm/v1/engine/core.py), while its /health stays 200."""
    choices = answer.get("choices") if isinstance(answer, dict) else None
    return isinstance(choices, list) and bool(choices) and all(
        isinstance(c, dict) and c.get("finish_reason") == "abort" and not _output(c) for c in choices)


def answer_aborted(data: bytes, stream: bool) -> bool:
    """Whether an unstreamed answer, or the first bytes of a stream, are vLLM's abort of a request it
    never ran (`aborted`; in a stream, the first event with output or a finish_reason). False while
    that is not known. Answers without the word are not parsed: this runs on every decode leg."""
    if b'"abort"' not in data:
        return False
    if not stream:
        try:
            return aborted(json.loads(data))
        except ValueError:
            return False
    for event in _events(data):
        choices = event.get("choices") if isinstance(event, dict) else None
        if isinstance(choices, list) and any(isinstance(c, dict) and (_output(c) or c.get("finish_reason"))
                                             for c in choices):
            return aborted(event)
    return False


def stream_error(data: bytes) -> JSON | None:
    """The error of a stream whose first event is vLLM's error event (`data: {"error": {"message",
    "type", "param", "code"}}`): a request that failed before any output answers 200 and then that
    event (vLLM's completion and chat stream generators; a KV load failing under
    `kv_load_failure_policy: fail` is one). None otherwise, and while the first event is cut short.
    Chunks without the word are not parsed: this runs on every streamed decode leg."""
    if b'"error"' not in data:
        return None
    first = next(_events(data), None)
    error = first.get("error") if isinstance(first, dict) else None
    return error if isinstance(error, dict) else None


def _events(data: bytes) -> Iterator[Any]:
    """The JSON events of the first bytes of a stream (`data: {...}` lines), in order, up to the
    first one cut short (the chunk ends inside it)."""
    for line in data.split(b"\n"):
        if not line.startswith(b"data: {"):
            continue
        try:
            yield json.loads(line[len(b"data: "):])
        except ValueError:
            return


def _output(choice: Mapping[str, Any]) -> bool:
    message = choice.get("message") or choice.get("delta") or {}
    return bool(choice.get("text") or (isinstance(message, dict) and message.get("content")))

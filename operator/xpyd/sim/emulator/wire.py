"""vLLM's OpenAI-compatible wire format as the emulator speaks it: request parsing, error envelopes,
response bodies and SSE events."""

from __future__ import annotations

import hashlib
import json
import uuid
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from xpyd.sim.emulator.config import (
    COMPLETION_DEFAULT_MAX_TOKENS,
    EMULATED_VLLM_VERSION,
    TOKEN_TEXT,
    EmulatorConfig,
)
from xpyd.sim.emulator.tokens import ChatFlags, chat_ids, chat_strs, prompt_ids, prompt_strs


def random_uuid() -> str:
    """vLLM's `random_uuid()`: 16 hex digits (the random part of `cmpl-...` ids and `modelperm-...`)."""
    return f"{uuid.uuid4().int & (2**64 - 1):016x}"


def system_fingerprint(config: EmulatorConfig) -> str:
    """vLLM's default (`--fingerprint-mode full`) `system_fingerprint`: `vllm-<version>[-tp<n>]-<hash8>`,
    the hash being of the engine's configuration (here the emulated engine's: what it is and how it
    schedules, not where it listens)."""
    identity = (EMULATED_VLLM_VERSION, config.model, config.max_model_len, config.tensor_parallel_size,
                config.kv_role, config.kv_load_failure_policy, config.max_num_batched_tokens, config.max_num_seqs,
                config.max_kv_tokens)
    hash8 = hashlib.sha256(repr(identity).encode()).hexdigest()[:8]
    tp = f"-tp{config.tensor_parallel_size}" if config.tensor_parallel_size > 1 else ""
    return f"vllm-{EMULATED_VLLM_VERSION}{tp}-{hash8}"


class ApiError(Exception):
    """An error answered in vLLM's envelope; `param` names the request field at fault (vLLM's
    `VLLMValidationError.parameter`), if any."""

    def __init__(self, status: int, message: str, error_type: str = "BadRequestError",
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type
        self.param = param


def validation_error(message: str, param: str, value: object) -> ApiError:
    """vLLM's `VLLMValidationError` as the API answers it: 400, its `param`, and the message with
    `(parameter=..., value=...)` appended."""
    return ApiError(400, f"{message} (parameter={param}, value={value})", param=param)


def error_response(status: int, message: str, error_type: str, param: str | None = None) -> web.Response:
    """vLLM's `ErrorResponse`: `{"error": {"message", "type", "param", "code"}}`."""
    return web.json_response(error_body(message, error_type, status, param), status=status)


def error_body(message: str, error_type: str, status: int, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": status}}


def text_tokens(text: str) -> int:
    """Prompt tokens of a text: about four characters per token, at least one."""
    return max(1, -(-len(text) // 4))


MAX_TOKEN_ID = 2**63 - 1
"""The largest token id the emulator takes (it has no vocabulary; vLLM bounds ids by its model's)."""


def _prompt_ids(prompt: Any) -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]   # a batch of one
    if isinstance(prompt, str):
        return prompt_ids(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        for bound in (min(prompt), max(prompt)):
            if not 0 <= bound <= MAX_TOKEN_ID:   # vLLM's renderer: validate_token_ids
                raise ApiError(400, f"Token id {bound} is out of vocabulary")
        return list(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        raise ApiError(400, "batched prompts are not emulated: send one prompt per request")
    raise ApiError(400, "prompt must be a non-empty string or a non-empty list of token ids")


def _chat_turns(messages: Any) -> list[tuple[str, str]]:
    """A chat's (role, text) messages; raises ApiError for what the emulator does not take."""
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list")
    turns: list[tuple[str, str]] = []
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ApiError(400, "every message needs a string role")
        content = message.get("content")
        if content is None:
            text = ""
        elif isinstance(content, str):
            text = content
        elif isinstance(content, list):
            parts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ApiError(400, "only text content parts are emulated")
                parts.append(part["text"])
            text = "".join(parts)
        else:
            raise ApiError(400, "message content must be a string, a list of parts or null")
        turns.append((message["role"], text))
    return turns


def request_validation_error(message: str, param: str | None = None) -> ApiError:
    """A body vLLM's protocol models refuse (FastAPI's `RequestValidationError`): 400 with type "Bad Request"
    (vLLM's `validation_exception_handler`)."""
    return ApiError(400, f"1 validation error:\n  {message}", "Bad Request", param)


def _bool(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise request_validation_error(f"{name}: Input should be a valid boolean, not {json.dumps(value)}",
                                       f"body.{name}")
    return value


def chat_flags(body: dict[str, Any]) -> ChatFlags:
    """The chat fields that change a chat's tokens, checked as vLLM's chat and tokenize requests check
    them (both `continue_final_message` and `add_generation_prompt` true is refused)."""
    flags = ChatFlags(add_generation_prompt=_bool(body, "add_generation_prompt", True),
                      continue_final_message=_bool(body, "continue_final_message", False),
                      add_special_tokens=_bool(body, "add_special_tokens", False))
    if flags.continue_final_message and flags.add_generation_prompt:
        raise request_validation_error("Value error, Cannot set both `continue_final_message` and "
                                       "`add_generation_prompt` to True.", "body")
    return flags


CACHE_SALT_MAX_LENGTH = 128
CACHE_SALT_FORBIDDEN = frozenset("@/\\\x00")
"""vLLM 0.33's `validate_cache_salt` bounds."""


def _cache_salt(body: dict[str, Any]) -> str | None:
    """`cache_salt`, checked as vLLM's `validate_cache_salt` checks it."""
    salt = body.get("cache_salt")
    if salt is None:
        return None
    if not isinstance(salt, str) or not salt:
        raise validation_error("Parameter 'cache_salt' must be a non-empty string if provided.", "cache_salt", salt)
    if len(salt) > CACHE_SALT_MAX_LENGTH or any(char in CACHE_SALT_FORBIDDEN for char in salt):
        raise validation_error("Parameter 'cache_salt' must be at most 128 characters and must not contain '@', "
                               "'/', '\\\\', or NUL.", "cache_salt", salt)
    return salt


def _optional_int(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"{name} must be an integer, not {json.dumps(value)}")
    if value < 1:
        raise ApiError(400, f"{name} must be at least 1, got {value}.")
    return value


@dataclass(frozen=True)
class Generation:
    """A validated `/v1/completions` or `/v1/chat/completions` body."""

    chat: bool
    token_ids: list[int]
    max_tokens: int
    stream: bool
    include_usage: bool
    continuous_usage: bool
    kv_transfer_params: dict[str, Any] | None
    cache_salt: str | None = None
    session_id: str | None = None

    @property
    def prompt_tokens(self) -> int:
        """The prompt's length in tokens."""
        return len(self.token_ids)


def parse_generation(body: Any, chat: bool, config: EmulatorConfig, session_header: str | None = None) -> Generation:
    """Validate a request body in vLLM's order; raises ApiError. First the body's shape (vLLM's protocol
    models); then the model (404, naming the served names); then `max_tokens` against `--max-model-len`
    (`TokenizeParams`); then the prompt's length (the renderer: longer than the context; the engine's
    input processor: no room for one output token). A `max_tokens` that fits the context but not beside
    the prompt is lowered to what is left, as vLLM's `get_max_tokens` does. The session (BlockStored's
    `session_id`) is the body's `session_id`, else the `X-Session-ID` header (`session_header`)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    cache_salt = _cache_salt(body)
    token_ids = chat_ids(_chat_turns(body.get("messages")), chat_flags(body)) if chat \
        else _prompt_ids(body.get("prompt"))
    prompt_tokens = len(token_ids)
    session_id = body.get("session_id")
    if session_id is not None and not isinstance(session_id, str):
        raise ApiError(400, "session_id must be a string")
    session_id = session_id or session_header or None
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise ApiError(400, "stream must be a boolean")
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise ApiError(400, "stream_options must be an object")
        if not stream:
            raise ApiError(400, "Stream options can only be defined when `stream=True`.")
    n = body.get("n")
    if n is not None and n != 1:
        raise ApiError(400, "n other than 1 is not emulated")
    kv_transfer_params = body.get("kv_transfer_params")
    if kv_transfer_params is not None and not isinstance(kv_transfer_params, dict):
        raise ApiError(400, "kv_transfer_params must be an object")
    # Chat takes max_completion_tokens over max_tokens; completions have no max_completion_tokens (vLLM
    # ignores it) and default max_tokens to 16.
    max_completion_tokens = _optional_int(body, "max_completion_tokens") if chat else None
    requested = _optional_int(body, "max_tokens")
    check_model(body.get("model"), config)
    param = "max_tokens"
    if max_completion_tokens is not None:
        param, requested = "max_completion_tokens", max_completion_tokens
    elif not chat and "max_tokens" not in body:
        requested = COMPLETION_DEFAULT_MAX_TOKENS
    max_len = config.max_model_len
    if requested is not None and requested > max_len:
        raise validation_error(f"{param}={requested} cannot be greater than max_model_len={max_len}. Please request "
                               "fewer output tokens.", param, requested)
    if prompt_tokens > max_len:
        raise validation_error(f"This model's maximum context length is {max_len} tokens. However, your prompt "
                               f"contains {prompt_tokens} input tokens, which exceeds this limit even without any "
                               "output tokens. Please reduce the length of the input prompt.", "input_tokens",
                               prompt_tokens)
    if prompt_tokens == max_len:
        raise ApiError(400, f"The decoder prompt (length {prompt_tokens}) plus the number of requested output tokens "
                       f"(at least 1) is longer than the maximum model length of {max_len}. Make sure that "
                       "`max_model_len` is no smaller than the number of text tokens (prompt + requested output "
                       "tokens).")
    max_tokens = max_len - prompt_tokens if requested is None else min(requested, max_len - prompt_tokens)
    include_usage = bool(options is not None and options.get("include_usage", True))
    continuous = bool(options is not None and options.get("continuous_usage_stats", False))
    return Generation(chat, token_ids, max_tokens, bool(stream), include_usage, continuous, kv_transfer_params,
                      cache_salt, session_id)


def check_model(model: Any, config: EmulatorConfig) -> None:
    """An unknown model (404, naming the served names, as vLLM's `_check_model`); none is the served one."""
    names = config.served_model_names or (config.model,)
    if model is not None and (not isinstance(model, str) or model not in names):
        raise ApiError(404, f"The model `{model}` does not exist. Valid aliases: {', '.join(names)}.",
                       "NotFoundError", param="model")


@dataclass(frozen=True)
class Tokenized:
    """A `/tokenize` answer: the prompt's token ids, and their texts when asked for."""

    token_ids: list[int]
    token_strs: list[str] | None


#: `TokenizeChatRequest`'s optional fields that must be objects, lists or strings when set (they change
#: nothing here: the emulated chat template has no tools, and the prompt is text).
_TOKENIZE_CHAT_FIELDS: dict[str, type] = {"chat_template": str, "chat_template_kwargs": dict, "tools": list,
                                          "media_io_kwargs": dict, "mm_processor_kwargs": dict}


def parse_tokenize(body: Any, config: EmulatorConfig) -> Tokenized:
    """A `POST /tokenize` body (vLLM's `TokenizeCompletionRequest` or `TokenizeChatRequest`), tokenized as
    `/v1/completions` and `/v1/chat/completions` tokenize the same prompt; raises ApiError. First the
    body's shape, as vLLM's protocol models check it (400 "Bad Request"), then the model (404). A prompt
    longer than the context is tokenized all the same, as vLLM does."""
    if not isinstance(body, dict):
        raise request_validation_error("Input should be a valid dictionary or object", "body")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise request_validation_error(f"model: Input should be a valid string, not {json.dumps(model)}",
                                       "body.model")
    strs = body.get("return_token_strs")
    if strs is not None and not isinstance(strs, bool):
        raise request_validation_error(f"return_token_strs: Input should be a valid boolean, not {json.dumps(strs)}",
                                       "body.return_token_strs")
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        _bool(body, "add_special_tokens", True)   # the emulated tokenizer adds no special token to text
        check_model(model, config)
        return Tokenized(prompt_ids(prompt), prompt_strs(prompt) if strs else None)
    if "messages" not in body:
        if "prompt" in body:
            raise request_validation_error(f"prompt: Input should be a valid string, not {json.dumps(prompt)}",
                                           "body.prompt")
        raise request_validation_error("Field required: a prompt (text) or messages", "body")
    messages = body["messages"]
    if not isinstance(messages, list):
        raise request_validation_error("messages: Input should be a valid list", "body.messages")
    for name, kind in _TOKENIZE_CHAT_FIELDS.items():
        value = body.get(name)
        if value is not None and not isinstance(value, kind):
            raise request_validation_error(f"{name}: Input should be a valid {kind.__name__}", f"body.{name}")
    flags = chat_flags(body)
    check_model(model, config)
    turns = _chat_turns(messages) if messages else []
    return Tokenized(chat_ids(turns, flags), chat_strs(turns, flags) if strs else None)


def tokenize_response(tokenized: Tokenized, max_model_len: int) -> dict[str, Any]:
    """vLLM's `TokenizeResponse`, every field (`token_strs` null unless asked for)."""
    return {"count": len(tokenized.token_ids), "max_model_len": max_model_len, "tokens": tokenized.token_ids,
            "token_strs": tokenized.token_strs}


def prompt_tokens_details(chat: bool, cached_tokens: int, created_cache_tokens: int) -> dict[str, Any]:
    """vLLM's `PromptTokenUsageInfo` as `--enable-prompt-tokens-details` adds it to an answer's usage: the
    prompt tokens found cached (locally or, on a decode leg, what the prefill engine found: its
    `remote_prefill_cached_tokens`), and for chat the tokens its prefill wrote to the prefix cache."""
    return {"cached_tokens": cached_tokens, "created_cache_tokens": created_cache_tokens if chat else None,
            "multimodal_tokens": None}


def usage_body(prompt_tokens: int, completion_tokens: int, details: dict[str, Any] | None = None) -> dict[str, Any]:
    """vLLM's `UsageInfo` in a response body (every field)."""
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens, "prompt_tokens_details": details,
            "completion_tokens_details": None}


def _stream_usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """`UsageInfo` in an SSE event: only the fields vLLM sets (its events drop unset fields)."""
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens}


def full_response(generation: Generation, response_id: str, model: str, created: int, tokens: int,
                  finish_reason: str, params: dict[str, Any] | None, fingerprint: str,
                  details: dict[str, Any] | None = None) -> dict[str, Any]:
    """A non-streamed answer: vLLM's `CompletionResponse` or `ChatCompletionResponse`, every field
    (vLLM writes the whole model), with `tokens` tokens of text; `details`: `prompt_tokens_details`."""
    text = TOKEN_TEXT * tokens
    usage = usage_body(generation.prompt_tokens, tokens, details)
    if generation.chat:
        # ChatMessage drops `tool_calls` when it is empty.
        message = {"role": "assistant", "content": text, "refusal": None, "annotations": None, "audio": None,
                   "function_call": None, "reasoning": None}
        return {"id": response_id, "object": "chat.completion", "created": created, "model": model,
                "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason,
                             "stop_reason": None, "token_ids": None, "routed_experts": None,
                             "weight_versions": None}],
                "service_tier": None, "system_fingerprint": fingerprint, "usage": usage, "prompt_logprobs": None,
                "prompt_token_ids": None, "prompt_text": None, "kv_transfer_params": params,
                "ec_transfer_params": None, "metrics": None}
    return {"id": response_id, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason,
                         "stop_reason": None, "token_ids": None, "prompt_logprobs": None, "prompt_token_ids": None,
                         "routed_experts": None, "weight_versions": None}],
            "service_tier": None, "system_fingerprint": fingerprint, "usage": usage, "kv_transfer_params": params,
            "ec_transfer_params": None, "metrics": None}


def sse_event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


class Chunks:
    """The SSE events of one streamed response (pre-rendered: most events are the same token), shaped
    as vLLM 0.33 writes them: the fields its serving code sets, `null` included (an event drops only
    fields left unset), `kv_transfer_params` on every token event (the hand-off's on the final one),
    `system_fingerprint` on the final event -- or, with `include_usage`, on the usage event after it,
    which drops null fields."""

    def __init__(self, response_id: str, model: str, created: int, generation: Generation,
                 fingerprint: str) -> None:
        self.generation = generation
        self.fingerprint = fingerprint
        #: What the final event hands off (a prefill leg's `kv_transfer_params`); set before it is written.
        self.kv_transfer_params: dict[str, Any] | None = None
        self.head = {"id": response_id, "object": "chat.completion.chunk" if generation.chat else "text_completion",
                     "created": created, "model": model}
        self.token = sse_event(self.event(None))

    def _usage(self, completion_tokens: int) -> dict[str, Any]:
        usage = _stream_usage(self.generation.prompt_tokens, completion_tokens)
        if self.generation.chat:
            usage["completion_tokens_details"] = None   # set (to None without a reasoning parser) for chat
        return usage

    def role(self) -> str:
        """A chat stream's first event: the assistant's role, before any token."""
        payload: dict[str, Any] = {
            **self.head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                      "finish_reason": None}]}
        if self.generation.continuous_usage:
            payload["usage"] = self._usage(0)
        payload.update(prompt_token_ids=None, prompt_text=None)
        return sse_event(payload)

    def event(self, finish_reason: str | None, usage: dict[str, Any] | None = None,
              text: str = TOKEN_TEXT) -> dict[str, Any]:
        """A token event (the final one when `finish_reason` is set)."""
        final = finish_reason is not None
        choice: dict[str, Any]
        if self.generation.chat:
            choice = {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": finish_reason}
            if final:
                choice["stop_reason"] = None
            choice["token_ids"] = None
            if final:
                choice["weight_versions"] = None
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason,
                      "stop_reason": None, "prompt_token_ids": None, "token_ids": None, "weight_versions": None}
        payload: dict[str, Any] = {**self.head, "choices": [choice]}
        if usage is not None:
            payload["usage"] = usage
        if final and not self.generation.include_usage:
            payload["system_fingerprint"] = self.fingerprint
        payload["kv_transfer_params"] = self.kv_transfer_params if final else None
        return payload

    def tokens(self, first: int, count: int, total: int) -> str:
        """Events for tokens first+1 .. first+count of `total`."""
        generation = self.generation
        if generation.continuous_usage:
            return "".join(sse_event(self.event("length" if i == total else None, self._usage(i)))
                           for i in range(first + 1, first + count + 1))
        if first + count < total:
            return self.token * count
        return self.token * (count - 1) + sse_event(self.event("length"))

    def aborted(self) -> str:
        """The event of a request the engine aborted before its first token: no text, `abort`."""
        usage = self._usage(0) if self.generation.continuous_usage else None
        return sse_event(self.event("abort", usage, text=""))

    def usage(self, completion_tokens: int, details: dict[str, Any] | None = None) -> str:
        """The usage event after the last token (`include_usage`): null fields dropped."""
        usage = _stream_usage(self.generation.prompt_tokens, completion_tokens)
        if details is not None:
            usage["prompt_tokens_details"] = {key: value for key, value in details.items() if value is not None}
        return sse_event({**self.head, "choices": [], "usage": usage, "system_fingerprint": self.fingerprint})

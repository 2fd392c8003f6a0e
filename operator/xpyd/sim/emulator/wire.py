"""vLLM's OpenAI-compatible wire format as the emulator speaks it: request parsing, error envelopes,
response bodies and SSE events."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from xpyd.sim.emulator.config import (
    CHAT_ASSISTANT_HEADER_TOKENS,
    CHAT_MESSAGE_FRAMING_TOKENS,
    COMPLETION_DEFAULT_MAX_TOKENS,
    TOKEN_TEXT,
    EmulatorConfig,
)


class ApiError(Exception):
    """An error answered in vLLM's envelope."""

    def __init__(self, status: int, message: str, error_type: str = "BadRequestError") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type


def error_response(status: int, message: str, error_type: str) -> web.Response:
    """vLLM's `ErrorResponse`: `{"error": {"message", "type", "param", "code"}}`."""
    return web.json_response(error_body(message, error_type, status), status=status)


def error_body(message: str, error_type: str, status: int) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": None, "code": status}}


def text_tokens(text: str) -> int:
    """Prompt tokens of a text: about four characters per token, at least one."""
    return max(1, -(-len(text) // 4))


def _prompt_tokens(prompt: Any) -> int:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]   # a batch of one
    if isinstance(prompt, str):
        return text_tokens(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return len(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        raise ApiError(400, "batched prompts are not emulated: send one prompt per request")
    raise ApiError(400, "prompt must be a non-empty string or a non-empty list of token ids")


def _chat_prompt_tokens(messages: Any) -> int:
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list")
    total = 1 + CHAT_ASSISTANT_HEADER_TOKENS
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
        total += CHAT_MESSAGE_FRAMING_TOKENS + -(-len(text) // 4)
    return total


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
    prompt_tokens: int
    max_tokens: int
    stream: bool
    include_usage: bool
    continuous_usage: bool
    kv_transfer_params: dict[str, Any] | None


def parse_generation(body: Any, chat: bool, config: EmulatorConfig) -> Generation:
    """Validate a request body like vLLM's protocol models and `_validate_input` do; raises ApiError."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = body.get("model")
    if model is not None and (not isinstance(model, str) or model not in (config.served_model_names or
                                                                          (config.model,))):
        raise ApiError(404, f"The model `{model}` does not exist.", "NotFoundError")
    prompt_tokens = _chat_prompt_tokens(body.get("messages")) if chat else _prompt_tokens(body.get("prompt"))
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
    max_len = config.max_model_len
    if prompt_tokens >= max_len:
        raise ApiError(400, f"This model's maximum context length is {max_len} tokens. However, your request has "
                       f"{prompt_tokens} input tokens. Please reduce the length of the input messages.")
    max_tokens = _optional_int(body, "max_completion_tokens") or _optional_int(body, "max_tokens")
    if max_tokens is None:
        max_tokens = max_len - prompt_tokens if chat else COMPLETION_DEFAULT_MAX_TOKENS
    if prompt_tokens + max_tokens > max_len:
        raise ApiError(400, f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's "
                       f"maximum context length is {max_len} tokens and your request has {prompt_tokens} input "
                       f"tokens ({max_tokens} > {max_len} - {prompt_tokens}).")
    include_usage = bool(options is not None and options.get("include_usage", True))
    continuous = bool(options is not None and options.get("continuous_usage_stats", False))
    return Generation(chat, prompt_tokens, max_tokens, bool(stream), include_usage, continuous, kv_transfer_params)




def usage_body(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens, "prompt_tokens_details": None}


def sse_event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


class Chunks:
    """The SSE events of one streamed response (pre-rendered: most events are the same token)."""

    def __init__(self, response_id: str, model: str, created: int, generation: Generation) -> None:
        self.generation = generation
        self.head = {"id": response_id, "object": "chat.completion.chunk" if generation.chat else "text_completion",
                     "created": created, "model": model}
        self.token = sse_event(self.event(None))

    def event(self, finish_reason: str | None, usage: dict[str, Any] | None = None,
              role: bool = False, text: str = TOKEN_TEXT) -> dict[str, Any]:
        if self.generation.chat:
            delta = {"role": "assistant", "content": ""} if role else {"content": text}
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason,
                      "stop_reason": None}
        payload: dict[str, Any] = {**self.head, "choices": [choice]}
        if usage is not None:
            payload["usage"] = usage
        return payload

    def tokens(self, first: int, count: int, total: int) -> str:
        """Events for tokens first+1 .. first+count of `total`."""
        generation = self.generation
        if generation.continuous_usage:
            return "".join(sse_event(self.event("length" if i == total else None,
                                                usage_body(generation.prompt_tokens, i)))
                           for i in range(first + 1, first + count + 1))
        if first + count < total:
            return self.token * count
        return self.token * (count - 1) + sse_event(self.event("length"))

    def aborted(self) -> str:
        """The event of a request the engine aborted before its first token: no text, `abort`."""
        generation = self.generation
        usage = usage_body(generation.prompt_tokens, 0) if generation.continuous_usage else None
        return sse_event(self.event("abort", usage, text=""))

    def usage(self, completion_tokens: int) -> str:
        usage = usage_body(self.generation.prompt_tokens, completion_tokens)
        return sse_event({**self.head, "choices": [], "usage": usage})



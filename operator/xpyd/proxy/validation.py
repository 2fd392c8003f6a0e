"""Client requests: checked before any upstream call, and the error bodies the proxy answers with.
Pure: no I/O.

The checks are the ones vLLM's OpenAI server would fail a request on anyway (malformed JSON,
wrong types, a missing model or prompt), so a bad request costs no engine any work and never
counts against an instance's health. Fields the proxy does not understand pass through untouched.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Final, Literal

from xpyd.common.jsontypes import JSON

#: Which of the OpenAI APIs a client request calls (the `endpoint` label of the request metrics).
ClientApi = Literal["completions", "chat"]

#: OpenAI-style error `type` per HTTP status (the shape vLLM's ErrorResponse uses).
ERROR_TYPES: Final = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    413: "RequestTooLargeError",
    429: "RateLimitError",
    500: "InternalServerError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}

#: Characters per token when a prompt is text: BPE vocabularies of current models average close to
#: four characters of English per token. Only the relative load of prefill instances depends on it.
#: The three constants are the ones `xpyd engine-sim` counts prompts with.
CHARS_PER_TOKEN: Final = 4
#: Tokens a chat template adds per message (role markers and separators).
CHAT_MESSAGE_FRAMING_TOKENS: Final = 5
#: Tokens a chat template adds once (begin-of-text and the assistant header).
CHAT_BASE_TOKENS: Final = 5

_INT_FIELDS: Final = ("max_tokens", "max_completion_tokens", "min_tokens", "n", "seed", "logprobs",
                      "top_logprobs", "top_k")
_NUMBER_FIELDS: Final = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                         "repetition_penalty")
_POSITIVE_FIELDS: Final = ("max_tokens", "max_completion_tokens", "n")
_OBJECT_FIELDS: Final = ("stream_options", "kv_transfer_params", "logit_bias", "response_format")


class RequestError(Exception):
    """A request the proxy refuses; `body()` is the JSON error the client gets."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    def body(self) -> JSON:
        """The OpenAI/vLLM error object."""
        return error_body(self.status, self.message, self.param)


def error_body(status: int, message: str, param: str | None = None) -> JSON:
    """`{"error": {"message", "type", "param", "code"}}`, as vLLM answers errors."""
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "Error"), "param": param, "code": status}}


@dataclass(frozen=True)
class ClientRequest:
    """A checked completion or chat request."""

    body: JSON
    api: ClientApi
    model: str
    stream: bool
    prompt_tokens: int


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (isinstance(value, int | float) and not isinstance(value, bool)
            and math.isfinite(value))


def parse(raw: bytes, api: ClientApi, served_model: str | None = None) -> ClientRequest:
    """Parse and check a request body; RequestError (400, or 404 for another model) otherwise."""
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as error:  # UnicodeDecodeError is a ValueError
        raise RequestError(400, f"The request body is not valid JSON: {error}") from None
    if not isinstance(body, dict):
        raise RequestError(400, "The request body must be a JSON object.")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise RequestError(400, "`model` is required and must be a non-empty string.", "model")
    if served_model is not None and model != served_model:
        raise RequestError(404, f"The model `{model}` does not exist.", "model")
    _check_types(body)
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise RequestError(400, "`stream` must be a boolean.", "stream")
    if body.get("stream_options") is not None and not stream:
        raise RequestError(400, "Stream options can only be defined when `stream=True`.", "stream_options")
    tokens = _prompt_tokens(body.get("prompt")) if api == "completions" else _chat_tokens(body.get("messages"))
    return ClientRequest(body=body, api=api, model=model, stream=bool(stream), prompt_tokens=tokens)


def _check_types(body: JSON) -> None:
    for name in _INT_FIELDS:
        value = body.get(name)
        if value is not None and not _is_int(value):
            raise RequestError(400, f"`{name}` must be an integer.", name)
    for name in _POSITIVE_FIELDS:
        value = body.get(name)
        if value is not None and value < 1:
            raise RequestError(400, f"`{name}` must be at least 1.", name)
    for name in _NUMBER_FIELDS:
        value = body.get(name)
        if value is not None and not _is_number(value):
            raise RequestError(400, f"`{name}` must be a number.", name)
    for name in _OBJECT_FIELDS:
        value = body.get(name)
        if value is not None and not isinstance(value, dict):
            raise RequestError(400, f"`{name}` must be an object.", name)


def _prompt_tokens(prompt: Any) -> int:
    """Estimated prompt tokens of a completions `prompt`: exact for token ids, else by characters.
    Accepts what vLLM accepts: a string, a list of strings, a list of token ids, or a list of them."""
    if isinstance(prompt, str):
        return text_tokens(prompt)
    if isinstance(prompt, list) and prompt:
        if all(isinstance(item, str) for item in prompt):
            return sum(text_tokens(item) for item in prompt)
        if all(_is_int(item) for item in prompt):
            return len(prompt)
        if all(isinstance(item, list) and item and all(_is_int(t) for t in item) for item in prompt):
            return sum(len(item) for item in prompt)
    raise RequestError(400, "`prompt` is required: a string, a list of strings, a list of token ids or a list "
                       "of token-id lists.", "prompt")


def _chat_tokens(messages: Any) -> int:
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, "`messages` is required and must be a non-empty list.", "messages")
    tokens = CHAT_BASE_TOKENS
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise RequestError(400, f"`messages[{index}]` must be an object with a string `role`.", "messages")
        tokens += CHAT_MESSAGE_FRAMING_TOKENS + -(-_content_chars(message.get("content"), index) // CHARS_PER_TOKEN)
    return tokens


def _content_chars(content: Any, index: int) -> int:
    if content is None:
        return 0
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        total = 0
        for part in content:
            if not isinstance(part, dict):
                raise RequestError(400, f"`messages[{index}].content` parts must be objects.", "messages")
            text = part.get("text")
            total += len(text) if isinstance(text, str) else 0
        return total
    raise RequestError(400, f"`messages[{index}].content` must be a string, a list of parts or null.", "messages")


def text_tokens(text: str) -> int:
    """Estimated tokens of a text: about four characters per token, at least one."""
    return max(1, -(-len(text) // CHARS_PER_TOKEN))

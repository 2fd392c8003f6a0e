"""One streamed completion, timed: the HTTP half of `xpyd bench`.

A request is timed from just before it is sent: the first server-sent event carrying text is its
first token (TTFT), every later one adds an inter-token latency, and `data: [DONE]` ends it (e2e).
The output token count is the usage's `completion_tokens` when the server sends usage (vLLM does
with `stream_options.include_usage`), else the number of text events. Every failure -- refused
connection, timeout, HTTP error, an error event in the stream, a stream cut short -- becomes a failed
record with a short `error_kind`; nothing here raises for the server's or the network's sake.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from typing import Any

import aiohttp

from xpyd.bench.load import Arrival
from xpyd.bench.report import RequestRecord

MAX_ERROR_BYTES = 4096
"""How much of an error response is read for its message."""
MAX_ERROR_CHARS = 300


def _error_message(data: bytes) -> str:
    """The message of an OpenAI/vLLM error body (`{"error": {"message": ...}}`), else the text itself."""
    text = data.decode("utf-8", "replace").strip()
    try:
        body = json.loads(text)
    except ValueError:
        return text[:MAX_ERROR_CHARS]
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return str(error["message"])[:MAX_ERROR_CHARS]
    if isinstance(error, str):
        return error[:MAX_ERROR_CHARS]
    return text[:MAX_ERROR_CHARS]


def _event_text(event: Mapping[str, Any]) -> str:
    """The generated text of a completion (or chat) chunk; empty for usage-only chunks."""
    choices = event.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return ""
    choice = choices[0]
    text = choice.get("text")
    if text is None and isinstance(choice.get("delta"), dict):
        text = choice["delta"].get("content")
    return text if isinstance(text, str) else ""


async def send_completion(session: aiohttp.ClientSession, url: str, body: Mapping[str, Any], arrival: Arrival,
                          origin: float, clock: Callable[[], float] = time.perf_counter) -> RequestRecord:
    """POST one streamed completion and time it; `origin` is the run's start on `clock`.

    The session carries the headers (API key) and the timeout that bounds the whole request (it ends
    as a `timeout` record).
    """
    sent = clock()
    first: float | None = None
    last = sent
    gaps: list[float] = []
    text_events = 0
    usage_tokens: int | None = None
    prompt_tokens: int | None = None
    status: int | None = None

    def failed(kind: str, message: str) -> RequestRecord:
        return RequestRecord(arrival.index, arrival.at_s, sent - origin, arrival.isl, arrival.osl, ok=False,
                             ttft_s=None if first is None else first - sent, output_tokens=text_events,
                             status=status, error_kind=kind, error=message)

    try:
        async with session.post(url, json=body) as response:
            status = response.status
            if status != 200:
                return failed(f"http_{status}", _error_message(await response.content.read(MAX_ERROR_BYTES)))
            done = False
            pending = b""
            # Whole chunks, split here: events that arrived together share their arrival time, and
            # one await per chunk instead of per line keeps the client's loop free for the schedule.
            async for chunk in response.content.iter_any():
                now = clock()
                *lines, pending = (pending + chunk).split(b"\n")
                for line in lines:
                    if not line.startswith(b"data:"):
                        continue   # blank separators, comments, `event:` lines
                    data = line[len(b"data:"):].strip()
                    if data == b"[DONE]":
                        done = True
                        break
                    event = json.loads(data.decode())   # str: skips json's encoding sniffing
                    if not isinstance(event, dict):
                        return failed("protocol", f"an event is not a JSON object: {data[:100]!r}")
                    if "error" in event:
                        return failed("stream_error", _error_message(data))
                    usage = event.get("usage")
                    if isinstance(usage, dict):
                        usage_tokens = usage.get("completion_tokens", usage_tokens)
                        prompt_tokens = usage.get("prompt_tokens", prompt_tokens)
                    if _event_text(event):
                        if first is None:
                            first = now
                        else:
                            gaps.append(now - last)
                        last = now
                        text_events += 1
                if done:
                    break
            end = clock()
    except TimeoutError:
        return failed("timeout", f"no complete answer within the timeout ({clock() - sent:.1f} s)")
    except aiohttp.ClientConnectorError as error:
        return failed("connect", str(error))
    except (aiohttp.ClientError, OSError) as error:
        return failed("connection", f"{type(error).__name__}: {error}")
    except ValueError as error:   # a non-JSON event
        return failed("protocol", f"unreadable event: {error}")
    if not done:
        return failed("incomplete", "the stream ended without data: [DONE]")
    if first is None:
        return failed("incomplete", "the stream carried no tokens")
    tokens = usage_tokens if isinstance(usage_tokens, int) and usage_tokens > 0 else text_events
    return RequestRecord(arrival.index, arrival.at_s, sent - origin, arrival.isl, arrival.osl, ok=True,
                         ttft_s=first - sent, e2e_s=end - sent, output_tokens=tokens,
                         prompt_tokens=prompt_tokens if isinstance(prompt_tokens, int) else None,
                         itl_s=tuple(gaps), status=status)

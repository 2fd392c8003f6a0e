"""Waiting in tests: `eventually` polls a check until it returns something truthy, and returns that;
after `timeout` seconds it fails, naming `what` and the check's last answer. One loop (`_polls`), two
drivers: `eventually` is awaited by the in-process tests (the check runs on their event loop, which
goes on between polls); `eventually_blocking` sleeps between polls, for the e2e tests that drive a
cluster from a plain thread (`e2e.cluster` exports it as their `eventually`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Generator
from typing import Any


def _polls(check: Callable[[], Any], timeout: float, interval: float, what: str) -> Generator[float, None, Any]:
    """Yields the seconds to sleep before the next poll; returns the check's truthy answer."""
    deadline = time.monotonic() + timeout
    while True:
        last = check()
        if last:
            return last
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what or check} (last: {last!r})")
        yield interval


async def eventually(check: Callable[[], Any], timeout: float = 20.0, interval: float = 0.02, what: str = "") -> Any:
    """Await until `check()` is truthy (polled every `interval` s on the running loop); its answer."""
    polls = _polls(check, timeout, interval, what)
    try:
        while True:
            await asyncio.sleep(next(polls))
    except StopIteration as done:
        return done.value


def eventually_blocking(check: Callable[[], Any], timeout: float = 60.0, interval: float = 0.5,
                        what: str = "") -> Any:
    """Block until `check()` is truthy (polled every `interval` s); its answer."""
    polls = _polls(check, timeout, interval, what)
    try:
        while True:
            time.sleep(next(polls))
    except StopIteration as done:
        return done.value

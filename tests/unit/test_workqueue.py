"""The operator's work queue: each key once, never two workers on one key, urgent before normal,
per-key backoff, shutdown."""

from __future__ import annotations

import threading

import pytest

from xpyd.controller.workqueue import WorkQueue

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def drain(queue: WorkQueue[str]) -> list[str]:
    taken = []
    while (key := queue.get(timeout=0)) is not None:
        taken.append(key)
        queue.done(key)
    return taken


def test_a_key_added_while_waiting_is_queued_once() -> None:
    queue: WorkQueue[str] = WorkQueue()
    for key in ("a", "b", "a", "a", "c", "b"):
        queue.add(key)
    assert len(queue) == 3
    assert drain(queue) == ["a", "b", "c"]


def test_a_key_added_while_processing_comes_back_after_done_not_before() -> None:
    queue: WorkQueue[str] = WorkQueue()
    queue.add("a")
    assert queue.get(timeout=0) == "a"
    queue.add("a")
    queue.add("a")
    assert queue.get(timeout=0) is None  # not handed to a second worker meanwhile
    queue.done("a")
    assert drain(queue) == ["a"]  # once


def test_urgent_keys_are_taken_first_and_a_waiting_key_moves_up() -> None:
    queue: WorkQueue[str] = WorkQueue()
    for key in ("status-1", "status-2", "status-3"):
        queue.add(key)
    queue.add("new-pool", urgent=True)
    queue.add("status-3", urgent=True)  # was waiting as normal
    assert drain(queue) == ["new-pool", "status-3", "status-1", "status-2"]
    assert len(queue) == 0


def test_urgency_survives_a_re_add_while_processing() -> None:
    queue: WorkQueue[str] = WorkQueue()
    queue.add("a")
    queue.add("b")
    assert queue.get(timeout=0) == "a"
    queue.add("a", urgent=True)
    queue.done("a")
    assert drain(queue) == ["a", "b"]


def test_retry_backs_off_exponentially_per_key_and_forget_resets() -> None:
    clock = Clock()
    queue: WorkQueue[str] = WorkQueue(base=1.0, cap=5.0, clock=clock)
    delays = []
    for _ in range(5):
        delays.append(queue.retry("a"))
    assert delays == [1.0, 2.0, 4.0, 5.0, 5.0]
    assert queue.retry("b") == 1.0  # its own count
    queue.forget("a")
    assert queue.retry("a") == 1.0


def test_a_delayed_key_becomes_ready_when_its_time_comes() -> None:
    clock = Clock()
    queue: WorkQueue[str] = WorkQueue(clock=clock)
    queue.add_after("later", 2.0)
    queue.add("now")
    assert drain(queue) == ["now"]
    clock.now += 1.9
    assert queue.get(timeout=0) is None
    clock.now += 0.2
    assert drain(queue) == ["later"]


def test_a_retried_key_is_urgent_and_a_deferred_one_is_not() -> None:
    clock = Clock()
    queue: WorkQueue[str] = WorkQueue(base=1.0, clock=clock)
    queue.add("waiting")
    queue.retry("failed")
    queue.add_after("deferred", 1.0)
    clock.now += 1.0
    assert drain(queue) == ["failed", "waiting", "deferred"]


def test_shutdown_wakes_a_blocked_worker() -> None:
    queue: WorkQueue[str] = WorkQueue()
    got: list[str | None] = []
    worker = threading.Thread(target=lambda: got.append(queue.get()))
    worker.start()
    queue.shutdown()
    worker.join(5)
    assert not worker.is_alive() and got == [None]
    queue.add("after")
    assert queue.get(timeout=0) is None


def test_workers_never_hold_one_key_at_once() -> None:
    queue: WorkQueue[int] = WorkQueue()
    holding: set[int] = set()
    clashes: list[int] = []
    guard = threading.Lock()
    done = {key: 0 for key in range(10)}

    def work() -> None:
        while (key := queue.get(timeout=0.2)) is not None:
            with guard:
                if key in holding:
                    clashes.append(key)
                holding.add(key)
            with guard:
                holding.discard(key)
                done[key] += 1
            queue.done(key)

    for round_ in range(200):
        queue.add(round_ % 10, urgent=round_ % 3 == 0)
    workers = [threading.Thread(target=work) for _ in range(4)]
    for worker in workers:
        worker.start()
    for round_ in range(200):
        queue.add(round_ % 10)
    for worker in workers:
        worker.join(10)
    assert clashes == []
    assert all(count >= 1 for count in done.values())

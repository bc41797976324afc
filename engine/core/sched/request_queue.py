"""Waiting queues: the admission policy as a collaborator of the scheduler.

`FCFSRequestQueue`: arrival order; a preempted request goes back to the head.
`PriorityRequestQueue`: lower `priority` first, ties by arrival time, then by the
order of `add`; a preempted request keeps its (priority, arrival) place, which puts
it ahead of everything that arrived after it.
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterable, Iterator

from engine.request import Request


class RequestQueue(ABC):
    @abstractmethod
    def add(self, request: Request) -> None:
        """Enqueue a newly arrived request."""

    @abstractmethod
    def prepend(self, request: Request) -> None:
        """Put back a preempted request (ahead of later arrivals)."""

    @abstractmethod
    def peek(self) -> Request:
        """The next request to admit; IndexError when empty."""

    @abstractmethod
    def pop(self) -> Request:
        """Remove and return `peek()`."""

    @abstractmethod
    def remove_requests(self, requests: Iterable[Request]) -> None:
        """Drop these requests (those not queued are ignored)."""

    @abstractmethod
    def __iter__(self) -> Iterator[Request]:
        """Requests in admission order."""

    @abstractmethod
    def __len__(self) -> int: ...

    def __bool__(self) -> bool:
        return len(self) > 0


class FCFSRequestQueue(RequestQueue):
    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def prepend(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove_requests(self, requests: Iterable[Request]) -> None:
        drop = {id(r) for r in requests}
        self._queue = deque(r for r in self._queue if id(r) not in drop)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)

    def __len__(self) -> int:
        return len(self._queue)


class PriorityRequestQueue(RequestQueue):
    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._seq = itertools.count()

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, (request.priority, request.arrival_time, next(self._seq), request))

    def prepend(self, request: Request) -> None:
        self.add(request)

    def peek(self) -> Request:
        if not self._heap:
            raise IndexError("peek from an empty queue")
        return self._heap[0][3]

    def pop(self) -> Request:
        if not self._heap:
            raise IndexError("pop from an empty queue")
        return heapq.heappop(self._heap)[3]

    def remove_requests(self, requests: Iterable[Request]) -> None:
        drop = {id(r) for r in requests}
        self._heap = [e for e in self._heap if id(e[3]) not in drop]
        heapq.heapify(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (e[3] for e in sorted(self._heap))

    def __len__(self) -> int:
        return len(self._heap)


def create_request_queue(policy: str) -> RequestQueue:
    if policy == "fcfs":
        return FCFSRequestQueue()
    if policy == "priority":
        return PriorityRequestQueue()
    raise ValueError(f"unknown scheduling policy {policy!r}")

"""Choosing the victim when a running request needs a KV block and none is free.

Preemption is by recompute: the victim's blocks are freed and it restarts later
from token 0 (its cached full blocks may still be hit if not evicted meanwhile).
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.request import Request


def pick_victim(running: Sequence[Request], policy: str) -> Request:
    """fcfs: the last request in the running list (the latest admitted).

    priority: the lowest priority (largest value), latest arrival among equals.
    The victim may be the request that asked for the block.
    """
    if not running:
        raise ValueError("no running request to preempt")
    if policy == "priority":
        return max(running, key=lambda r: (r.priority, r.arrival_time))
    return running[-1]

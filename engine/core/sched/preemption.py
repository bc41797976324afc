"""Choosing the victim when a running request needs a KV block and none is free, and, under
the priority policy, when a waiting request outranks a running one.

Preemption is by recompute: the victim's blocks are freed and it restarts later
from token 0 (its cached full blocks may still be hit if not evicted meanwhile).

Priority (vLLM V1's policy): a waiting request that cannot be admitted for lack of KV blocks or
of a `max_num_seqs` seat displaces the lowest-priority running request, if that one has a
strictly lower priority (a larger value). Equal priorities never displace each other, so
within one priority level the order stays first come, first served; FCFS never displaces.
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


def displacement_victim(waiting: Request, running: Sequence[Request], policy: str) -> Request | None:
    """The running request `waiting` may preempt to be admitted (module note), or None."""
    if policy != "priority" or not running:
        return None
    victim = pick_victim(running, policy)
    return victim if victim.priority > waiting.priority else None

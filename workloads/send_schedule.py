"""When each request is sent: the open- and closed-loop rules the driver and the simulator share.

Open loop: every spec is sent at its `arrival_s` (seconds since the run start). With
`concurrency`, a spec whose time has come first waits for one of `concurrency` slots (vLLM's
`--max-concurrency`); that wait is client queue time, not lateness.

Closed loop: `concurrency` users; each sends the workload's next spec as soon as its previous
request finished (the spec's `arrival_s` is ignored).

Either way, a finished request whose spec has a `follow_up` (the next turn of a session) is
followed by that turn at the turn's own `arrival_s`, by the same user in a closed loop; a
closed-loop user takes the next spec of the workload only when its session has ended.

The schedule holds no clock: the asyncio driver (real time) and the simulator (virtual
time) ask it what to send first (`first`) and what to send once a request finished
(`after`), and each waits in its own way. One schedule serves one run.

`send_limits` reads which loop a run config asks for, and its concurrency.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from workloads.spec import RequestSpec

if TYPE_CHECKING:
    from analysis.record import RequestRecord
    from conf.schema import RunConfig


def send_limits(cfg: RunConfig) -> tuple[bool, int | None]:
    """(closed loop?, concurrency): a closed loop's users (`workload.concurrency=N`, or
    `arrival.process=closed` with `arrival.concurrency`), else the open loop's in-flight cap
    (`arrival.max_concurrency`, None: none)."""
    w, arr = cfg.workload, cfg.workload.arrival
    if w.concurrency is not None:
        if w.concurrency < 1:
            raise ValueError(f"workload.concurrency must be >= 1, got {w.concurrency}")
        return True, int(w.concurrency)
    if w.kind == "synthetic" and arr.process == "closed":
        return True, int(arr.concurrency)
    if arr.max_concurrency is not None and arr.max_concurrency < 1:
        raise ValueError(f"workload.arrival.max_concurrency must be >= 1, got {arr.max_concurrency}")
    return False, arr.max_concurrency


@dataclass(frozen=True, slots=True)
class Send:
    """One planned send: `at_s` seconds since the run start, or None for at once (a
    closed-loop user's next spec); `user` is the closed-loop user (-1 in an open loop)."""

    spec: RequestSpec
    at_s: float | None
    user: int = -1
    is_follow_up: bool = False


class SendSchedule:
    """The send rules of one run (see the module docstring)."""

    def __init__(self, *, closed_loop: bool = False, concurrency: int | None = None) -> None:
        if closed_loop and not concurrency:
            raise ValueError("closed loop needs concurrency >= 1")
        self.closed_loop = closed_loop
        self.concurrency = concurrency
        self._queue: deque[RequestSpec] = deque()  # closed loop: specs no user has taken yet

    @property
    def slots(self) -> int:
        """Open-loop concurrency slots a due send must take first (0: sends never wait)."""
        return 0 if self.closed_loop else (self.concurrency or 0)

    def first(self, specs: Iterable[RequestSpec]) -> list[Send]:
        """The sends that start the run: every spec at its arrival (open loop), or one spec
        per user at once (closed loop; fewer when the workload is shorter)."""
        if not self.closed_loop:
            return [Send(spec, spec.arrival_s) for spec in specs]
        self._queue = deque(specs)
        users = self.concurrency or 1
        return [Send(self._queue.popleft(), None, user) for user in range(min(users, len(self._queue)))]

    def after(self, send: Send, record: RequestRecord) -> Send | None:
        """What follows `send` once its request finished as `record`: its follow-up turn,
        else (closed loop) the user's next spec; None when nothing does."""
        spec = send.spec
        nxt = spec.follow_up(spec, record) if spec.follow_up is not None else None
        if nxt is not None:
            return Send(nxt, nxt.arrival_s, send.user, is_follow_up=True)
        if self.closed_loop and self._queue:
            return Send(self._queue.popleft(), None, send.user)
        return None

"""The tensor-parallel group of this process and the collectives the parallel layers call.

One group per process: `init_distributed` joins it through torch.distributed's env://
rendezvous (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE: the variables torchrun sets), the
executor sets them for the ranks it starts. Without a group (one rank) every collective is
the identity, so the parallel layers also run in a plain single-process engine.

Every collective is timed on the caller's clock (`perf_counter`) into `COMM_TIMES`, by kind
("all_reduce", "gather", "dispatch", "combine"); the worker hands the step's totals to the
executor with the step's output (steps.csv columns `comm_*_time`). On a CPU (gloo) the
collectives are synchronous, so the time includes waiting for the slowest rank.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from engine.distributed.netif import interface_towards

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ParallelInfo:
    rank: int
    world_size: int

    @property
    def is_driver(self) -> bool:
        """Rank 0 samples and answers the executor."""
        return self.rank == 0


SINGLE = ParallelInfo(0, 1)
_info: ParallelInfo = SINGLE
COMM_TIMES: dict[str, float] = {}


def info() -> ParallelInfo:
    return _info


def init_distributed(rank: int, world_size: int, backend: str = "auto", timeout_s: float = 300.0) -> ParallelInfo:
    """Join the group through env:// (MASTER_ADDR / MASTER_PORT must be set); idempotent."""
    global _info
    if world_size > 1 and not dist.is_initialized():
        if backend == "auto":
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(world_size)
        if backend == "gloo" and "GLOO_SOCKET_IFNAME" not in os.environ:
            _pin_gloo_interface(os.environ.get("MASTER_ADDR", ""))
        dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))
    _info = ParallelInfo(rank, world_size)
    return _info


def _pin_gloo_interface(master_addr: str) -> None:
    """Across nodes, bind gloo to the interface that reaches MASTER_ADDR (engine/distributed/netif.py
    says why its own choice can be loopback); one node (a loopback master) keeps gloo's choice."""
    iface = interface_towards(master_addr) if master_addr else None
    if iface is not None and iface != "lo":
        os.environ["GLOO_SOCKET_IFNAME"] = iface
        logger.info("gloo: interface %s (it reaches MASTER_ADDR=%s)", iface, master_addr)


def destroy_distributed() -> None:
    global _info
    if dist.is_initialized():
        dist.destroy_process_group()
    _info = SINGLE


def take_comm_times() -> dict[str, float]:
    """This step's seconds per collective kind, and reset the counters."""
    out = dict(COMM_TIMES)
    COMM_TIMES.clear()
    return out


@contextmanager
def timed(kind: str) -> Iterator[None]:
    t0 = time.perf_counter()
    try:
        yield
    finally:
        COMM_TIMES[kind] = COMM_TIMES.get(kind, 0.0) + time.perf_counter() - t0


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the ranks, in place; returns x."""
    if _info.world_size > 1:
        with timed("all_reduce"):
            dist.all_reduce(x)
    return x


def all_reduce_min(value: int) -> int:
    """The smallest `value` over the ranks (KV block counts agree on the smallest)."""
    if _info.world_size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_cpu_group())
    return int(t.item())


def gather_last_dim(x: torch.Tensor, sizes: list[int]) -> torch.Tensor | None:
    """Concatenate every rank's x [N, sizes[rank]] along the last dim on rank 0 ([N, sum(sizes)]);
    None on the other ranks. Uneven slices are padded to the largest for the collective."""
    if _info.world_size == 1:
        return x
    with timed("gather"):
        width = max(sizes)
        if x.shape[-1] < width:
            x = torch.nn.functional.pad(x, (0, width - x.shape[-1]))
        x = x.contiguous()
        bufs = [torch.empty_like(x) for _ in sizes] if _info.rank == 0 else None
        dist.gather(x, bufs, dst=0)
    if bufs is None:
        return None
    return torch.cat([b[..., :n] for b, n in zip(bufs, sizes, strict=True)], dim=-1)


def gather_bytes(payload: bytes) -> list[bytes] | None:
    """Every rank's `payload` on rank 0, rank 0's first (None on the other ranks): small host-side
    reports (a connector's per-step report), padded to the longest for the collective."""
    if _info.world_size == 1:
        return [payload]
    with timed("gather"):
        group = _cpu_group()
        size = torch.tensor([len(payload)], dtype=torch.int64)
        sizes = [torch.empty_like(size) for _ in range(_info.world_size)]
        dist.all_gather(sizes, size, group=group)
        lengths = [int(n.item()) for n in sizes]
        buf = torch.zeros(max(lengths), dtype=torch.uint8)
        buf[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else buf[:0]
        bufs = [torch.empty_like(buf) for _ in lengths] if _info.rank == 0 else None
        dist.gather(buf, bufs, dst=0, group=group)
    if bufs is None:
        return None
    return [b[:n].numpy().tobytes() for b, n in zip(bufs, lengths, strict=True)]


def broadcast_from_driver(x: torch.Tensor) -> torch.Tensor:
    """Rank 0's x on every rank (same shape and dtype everywhere), in place."""
    if _info.world_size > 1:
        with timed("broadcast"):
            dist.broadcast(x, src=0)
    return x


def all_to_all_single(out: torch.Tensor, x: torch.Tensor, out_splits: list[int], in_splits: list[int]) -> None:
    dist.all_to_all_single(out, x, output_split_sizes=out_splits, input_split_sizes=in_splits)


_CPU_GROUP: object | None = None


def _cpu_group():  # type: ignore[no-untyped-def]
    """A gloo group for small host-side agreements (the default group may be NCCL)."""
    global _CPU_GROUP
    if dist.get_backend() == "gloo":
        return None
    if _CPU_GROUP is None:
        _CPU_GROUP = dist.new_group(backend="gloo")
    return _CPU_GROUP

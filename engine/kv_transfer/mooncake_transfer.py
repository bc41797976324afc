"""MooncakeTransferConnector: KV blocks read straight from the producer's memory with Mooncake's
TransferEngine (prefill/decode disaggregation without the store in between).

Producer (`kv_role: kv_producer`): every full block a request computes is copied once, after
the step's forward, into an outbox: a host buffer of `outbox_bytes` registered with the
producer's TransferEngine, in slots the scheduler half assigns (least recently used slot
reused, as in the CPU tier). Each slot is a 64-byte header (the block's chained hash) followed
by the block's KV over every layer. The worker half answers, on a small ZMQ REP socket at
`directory_address`, where its outbox is (`hello`: TransferEngine session, base address, slot
stride) and which slots hold a list of block hashes (`lookup`).

Consumer (`kv_role: kv_consumer`): the scheduler half asks each producer in
`producer_directories` for the blocks past its local prefix hit and takes the longest run;
the worker half reads those slots with `batch_transfer_sync_read` into its own registered
buffer and checks every header against the hash it asked for. A slot the producer reused
meanwhile (its LRU moved on), a producer that is gone or slow (`lookup_timeout_s`), a failed
read: each is a failed load, so those tokens are recomputed, never taken from another prefix.
After a failure the consumer leaves that producer alone for `retry_after_s` seconds.

The data path is the TransferEngine's (TCP here, RDMA where the NICs have it); the ZMQ socket
only carries the addresses (as vLLM's connectors pass `kv_transfer_params`), so the router and
the scheduler need nothing new: the decode instance finds the prefill instance's blocks by hash.

Tensor parallelism: every rank has its own outbox (its KV-head slice of each block, in the same
slots: the scheduler half assigns them once for all ranks) and its own directory, at
`directory_address`'s port + rank; consumer rank r reads producer rank r (both sides run the same
tensor-parallel size: the layout check refuses another). The consumer's scheduler half counts a
block as found when every rank's directory lists it in the same slot.

kv_connector_extra_config (docs/kv_transfer.md): metadata_server (mooncake_master's HTTP
metadata, "http://127.0.0.1:8080/metadata"), protocol ("tcp"), local_hostname ("127.0.0.1"),
directory_address (producer: "tcp://127.0.0.1:PORT" to bind), producer_directories (consumer:
list of those addresses), outbox_bytes (producer: 256 MiB) or outbox_blocks, read_buffer_bytes (consumer:
64 MiB; a larger load is read in parts), lookup_timeout_s (1.0), retry_after_s (10),
async_load (true).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np
import torch
import zmq

from engine.distributed.netif import free_port
from engine.kv_transfer.base import (
    BlockStoreConnector,
    KVConnectorRole,
    assign_save_slots,
    checked_extra_config,
)
from engine.kv_transfer.keys import default_key_prefix, rank_address
from engine.kv_transfer.metadata import BlockTransfer

if TYPE_CHECKING:
    from engine.config import EngineConfig

logger = logging.getLogger(__name__)

HEADER = 64  # bytes before each slot's KV: the block hash (32 bytes), zero-padded
_KNOWN_KEYS = {
    "metadata_server", "protocol", "local_hostname", "directory_address", "producer_directories", "outbox_bytes",
    "outbox_blocks",
    "read_buffer_bytes", "lookup_timeout_s", "retry_after_s", "async_load", "device_name",
}  # fmt: skip
_SLOT_BITS = 40  # a load slot is (producer index << 40) | slot


def _transfer_engine(extra: dict[str, Any]) -> tuple[Any, str]:
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:
        raise RuntimeError(f"MooncakeTransferConnector needs Mooncake: pip install 'servelab[kv]' "
                           f"(mooncake-transfer-engine-non-cuda; Debian libibverbs1 libnuma1) ({exc})") from None
    engine = TransferEngine()
    host = str(extra.get("local_hostname", "127.0.0.1"))
    name = f"{host}:{free_port(host)}"
    metadata = str(extra.get("metadata_server", "http://127.0.0.1:8080/metadata"))
    rc = engine.initialize(name, metadata, str(extra.get("protocol", "tcp")), str(extra.get("device_name", "")))
    if rc != 0:
        raise RuntimeError(f"MooncakeTransferConnector: TransferEngine.initialize({name}, {metadata}) returned {rc}; "
                           "is mooncake_master (with its HTTP metadata server) running?")
    return engine, name


class _Directory:
    """The producer's REP socket: `hello` and `lookup` requests, answered on a thread."""

    def __init__(self, address: str, hello: dict[str, Any], lookup: Any) -> None:
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(address)
        self._hello, self._lookup = hello, lookup
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-directory", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            try:
                msg = msgspec.msgpack.decode(self._sock.recv())
                if msg.get("op") == "hello":
                    reply: dict[str, Any] = self._hello
                else:
                    reply = {"slots": self._lookup([bytes(h) for h in msg.get("hashes", [])])}
            except Exception as exc:  # a malformed request gets an error, the socket stays usable
                reply = {"error": f"{type(exc).__name__}: {exc}"}
            self._sock.send(msgspec.msgpack.encode(reply))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2.0)
        self._sock.close()
        self._ctx.term()


class _Producer:
    """A consumer's REQ client of one producer directory (a fresh socket after any timeout)."""

    def __init__(self, address: str, timeout_s: float) -> None:
        self.address, self.timeout_ms = address, int(timeout_s * 1000)
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sock: zmq.Socket[bytes] | None = None
        self.down_until = 0.0

    def ask(self, msg: dict[str, Any]) -> dict[str, Any]:
        if self._sock is None:
            self._sock = self._ctx.socket(zmq.REQ)
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.connect(self.address)
        self._sock.send(msgspec.msgpack.encode(msg))
        if not self._sock.poll(self.timeout_ms):
            self._sock.close()
            self._sock = None
            raise TimeoutError(f"no answer from {self.address} in {self.timeout_ms} ms")
        reply = msgspec.msgpack.decode(self._sock.recv())
        if "error" in reply:
            raise RuntimeError(f"{self.address}: {reply['error']}")
        return dict(reply)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


class MooncakeTransferConnector(BlockStoreConnector):
    def __init__(self, config: EngineConfig, role: KVConnectorRole, bytes_per_block: int, rank: int = 0) -> None:
        """`bytes_per_block`: one block of the whole model (every KV head), which sizes the outbox's
        slot count alike on the scheduler and on every rank; `rank`: the tensor-parallel rank whose
        slice this worker half moves (its stride is its own slice's, set by register_kv_caches)."""
        super().__init__(config, role)
        extra = checked_extra_config("MooncakeTransferConnector", self.transfer_config.kv_connector_extra_config,
                                     _KNOWN_KEYS)
        tc = self.transfer_config
        if tc.is_producer and tc.is_consumer:
            raise ValueError("MooncakeTransferConnector: kv_role must be kv_producer or kv_consumer "
                             "(kv_both: use MooncakeStoreConnector)")
        self.extra = extra
        self.rank, self.tp = rank, config.parallel.tensor_parallel_size
        self.stride = HEADER + bytes_per_block
        # Weights and KV layout (keys.py): a producer of another model is refused even when its slots fit.
        self.layout = default_key_prefix(config, rank)
        self.retry_after_s = float(extra.get("retry_after_s", 10.0))
        self._timeout_s = float(extra.get("lookup_timeout_s", 1.0))
        addresses = extra.get("producer_directories") or []
        self._addresses = [str(a) for a in ([addresses] if isinstance(addresses, str) else addresses)]
        self.num_slots = 0
        if tc.is_producer:
            if not extra.get("directory_address"):
                raise ValueError("MooncakeTransferConnector: a kv_producer needs directory_address "
                                 "(e.g. tcp://127.0.0.1:5601)")
            self.num_slots = (int(extra["outbox_blocks"]) if "outbox_blocks" in extra
                              else int(extra.get("outbox_bytes", 256 << 20)) // self.stride)
            if self.num_slots < 1:
                raise ValueError("MooncakeTransferConnector: outbox_bytes holds no block; raise it")
        elif tc.is_consumer and not self._addresses:
            raise ValueError("MooncakeTransferConnector: a kv_consumer needs producer_directories "
                             "(the producers' directory_address values)")
        # Producer scheduler half: hash -> slot in LRU order (the CPU tier's policy, no pins:
        # a consumer reading a reused slot sees another hash in its header and recomputes).
        self._index: OrderedDict[bytes, int] = OrderedDict()
        self._free_slots = list(range(self.num_slots - 1, -1, -1))
        # Consumer scheduler half: each producer's directories (one per rank), and the slots the last lookup found.
        self._producers: list[list[_Producer]] = []
        self._found: dict[bytes, int] = {}
        # Worker halves.
        self._engine: Any = None
        self._session = ""
        self._buffer: np.ndarray | None = None  # producer: the outbox; consumer: the read buffer
        self._directory: _Directory | None = None
        # producer worker: what each written slot holds, and where each hash is (the directory's view)
        self._slot_hash: dict[int, bytes] = {}
        self._hash_slot: dict[bytes, int] = {}
        self._dir_lock = threading.Lock()
        self._remote: dict[int, tuple[str, int, int]] = {}  # consumer worker: producer -> (session, base, stride)

    # ---- producer, scheduler half --------------------------------------------------------
    def select_saves(self, transfer: BlockTransfer) -> BlockTransfer | None:
        return assign_save_slots(transfer, self._index, self._free_slots, lambda: self._index.popitem(last=False)[1])

    # ---- consumer, scheduler half --------------------------------------------------------
    def lookup(self, block_hashes: list[bytes]) -> int | None:
        if not self.transfer_config.is_consumer:
            return 0
        if not self._producers:
            self._producers = [[_Producer(rank_address(a, r), self._timeout_s) for r in range(self.tp)]
                               for a in self._addresses]
        best, best_slots = 0, []
        for index, ranks in enumerate(self._producers):
            slots = self._ask_ranks(ranks, block_hashes)
            n = next((i for i, s in enumerate(slots) if s < 0), len(slots))
            if n > best:
                best, best_slots = n, [(index << _SLOT_BITS) | int(s) for s in slots[:n]]
        self._found = dict(zip(block_hashes[:best], best_slots, strict=True))
        return best

    def _ask_ranks(self, ranks: list[_Producer], block_hashes: list[bytes]) -> list[int]:
        """One producer's slot per hash as every rank's directory lists it (-1 where a rank lacks
        the block or the ranks disagree: a slot being rewritten on one of them)."""
        found: list[int] | None = None
        for producer in ranks:
            if time.monotonic() < producer.down_until:
                return []
            try:
                slots = [int(s) for s in producer.ask({"op": "lookup", "hashes": block_hashes})["slots"]]
            except Exception as exc:
                logger.warning("kv directory %s: %s; not asking it for %.0f s (requests recompute)", producer.address,
                               exc, self.retry_after_s)
                producer.down_until = time.monotonic() + self.retry_after_s
                return []
            found = slots if found is None else [a if a == b else -1 for a, b in zip(found, slots, strict=True)]
        return found or []

    def assign_load_slots(self, block_hashes: list[bytes]) -> list[int]:
        return [self._found[h] for h in block_hashes]

    # ---- worker halves ---------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        super().register_kv_caches(kv_caches)
        self.stride = HEADER + int(np.prod(self.block_shape())) * kv_caches[0].element_size()  # this rank's slice
        self._engine, self._session = _transfer_engine(self.extra)
        if self.transfer_config.is_producer:
            self._buffer = np.zeros(self.num_slots * self.stride, dtype=np.uint8)
        else:
            size = max(int(self.extra.get("read_buffer_bytes", 64 << 20)) // self.stride, 1) * self.stride
            self._buffer = np.zeros(size, dtype=np.uint8)
        rc = self._engine.register_memory(self._buffer.ctypes.data, self._buffer.nbytes)
        if rc != 0:
            raise RuntimeError(f"MooncakeTransferConnector: register_memory returned {rc}")
        if self.transfer_config.is_producer:
            hello = {"session": self._session, "base": int(self._buffer.ctypes.data), "stride": self.stride,
                     "layout": self.layout}
            address = rank_address(str(self.extra["directory_address"]), self.rank)
            self._directory = _Directory(address, hello, self._lookup_slots)

    def _lookup_slots(self, hashes: list[bytes]) -> list[int]:
        """Directory thread: the slot holding each hash, -1 from the first one not held."""
        out = []
        with self._dir_lock:
            for h in hashes:
                slot = self._hash_slot.get(h)
                if slot is None:
                    break
                out.append(slot)
        return out + [-1] * (len(hashes) - len(out))

    def put_blocks(self, transfer: BlockTransfer, data: torch.Tensor) -> None:
        assert self._buffer is not None
        raw = data.cpu().contiguous().view(torch.uint8).reshape(len(transfer), -1).numpy()
        for i, (slot, h) in enumerate(zip(transfer.slots, transfer.block_hashes, strict=True)):
            at = slot * self.stride
            with self._dir_lock:  # the slot is unlisted while it is rewritten
                old = self._slot_hash.pop(slot, None)
                if old is not None and self._hash_slot.get(old) == slot:
                    del self._hash_slot[old]
            self._buffer[at:at + HEADER] = 0
            self._buffer[at:at + len(h)] = np.frombuffer(h, dtype=np.uint8)
            self._buffer[at + HEADER:at + self.stride] = raw[i]
            with self._dir_lock:
                self._slot_hash[slot] = h
                self._hash_slot[h] = slot

    def _remote_of(self, index: int) -> tuple[str, int, int]:
        if index not in self._remote:
            producer = _Producer(rank_address(self._addresses[index], self.rank), max(self._timeout_s, 1.0))
            try:
                hello = producer.ask({"op": "hello"})
            finally:
                producer.close()
            if int(hello["stride"]) != self.stride:
                raise RuntimeError(f"producer {self._addresses[index]} has {hello['stride']}-byte slots, "
                                   f"this engine {self.stride} (a different model or KV layout)")
            if hello.get("layout") != self.layout:
                raise RuntimeError(f"producer {self._addresses[index]} holds KV of {hello.get('layout')!r}, "
                                   f"this engine {self.layout!r} (a different model or KV layout)")
            self._remote[index] = (str(hello["session"]), int(hello["base"]), int(hello["stride"]))
        return self._remote[index]

    def get_blocks(self, transfer: BlockTransfer) -> torch.Tensor:
        """Runs on the load thread: read the slots, check their headers, return the KV."""
        assert self._buffer is not None
        per_read = self._buffer.nbytes // self.stride
        parts = []
        for start in range(0, len(transfer), per_read):
            slots = transfer.slots[start:start + per_read]
            hashes = transfer.block_hashes[start:start + per_read]
            index = slots[0] >> _SLOT_BITS
            session, base, stride = self._remote_of(index)
            local = int(self._buffer.ctypes.data)
            remote = [base + (s & ((1 << _SLOT_BITS) - 1)) * stride for s in slots]
            rc = self._engine.batch_transfer_sync_read(session, [local + i * stride for i in range(len(slots))],
                                                       remote, [stride] * len(slots))
            if rc != 0:
                raise RuntimeError(f"batch_transfer_sync_read from {session} returned {rc}")
            view = self._buffer[: len(slots) * stride].reshape(len(slots), stride)
            for i, h in enumerate(hashes):
                if bytes(view[i, : len(h)]) != h:
                    raise RuntimeError(f"slot {remote[i] - base} now holds another block (the producer reused it)")
            parts.append(torch.from_numpy(view[:, HEADER:].copy()))
        kv = self.kv_caches[0]
        return torch.cat(parts).view(kv.dtype).view(len(transfer), *self.block_shape())

    def shutdown(self) -> None:
        super().shutdown()  # the load thread first: it may be reading
        if self._directory is not None:
            self._directory.close()
            self._directory = None
        for ranks in self._producers:
            for producer in ranks:
                producer.close()
        if self._engine is not None and self._buffer is not None:
            self._engine.unregister_memory(self._buffer.ctypes.data)
        self._engine = None


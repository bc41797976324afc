"""Mooncake's TransferEngine over TCP on 127.0.0.1: the API MooncakeTransferConnector stands on
(tests/test_kv_transfer_direct.py tests the connector). One engine registers a buffer, the
other reads from it by address, whole and at an offset (one block's worth).

Needs `mooncake-transfer-engine-non-cuda` and Debian's libibverbs1 / libnuma1, like
tests/test_kv_mooncake.py; the HTTP metadata server is `mooncake_master`'s.
"""

from __future__ import annotations

import socket

import numpy as np
import pytest

from engine.kv_transfer.mooncake_master import MooncakeMaster, find_master_binary


def _missing() -> str | None:
    if find_master_binary() is None:
        return "mooncake_master not installed (pip install 'servelab[kv]')"
    try:
        import mooncake.engine  # noqa: F401
    except ImportError as exc:
        return f"mooncake.engine does not load: {exc}"
    return None


pytestmark = pytest.mark.skipif(_missing() is not None, reason=str(_missing()))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_consumer_reads_a_registered_producer_buffer_over_tcp() -> None:
    from mooncake.engine import TransferEngine

    with MooncakeMaster() as master:
        producer, consumer = TransferEngine(), TransferEngine()
        producer_name = f"127.0.0.1:{_free_port()}"
        assert producer.initialize(producer_name, master.metadata_server, "tcp", "") == 0
        assert consumer.initialize(f"127.0.0.1:{_free_port()}", master.metadata_server, "tcp", "") == 0
        n = 4 << 20
        src = (np.arange(n, dtype=np.uint32) * 2654435761 % 251).astype(np.uint8)
        dst = np.zeros(n, dtype=np.uint8)
        assert producer.register_memory(src.ctypes.data, n) == 0
        assert consumer.register_memory(dst.ctypes.data, n) == 0
        assert consumer.transfer_sync_read(producer_name, dst.ctypes.data, src.ctypes.data, n) == 0
        assert np.array_equal(dst, src)
        dst[:] = 0
        block, at, frm = 64 << 10, 4096, 1 << 20
        assert consumer.transfer_sync_read(producer_name, dst.ctypes.data + at, src.ctypes.data + frm, block) == 0
        assert np.array_equal(dst[at : at + block], src[frm : frm + block])
        assert not dst[:at].any() and not dst[at + block :].any(), "the read wrote outside its range"
        assert producer.unregister_memory(src.ctypes.data) == 0
        assert consumer.unregister_memory(dst.ctypes.data) == 0

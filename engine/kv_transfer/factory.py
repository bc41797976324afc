"""Build the connector `kv_transfer.kv_connector` names, for one side of the step seam."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.kv_transfer.base import KVConnectorBase, KVConnectorRole

if TYPE_CHECKING:
    from engine.config import EngineConfig


def create_kv_connector(
    config: EngineConfig, role: KVConnectorRole, bytes_per_block: int, rank: int = 0
) -> KVConnectorBase | None:
    """The configured connector (None when `kv_transfer.kv_connector` is null).

    `bytes_per_block`: one KV block over every layer and every KV head of the model (the CPU
    tier sizes its pool with it on both sides). `rank`: the tensor-parallel rank of a worker
    half (the Mooncake connectors move that rank's KV-head slice; the scheduler half is rank 0).
    """
    name = config.kv_transfer.kv_connector
    if name is None:
        return None
    if name == "CPUOffloadConnector":
        from engine.kv_transfer.cpu_offload import CPUOffloadConnector

        return CPUOffloadConnector(config, role, bytes_per_block)
    if name == "MooncakeStoreConnector":
        from engine.kv_transfer.mooncake_store import MooncakeStoreConnector

        return MooncakeStoreConnector(config, role, rank)
    if name == "MooncakeTransferConnector":
        from engine.kv_transfer.mooncake_transfer import MooncakeTransferConnector

        return MooncakeTransferConnector(config, role, bytes_per_block, rank)
    raise ValueError(f"unknown kv_connector {name!r}")

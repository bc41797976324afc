"""Build the connector `kv_transfer.kv_connector` names, for one side of the step seam."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.kv_transfer.base import KVConnectorBase, KVConnectorRole

if TYPE_CHECKING:
    from engine.config import EngineConfig


def create_kv_connector(config: EngineConfig, role: KVConnectorRole, bytes_per_block: int) -> KVConnectorBase | None:
    """The configured connector (None when `kv_transfer.kv_connector` is null).

    `bytes_per_block`: one KV block over every layer, as the worker allocated it (the CPU
    tier sizes its pool with it on both sides).
    """
    name = config.kv_transfer.kv_connector
    if name is None:
        return None
    if name == "CPUOffloadConnector":
        from engine.kv_transfer.cpu_offload import CPUOffloadConnector

        return CPUOffloadConnector(config, role, bytes_per_block)
    if name == "MooncakeStoreConnector":
        from engine.kv_transfer.mooncake_store import MooncakeStoreConnector

        return MooncakeStoreConnector(config, role)
    if name == "MooncakeTransferConnector":
        from engine.kv_transfer.mooncake_transfer import MooncakeTransferConnector

        return MooncakeTransferConnector(config, role, bytes_per_block)
    raise ValueError(f"unknown kv_connector {name!r}")

"""One model step with the connector's worker half around it.

Loads start before the forward (they write blocks of requests that are not in this step, so the
forward never waits for them), saves run after it (the step's forward wrote them). `save_kv_layer` is called per layer after the whole forward rather than
from inside each layer: the model code stays connector-free, at the cost of overlapping no
save with compute.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.kv_transfer.base import KVConnectorBase
    from engine.step_io import ModelRunnerOutput, SchedulerOutput
    from engine.worker.model_runner import ModelRunner

# A step with no tokens that only waits for loads blocks this long for one to finish, so an
# engine whose every request is loading does not spin on the CPU.
IDLE_LOAD_WAIT_S = 0.02


def execute_with_connector(
    connector: KVConnectorBase, runner: ModelRunner, scheduler_output: SchedulerOutput, num_layers: int
) -> ModelRunnerOutput:
    connector.bind_connector_metadata(scheduler_output.kv_connector_metadata)
    try:
        connector.start_load_kv()
        for layer in range(num_layers):
            connector.wait_for_layer_load(layer)
        out = runner.execute_model(scheduler_output)
        for layer in range(num_layers):
            connector.save_kv_layer(layer)
        connector.wait_for_save()
        meta = scheduler_output.kv_connector_metadata
        if scheduler_output.is_empty and meta is not None and meta.await_loads:
            connector.wait_for_finished(IDLE_LOAD_WAIT_S)
        out.kv_connector_output = connector.get_finished(scheduler_output.finished_req_ids)
    finally:
        connector.clear_connector_metadata()
    return out

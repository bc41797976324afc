"""External KV: the connector boundary and its connectors (vLLM's `KVConnectorBase_V1` shape).

A connector has two halves, one per side of the step seam (engine/step_io.py):
- the scheduler half (`base.KVConnectorBase`, role SCHEDULER) answers how many more prompt
  tokens an external store holds for a request, records what to load into the blocks the
  scheduler allocated, and builds the step's `KVConnectorMetadata` (loads and saves, carried
  in `SchedulerOutput.kv_connector_metadata`);
- the worker half (role WORKER) executes that metadata against the paged KV cache tensors
  and reports, in `ModelRunnerOutput.kv_connector_output`, which loads finished or failed.

Keys are the engine's chained block hashes (engine/core/kv_cache/hashing.py), so a store can
only answer for the exact prefix (tokens, cache salt) that produced a block. Connectors:
`cpu_offload.CPUOffloadConnector` (a host-memory tier) and
`mooncake_store.MooncakeStoreConnector` (Mooncake's distributed store, shared by engines).
"""

"""Multi-rank execution: the process group, sharding plans, parallel collectives, MoE dispatch.

`parallel_state` owns the one torch.distributed group of a worker process (gloo on a CPU,
NCCL on a GPU) and times every collective; `sharding` decides which slice of each weight a
rank holds; `moe_dispatch` moves tokens to the ranks of their experts and back;
`worker` is the per-rank worker, `worker_proc` its process entry point.
"""

"""The worker of one tensor-parallel rank: its slice of the model, its KV cache, its runner.

Differences from the one-rank `Worker`:
- it joins the process group first (env:// rendezvous, `parallel_state.init_distributed`);
- the model is `ParallelLlamaForCausalLM`, sliced at load time;
- the KV cache holds this rank's KV heads; every rank sizes it from its own bytes per block,
  then all ranks agree on the smallest block count (the scheduler sees one pool);
- rank 0 samples from the gathered logits and broadcasts the ids; the other ranks receive
  them, so every rank's persistent batch holds the same tokens for the next step;
- a KV connector's worker half moves this rank's KV-head slice; after each step rank 0 gathers
  every rank's connector report and merges them (engine/kv_transfer/tp_output.py), since only
  rank 0 answers the executor.
"""

from __future__ import annotations

import logging

import msgspec
import torch

from engine.attention.registry import get_attention_backend
from engine.config import EngineConfig
from engine.distributed import parallel_state as ps
from engine.distributed.sharding import rank_plan
from engine.hugepages import zeros_huge
from engine.kv_transfer.base import KVConnectorRole
from engine.kv_transfer.factory import create_kv_connector
from engine.kv_transfer.metadata import KVConnectorOutput
from engine.kv_transfer.tp_output import TPOutputMerger
from engine.sample.sampler import Sampler, SamplingBatch
from engine.seam import TokenLogprobs
from engine.step_io import ModelRunnerOutput, SchedulerOutput
from engine.worker.model_runner import ModelRunner
from engine.worker.worker import Worker, check_kv_capacity, cover_positions, kv_bytes_per_block

logger = logging.getLogger(__name__)


class BroadcastingSampler(Sampler):
    """Rank 0: sample, then send the ids to the other ranks."""

    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> tuple[list[int], list[TokenLogprobs | None]]:
        ids, logprobs = super().sample(logits, batch)
        if ids:
            ps.broadcast_from_driver(torch.tensor(ids, dtype=torch.int64, device=_comm_device()))
        return ids, logprobs


class ReceivingSampler(Sampler):
    """Ranks > 0: no logits here; take rank 0's ids."""

    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> tuple[list[int], list[TokenLogprobs | None]]:
        n = len(batch.params)
        if n == 0:
            return [], []
        ids = ps.broadcast_from_driver(torch.empty(n, dtype=torch.int64, device=_comm_device()))
        return ids.tolist(), [None] * n


def _comm_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.distributed.get_backend() == "nccl" else \
        torch.device("cpu")


class ParallelWorker(Worker):
    def __init__(self, config: EngineConfig, rank: int, local_rank: int = 0) -> None:
        if config.device.device in ("auto", "cuda") and torch.cuda.is_available():
            config.device.device = f"cuda:{local_rank}"
            torch.cuda.set_device(local_rank)
        super().__init__(config)
        self.rank = rank
        self.world_size = config.parallel.tensor_parallel_size
        self._kv_merger: TPOutputMerger | None = None  # rank 0 with a connector and more than one rank

    def load_and_allocate(self) -> int:
        from engine.model.parallel_layers import load_parallel_model

        par = self.config.parallel
        info = ps.init_distributed(self.rank, self.world_size, par.dist_backend, par.worker_timeout_s)
        torch.manual_seed(self.config.model.seed)
        backend = get_attention_backend(self.config.attention.backend, self.device)
        self.model = load_parallel_model(
            self.config.model, backend, self.device,
            lambda arch: rank_plan(arch, info.world_size, info.rank, par.enable_expert_parallel),
        )
        arch = self.model.arch  # this rank's shapes: its KV heads
        self.arch = self.model.full_arch
        model_cfg = self.config.model
        self.max_model_len = arch.max_model_len(model_cfg.max_model_len, model_cfg.allow_long_max_model_len)
        cache = self.config.cache
        per_block = kv_bytes_per_block(arch.num_layers, cache.block_size, arch.num_kv_heads, arch.head_dim, self.kv_dtype)
        num_blocks = cache.num_blocks or max(2, int(cache.kv_cache_memory_gb * (1 << 30) // per_block))
        num_blocks = ps.all_reduce_min(num_blocks)
        self.max_model_len = check_kv_capacity(self.max_model_len, model_cfg.max_model_len, num_blocks, cache)
        cover_positions(self.model, self.max_model_len)
        shape = (2, num_blocks, cache.block_size, arch.num_kv_heads, arch.head_dim)
        kv_caches = [zeros_huge(shape, self.kv_dtype, self.device) for _ in range(arch.num_layers)]
        logger.info("rank %d/%d: %d q heads, %d KV heads; KV cache %d blocks (%.1f MiB)", info.rank,
                    info.world_size, arch.num_heads, arch.num_kv_heads, num_blocks, num_blocks * per_block / (1 << 20))
        self.model_runner = ModelRunner(
            self.model, backend, kv_caches, cache.block_size, self.max_model_len,
            self.config.scheduler.max_num_seqs, self.device, enforce_eager=True,
        )
        if info.world_size > 1:
            self.model_runner.sampler = BroadcastingSampler() if info.is_driver else ReceivingSampler()
        full = self.arch  # the whole model's block: the connector's slot count agrees on every rank and the scheduler
        self.kv_bytes_per_block = kv_bytes_per_block(full.num_layers, cache.block_size, full.num_kv_heads,
                                                     full.head_dim, self.kv_dtype)
        self.kv_connector = create_kv_connector(self.config, KVConnectorRole.WORKER, self.kv_bytes_per_block, info.rank)
        if self.kv_connector is not None:
            self.kv_connector.register_kv_caches(kv_caches)
            if info.world_size > 1 and info.is_driver:
                self._kv_merger = TPOutputMerger(info.world_size)
        return num_blocks

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        ps.take_comm_times()  # a step's counters start at zero
        out = super().execute_model(scheduler_output)
        if self.kv_connector is not None and self.world_size > 1:
            out.kv_connector_output = self._merge_kv_reports(out.kv_connector_output)
        out.comm_times = ps.take_comm_times()
        return out

    def _merge_kv_reports(self, mine: KVConnectorOutput | None) -> KVConnectorOutput | None:
        """Every rank's connector report of this step, merged on rank 0 (a collective: every rank
        calls it every step); the other ranks' own reports are not sent anywhere."""
        reports = ps.gather_bytes(msgspec.msgpack.encode(mine or KVConnectorOutput()))
        if reports is None or self._kv_merger is None:
            return mine
        return self._kv_merger.merge([msgspec.msgpack.decode(r, type=KVConnectorOutput) for r in reports])

    def shutdown(self) -> None:
        super().shutdown()
        ps.destroy_distributed()

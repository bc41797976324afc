"""The simulated executor: the real scheduler's plans, a cost model's step times, a virtual clock.

It keeps exactly the per-request bookkeeping a real model runner keeps, so that the
scheduler makes the same decisions as with a real model:

- a new request knows len(token_ids) tokens (prompt plus any output from before a
  preemption); each token it samples adds one; a request in finished_req_ids is forgotten;
- a request samples in a step iff num_computed_tokens + num_scheduled_tokens >= the tokens
  it knows (it consumed its whole known sequence); otherwise it is in a partial prefill.

Sampled tokens are a fixed non-EOS id: output lengths come from the workload's
max_tokens (with ignore_eos), so the scheduler stops each request at max_tokens.
`clock()` is the virtual time: it starts at `start_time` and each step adds its modelled
duration. A driver replaying arrivals calls `advance_to(t)` when the engine is idle.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

from engine.context_length import kv_context_limit
from engine.dtypes import canonical_dtype
from engine.executor.base import Executor
from engine.kv_cache_spec import tokens_alone
from engine.model.arch import ModelArch
from engine.sim.calibrated import CalibratedStepModel
from engine.sim.hardware import HardwareProfile
from engine.sim.kv_capacity import arch_kv_groups, kv_capacity
from engine.sim.model_counts import load_arch
from engine.sim.roofline import RooflineStepModel
from engine.sim.step_batch import StepBatch, StepModel
from engine.step_io import ModelRunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    from engine.config import EngineConfig

logger = logging.getLogger(__name__)
_warned: set[str] = set()


def build_step_model(
    spec: str,
    arch: ModelArch,
    hw: HardwareProfile,
    tp: int = 1,
    dtype: str = "bf16",
    kv_dtype: str | None = None,
    ep: bool = False,
) -> StepModel:
    """'roofline' or the path of a saved `CalibratedStepModel` (.json / .yaml); `ep`: expert parallel
    over the `tp` ranks (roofline only)."""
    if spec == "roofline":
        why = hw.host_mismatch()
        if why and why not in _warned:  # once per process: a plan builds an executor per run
            _warned.add(why)
            logger.warning(why)
        return RooflineStepModel(arch, hw, tp=tp, dtype=dtype, kv_dtype=kv_dtype, ep=ep)
    return CalibratedStepModel.load(spec)


class SimulatedExecutor(Executor):
    """Executor with no model: see the module docstring for the contract.

    The sampled id is `token_id` modulo the vocabulary (the next id if that is EOS).
    `hardware` is needed only to size the KV cache when config.cache.num_blocks is None.
    `dtype` / `kv_dtype` default to the config's model dtype / cache dtype.
    """

    def __init__(
        self,
        config: EngineConfig,
        step_model: StepModel,
        arch: ModelArch,
        *,
        hardware: HardwareProfile | None = None,
        tp: int = 1,
        dtype: str | None = None,
        kv_dtype: str | None = None,
        gpu_memory_utilization: float = 0.9,
        token_id: int = 1000,
        start_time: float = 0.0,
        record_breakdown: bool = False,
    ) -> None:
        super().__init__(config)
        self.step_model, self.arch, self.hardware, self.tp = step_model, arch, hardware, tp
        # "auto" on simulated (GPU) hardware is the checkpoint dtype: bf16 (engine/platform.py).
        model_dtype = "bfloat16" if config.model.dtype == "auto" else config.model.dtype
        self.dtype = dtype or canonical_dtype(model_dtype)
        cache_dtype = config.cache.cache_dtype
        self.kv_dtype = kv_dtype or (self.dtype if cache_dtype == "auto" else cache_dtype)
        self.gpu_memory_utilization = gpu_memory_utilization
        self.eos_token_id = arch.eos_token_id
        token = token_id % arch.vocab_size
        self.token_id = (token + 1) % arch.vocab_size if token == arch.eos_token_id else token
        self.max_model_len = arch.max_model_len(config.model.max_model_len, config.model.allow_long_max_model_len)
        self.record_breakdown = record_breakdown
        self._now = start_time
        self._known: dict[str, int] = {}  # req_id -> tokens the runner knows
        self._prompt_len: dict[str, int] = {}
        self.num_steps = 0
        self.busy_time = 0.0  # sum of modelled step times
        self.time_by_part: dict[str, float] = {}

    @classmethod
    def from_names(
        cls,
        config: EngineConfig,
        model: str | ModelArch,
        hardware: str,
        tp: int = 1,
        step_model: str = "roofline",
        dtype: str = "bf16",
        ep: bool = False,
        **kwargs: object,
    ) -> SimulatedExecutor:
        """Build from names or paths: a model shape (`engine.sim.model_counts.load_arch`), a hardware
        profile (`HardwareProfile.load`), 'roofline' or a fit's path."""
        arch = model if isinstance(model, ModelArch) else load_arch(model)
        hw = HardwareProfile.load(hardware)
        kv = kwargs.get("kv_dtype")
        sm = build_step_model(step_model, arch, hw, tp, dtype, kv if isinstance(kv, str) else None, ep=ep)
        return cls(config, sm, arch, hardware=hw, tp=tp, dtype=dtype, **kwargs)  # type: ignore[arg-type]

    # ---- Executor -----------------------------------------------------------------
    def initialize(self) -> int:
        """KV blocks: config.cache.num_blocks if set, else what fits on the hardware. Sets
        `max_model_len` by the real workers' rule (engine/context_length.py): a
        model.max_model_len the blocks cannot hold is refused naming both numbers; an unset one
        is lowered to them with a warning."""
        num_blocks = self._num_blocks()
        cache, model = self.config.cache, self.config.model
        if cache.num_blocks is not None:
            sized_by, raise_what = f"cache.num_blocks={num_blocks}", "cache.num_blocks"
        else:
            assert self.hardware is not None
            sized_by = f"gpu_memory_utilization={self.gpu_memory_utilization:g} of {self.hardware.name} at tp={self.tp}"
            raise_what = "gpu_memory_utilization (sim.gpu_memory_utilization in a run)"
        own = self.arch.max_model_len(model.max_model_len, model.allow_long_max_model_len)
        # the scheduler allocates by the model's KV cache groups, as on a real worker
        groups = self.kv_cache_groups = arch_kv_groups(self.arch)
        holds = tokens_alone(groups, num_blocks, cache.block_size, self.config.scheduler.max_num_batched_tokens)
        self.max_model_len = kv_context_limit(own, model.max_model_len, num_blocks, cache.block_size,
                                              sized_by=sized_by, raise_what=raise_what, holds=holds)  # fmt: skip
        return num_blocks

    def _num_blocks(self) -> int:
        cache = self.config.cache
        if cache.num_blocks is not None:
            return cache.num_blocks
        if self.hardware is None:
            raise ValueError("SimulatedExecutor needs a hardware profile or config.cache.num_blocks")
        sched = self.config.scheduler
        return kv_capacity(
            self.arch,
            self.hardware,
            tp=self.tp,
            dtype=self.dtype,
            kv_dtype=self.kv_dtype,
            block_size=cache.block_size,
            gpu_memory_utilization=self.gpu_memory_utilization,
            max_num_batched_tokens=sched.max_num_batched_tokens,
            max_num_seqs=sched.max_num_seqs,
        ).num_blocks

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Account the plan, advance the clock by the modelled step time, sample where due."""
        known, prompt_len = self._known, self._prompt_len
        for rid in scheduler_output.finished_req_ids:
            known.pop(rid, None)
            prompt_len.pop(rid, None)
        new_reqs = scheduler_output.scheduled_new_reqs
        for new in new_reqs:
            known[new.req_id] = len(new.token_ids)
            prompt_len[new.req_id] = len(new.prompt_token_ids)
        cached = scheduler_output.scheduled_cached_reqs
        # (request, tokens in the cache before the step): running requests, then new ones.
        plan: Iterable[tuple[str, int]] = zip(cached.req_ids, cached.num_computed_tokens, strict=True)
        if new_reqs:
            plan = itertools.chain(plan, ((n.req_id, n.num_computed_tokens) for n in new_reqs))
        num_scheduled = scheduler_output.num_scheduled_tokens
        bs, token = self.config.cache.block_size, self.token_id
        req_ids: list[str] = []
        sampled: list[list[int]] = []
        # StepBatch sums, accumulated inline: this loop runs for every request of every step.
        tokens = num_sampled = prefill = decode = pairs = kv_read = blocks = 0
        try:
            for rid, ctx in plan:
                q = num_scheduled[rid]
                n_known = known[rid]
                req_ids.append(rid)
                tokens += q
                pairs += q * ctx + q * (q + 1) // 2
                kv_read += ctx
                blocks += -(-(ctx + q) // bs)
                if ctx + q >= n_known:
                    known[rid] = n_known + 1
                    sampled.append([token])
                    num_sampled += 1
                    if q == 1 and n_known > prompt_len[rid]:  # decode, as SchedulerOutput counts it
                        decode += 1
                        continue
                else:
                    sampled.append([])
                prefill += q
        except KeyError as e:
            raise KeyError(f"scheduled request {e} is unknown to the simulated runner") from None
        if len(req_ids) != len(num_scheduled):
            raise ValueError("num_scheduled_tokens lists requests that are neither new nor cached")
        batch = StepBatch(
            num_tokens=tokens, num_reqs=len(sampled), num_sampled=num_sampled, num_prefill_tokens=prefill,
            num_decode_tokens=decode, num_decode_reqs=decode, attn_pairs=pairs, kv_tokens_read=kv_read,
            kv_blocks=blocks,
        )  # fmt: skip
        seconds = self.step_model.step_time(batch)
        self._advance(seconds, batch)
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled, forward_time=seconds)

    def clock(self) -> float:
        return self._now

    # ---- simulation -----------------------------------------------------------------
    def advance_to(self, t: float) -> None:
        """Move the virtual clock forward to `t` (idle time); never backwards."""
        self._now = max(self._now, t)

    def _advance(self, seconds: float, batch: StepBatch) -> None:
        self._now += seconds
        self.busy_time += seconds
        self.num_steps += 1
        if self.record_breakdown:
            parts = self.time_by_part
            for name, s in self.step_model.breakdown(batch).items():
                parts[name] = parts.get(name, 0.0) + s

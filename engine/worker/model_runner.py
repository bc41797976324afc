"""Turns a SchedulerOutput into tensors, runs the model, samples.

Contract with the scheduler (see engine/step_io.py):
- a request listed in `finished_req_ids` is forgotten (finished, aborted or
  preempted); a preempted request comes back later as a new request carrying all
  its tokens;
- a request samples this step iff its computed tokens after the step reach every
  token the runner knows for it (its whole prompt, plus each sampled token);
- logits are computed only at the last query row of those requests.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol, cast

import numpy as np
import torch

from engine.attention.backend import AttentionBackend, AttentionMetadata
from engine.hooks import NULL_HOOKS, StepHooks
from engine.sample.sampler import Sampler, SamplingBatch
from engine.step_io import ModelRunnerOutput, SchedulerOutput
from engine.worker.compiled import CompiledForward, ForwardMode
from engine.worker.input_batch import InputBatch


@dataclass
class StepInputs:
    req_ids: list[str]
    rows: np.ndarray  # [R] persistent-batch row per scheduled request
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    metadata: AttentionMetadata
    sample_req_idx: np.ndarray  # [S] index into req_ids of requests that sample
    logits_indices: torch.Tensor  # [S] row of the packed batch whose logits are sampled


class CausalLM(Protocol):
    """What the runner needs of a model (`LlamaForCausalLM`, the MoE variant)."""

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        attn_backend: AttentionBackend,
        kv_caches: list[torch.Tensor],
        block_size: int,
        max_model_len: int,
        max_num_seqs: int,
        device: torch.device,
        enforce_eager: bool = True,
    ) -> None:
        self.model = cast(CausalLM, model)
        self.attn_backend = attn_backend
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        max_blocks = -(-max_model_len // block_size)
        self.batch = InputBatch(max_num_seqs, max_model_len, max_blocks)
        self.sampler = Sampler()
        self.hooks: StepHooks = NULL_HOOKS
        # enforce_eager=False: pure-decode steps run a compiled forward (engine/worker/compiled.py).
        self.compiled: CompiledForward | None = None
        if not enforce_eager:
            self.compiled = CompiledForward(model, attn_backend, kv_caches, max_num_seqs, block_size, device)

    def warm_up(self) -> float:
        """Compile / capture the forward's shapes before serving; seconds taken (0 when eager)."""
        return self.compiled.warm_up() if self.compiled is not None else 0.0

    @property
    def compile_time(self) -> float:
        return self.compiled.compile_time if self.compiled is not None else 0.0

    # ---- state updates -------------------------------------------------------------
    def _update_states(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids:
            self.batch.remove(req_id)
        for new in so.scheduled_new_reqs:
            self.batch.add(
                new.req_id,
                new.token_ids,
                len(new.prompt_token_ids),
                new.sampling_params,
                new.block_ids,
                new.num_computed_tokens,
            )
        cached = so.scheduled_cached_reqs
        for req_id, block_ids, num_computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, strict=True
        ):
            row = self.batch.row_of[req_id]
            self.batch.append_blocks(row, block_ids)
            self.batch.num_computed[row] = num_computed

    # ---- inputs ----------------------------------------------------------------------
    def _prepare_inputs(self, so: SchedulerOutput) -> StepInputs:
        b = self.batch
        req_ids = list(so.num_scheduled_tokens.keys())
        rows = np.fromiter((b.row_of[r] for r in req_ids), dtype=np.int64, count=len(req_ids))
        n = np.fromiter(so.num_scheduled_tokens.values(), dtype=np.int64, count=len(req_ids))
        starts = b.num_computed[rows]
        cu = np.cumsum(n)
        total = int(cu[-1])
        # positions: starts[i] + 0..n[i]-1 for every request, packed back to back
        row_rep = np.repeat(rows, n)
        positions = np.repeat(starts - (cu - n), n) + np.arange(total)
        input_ids = b.token_ids[row_rep, positions]
        slots = b.block_table[row_rep, positions // self.block_size].astype(np.int64) * self.block_size + (
            positions % self.block_size
        )
        seq_lens = starts + n
        samples = seq_lens >= b.num_tokens[rows]
        max_blocks = int(-(-seq_lens.max() // self.block_size))
        qsl = np.zeros(len(req_ids) + 1, dtype=np.int64)
        qsl[1:] = cu
        dev = self.device
        metadata = AttentionMetadata(
            num_reqs=len(req_ids),
            num_tokens=total,
            query_start_loc=torch.from_numpy(qsl.astype(np.int32)).to(dev),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(dev),
            slot_mapping=torch.from_numpy(slots).to(dev),
            block_table=torch.from_numpy(np.ascontiguousarray(b.block_table[rows, :max_blocks])).to(dev),
            max_query_len=int(n.max()),
            max_seq_len=int(seq_lens.max()),
            query_start_loc_cpu=qsl.tolist(),
            seq_lens_cpu=seq_lens.tolist(),
            block_size=self.block_size,
        )
        sample_idx = np.nonzero(samples)[0]
        return StepInputs(
            req_ids=req_ids,
            rows=rows,
            input_ids=torch.from_numpy(input_ids).to(dev),
            positions=torch.from_numpy(positions).to(dev),
            metadata=metadata,
            sample_req_idx=sample_idx,
            logits_indices=torch.from_numpy(cu[sample_idx] - 1).to(dev),
        )

    def _sampling_batch(self, rows: np.ndarray) -> SamplingBatch:
        b = self.batch
        params = [b.params[r] for r in rows]
        batch = SamplingBatch(params=params, generators=[b.generators[r] for r in rows])  # type: ignore[arg-type]
        if batch.needs_penalties:
            batch.prompt_ids = [b.prompt_ids(r) for r in rows]
            batch.output_ids = [b.output_ids(r) for r in rows]
        return batch

    # ---- step ------------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        t0 = time.perf_counter()
        with self.hooks.phase("prepare_inputs"):
            self._update_states(so)
            if so.total_num_scheduled_tokens == 0:
                return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
            inp = self._prepare_inputs(so)
            self.attn_backend.begin_step(inp.metadata)
        t1 = time.perf_counter()
        with self.hooks.phase("forward"):
            hidden, mode = self._forward(inp)
            logits = self.model.compute_logits(hidden[inp.logits_indices])
        t2 = time.perf_counter()
        with self.hooks.phase("sample"):
            sample_rows = inp.rows[inp.sample_req_idx]
            sampled, logprobs = self.sampler.sample(logits, self._sampling_batch(sample_rows))
            out = self._collect(inp, sample_rows, sampled, logprobs)
        t3 = time.perf_counter()
        out.prepare_time, out.forward_time, out.sample_time = t1 - t0, t2 - t1, t3 - t2
        out.compiled, out.padded_tokens = mode.compiled, mode.padded_tokens
        return out

    def _forward(self, inp: StepInputs) -> tuple[torch.Tensor, ForwardMode]:
        """hidden [T' >= T, H] (rows past T are padding) and how the forward ran."""
        if self.compiled is not None:
            return self.compiled(inp.input_ids, inp.positions, inp.metadata)
        hidden = self.model(inp.input_ids, inp.positions, self.kv_caches, inp.metadata)
        return hidden, ForwardMode(False, inp.metadata.num_tokens)

    def _collect(self, inp: StepInputs, sample_rows: np.ndarray, sampled: list[int], logprobs) -> ModelRunnerOutput:
        b = self.batch
        b.num_computed[inp.rows] = inp.metadata.seq_lens_cpu
        per_req: list[list[int]] = [[] for _ in inp.req_ids]
        out_logprobs = {}
        for j, (i, row) in enumerate(zip(inp.sample_req_idx.tolist(), sample_rows.tolist(), strict=True)):
            tok = sampled[j]
            b.append_token(row, tok)
            per_req[i] = [tok]
            if logprobs[j] is not None:
                out_logprobs[inp.req_ids[i]] = [logprobs[j]]
        return ModelRunnerOutput(req_ids=inp.req_ids, sampled_token_ids=per_req, logprobs=out_logprobs)

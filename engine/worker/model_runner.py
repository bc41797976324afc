"""Turns a SchedulerOutput into tensors, runs the model, samples.

Contract with the scheduler (see engine/step_io.py):
- a request listed in `finished_req_ids` is forgotten (finished, aborted or
  preempted); a preempted request comes back later as a new request carrying all
  its tokens;
- a request samples this step iff its computed tokens after the step reach every
  token the runner knows for it (its whole prompt, plus each sampled token);
- logits are computed only at the last query row of those requests.

A step is `prepare_step` (persistent batch, input tensors) then `run_step` (forward,
sample); `execute_model` does both. With async scheduling the executor prepares step
N+1 on the engine's thread while step N runs on its own, so step N+1 may have to
compute a token step N is still sampling (an output placeholder): `prepare_step`
records where that token goes in `input_ids`, and `run_step` copies it from step N's
sampled ids before the forward. `_lock` guards the batch's token columns, which
step N's `_collect` writes while step N+1 is prepared.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, replace
from typing import Protocol, cast

import numpy as np
import torch

from engine.attention.backend import AttentionBackend, AttentionMetadata
from engine.hooks import NULL_HOOKS, StepHooks
from engine.sample.logits_mask import apply_bitmask
from engine.sample.sampler import Sampler, SamplingBatch
from engine.seam import TokenLogprobs
from engine.spec_decode.verify import logits_layout, sample_with_drafts
from engine.step_io import ModelRunnerOutput, SchedulerOutput
from engine.worker.compiled import CompiledForward, ForwardMode
from engine.worker.decode_inputs import MAX_ROWS as LEADING_MAX_ROWS
from engine.worker.decode_inputs import LeadingDecodeInputs
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
    sampling: SamplingBatch  # parameters of the S sampling requests, taken at prepare time
    # Output placeholders: input_ids[fill_dst[k]] = previous step's sampled[fill_src[k]].
    fill_dst: torch.Tensor | None = None  # [P]
    fill_src: torch.Tensor | None = None  # [P]
    prepare_time: float = 0.0
    # Speculative decoding: per sampling request its draft tokens (None: no drafts this
    # step); logits_indices then holds 1 + len(drafts) rows per sampling request.
    drafts: list[list[int]] | None = None
    # Structured output: logits rows [G] to mask and their bitmask rows [G, W] int32.
    grammar_rows: torch.Tensor | None = None
    grammar_bitmask: np.ndarray | None = None


class CausalLM(Protocol):
    """What the runner needs of a model (`LlamaForCausalLM`, the MoE variant)."""

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor: ...


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
        num_kv_cache_groups: int = 1,
    ) -> None:
        """`kv_caches`: one tensor per layer (layers of different KV cache groups may share one);
        `num_kv_cache_groups`: the model's groups (engine/kv_cache_spec.py), each with its own
        block tables and its own attention metadata."""
        if num_kv_cache_groups > 1 and not enforce_eager:
            raise ValueError("model.enforce_eager=false (a compiled forward) with several KV cache groups (a model "
                             "with sliding-window layers) is not supported yet")
        self.model = cast(CausalLM, model)
        self.attn_backend = attn_backend
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        max_blocks = -(-max_model_len // block_size)
        self.batch = InputBatch(max_num_seqs, max_model_len, max_blocks, num_kv_cache_groups - 1)
        self.sampler = Sampler()
        self.hooks: StepHooks = NULL_HOOKS
        # enforce_eager=False: pure-decode steps run a compiled forward (engine/worker/compiled.py).
        self.compiled: CompiledForward | None = None
        if not enforce_eager:
            self.compiled = CompiledForward(model, attn_backend, kv_caches, max_num_seqs, block_size, device)
        self._lock: threading.Lock = threading.Lock()
        # req_id -> tokens sampled by prepared steps but not yet written into the batch.
        self._num_pending: dict[str, int] = {}
        # req_id -> its index in the sampled ids of the last prepared (non-empty) step.
        self._prev_sample_idx: dict[str, int] = {}
        self._last_sampled: list[int] | None = None  # [S] sampled ids of the last step run
        # a CPU decode step of the batch's first rows: inputs in persistent tensors (decode_inputs.py)
        self._leading = (LeadingDecodeInputs(max_num_seqs, max_blocks, block_size)
                         if device.type == "cpu" and num_kv_cache_groups == 1 else None)  # fmt: skip

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
            self._num_pending.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            self.batch.add(
                new.req_id,
                new.token_ids,
                len(new.prompt_token_ids),
                new.sampling_params,
                new.block_ids,
                new.num_computed_tokens,
                new.group_block_ids,
            )
        cached = so.scheduled_cached_reqs
        for req_id, block_ids, num_computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, strict=True
        ):
            row = self.batch.row_of[req_id]
            self.batch.append_blocks(row, block_ids)
            self.batch.num_computed[row] = num_computed
        for req_id, group_ids in zip(cached.req_ids, cached.new_group_block_ids, strict=False):
            row = self.batch.row_of[req_id]
            for g, ids in enumerate(group_ids):
                self.batch.append_group_blocks(row, g, ids)
        for req_id, drafts in so.scheduled_spec_decode_tokens.items():
            # Drafts sit after the known tokens (not counted in num_tokens) so that the
            # packed input_ids pick them up; verified tokens overwrite them in _collect.
            row = self.batch.row_of[req_id]
            n = int(self.batch.num_tokens[row])
            self.batch.token_ids[row, n : n + len(drafts)] = drafts

    # ---- inputs ----------------------------------------------------------------------
    def _prepare_inputs(self, so: SchedulerOutput) -> StepInputs:
        simple = not (self._num_pending or so.scheduled_spec_decode_tokens or so.grammar_bitmask)
        if simple and all(n == 1 for n in so.num_scheduled_tokens.values()):
            return self._prepare_decode(so)
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
        known = b.num_tokens[rows]  # [R] token ids in the batch
        pending = self._num_pending
        if pending:
            known_plus = known + np.fromiter((pending.get(r, 0) for r in req_ids), dtype=np.int64, count=len(req_ids))
            fill_dst, fill_src = self._placeholder_fill(req_ids, n, positions, np.repeat(known, n))
        else:
            known_plus, fill_dst, fill_src = known, None, None
        slots = b.block_table[row_rep, positions // self.block_size].astype(np.int64) * self.block_size + (
            positions % self.block_size
        )
        seq_lens = starts + n
        samples = seq_lens >= known_plus
        qsl = np.zeros(len(req_ids) + 1, dtype=np.int64)
        qsl[1:] = cu
        metadata = self._attention_metadata(rows, qsl, seq_lens, slots, int(n.max()))
        if b.group_tables:
            self._add_group_metadata(metadata, rows, row_rep, positions)
        sample_idx = np.nonzero(samples)[0]
        sample_rows = rows[sample_idx]
        self._prev_sample_idx = {}
        for j, i in enumerate(sample_idx.tolist()):
            rid = req_ids[i]
            pending[rid] = pending.get(rid, 0) + 1
            self._prev_sample_idx[rid] = j
        sampling = SamplingBatch(
            params=[b.params[r] for r in sample_rows],  # type: ignore[misc]
            generators=[b.generators[r] for r in sample_rows],
        )
        sampled_ids = [req_ids[i] for i in sample_idx.tolist()]
        drafts = _drafts_of(sampled_ids, so.scheduled_spec_decode_tokens)
        logits_rows = cu[sample_idx] - 1 if drafts is None else logits_layout(cu, sample_idx, drafts)
        grammar_rows, grammar_bitmask = _grammar_rows(sampled_ids, drafts, so.grammar_bitmask)
        return StepInputs(
            req_ids=req_ids,
            rows=rows,
            input_ids=self._on_device(input_ids),
            positions=self._on_device(positions),
            metadata=metadata,
            sample_req_idx=sample_idx,
            logits_indices=self._on_device(logits_rows),
            sampling=sampling,
            fill_dst=fill_dst,
            fill_src=fill_src,
            drafts=drafts,
            grammar_rows=grammar_rows,
            grammar_bitmask=grammar_bitmask,
        )

    def _on_device(self, a: np.ndarray) -> torch.Tensor:
        """A host array as a tensor on the runner's device (on the CPU, the array's own memory: no
        call to `.to`)."""
        t = torch.from_numpy(a)
        return t if self.device.type == "cpu" else t.to(self.device)

    def _attention_metadata(self, rows: np.ndarray, qsl: np.ndarray, seq_lens: np.ndarray, slots: np.ndarray,
                            max_query_len: int) -> AttentionMetadata:  # fmt: skip
        """The step's attention metadata: requests in persistent-batch `rows`, query starts `qsl`
        [R + 1], context + query lengths `seq_lens` [R], one cache slot per token."""
        bs, max_seq = self.block_size, int(seq_lens.max())
        return AttentionMetadata(
            num_reqs=len(rows),
            num_tokens=int(qsl[-1]),
            query_start_loc=self._on_device(qsl.astype(np.int32)),
            seq_lens=self._on_device(seq_lens.astype(np.int32)),
            slot_mapping=self._on_device(slots),
            block_table=self._on_device(np.ascontiguousarray(self.batch.block_table[rows, : -(-max_seq // bs)])),
            max_query_len=max_query_len,
            max_seq_len=max_seq,
            query_start_loc_cpu=qsl.tolist(),
            seq_lens_cpu=seq_lens.tolist(),
            block_size=bs,
        )

    def _add_group_metadata(self, metadata: AttentionMetadata, rows: np.ndarray, row_rep: np.ndarray,
                            positions: np.ndarray) -> None:  # fmt: skip
        """Each further KV cache group's metadata: its slots for the step's tokens (token k of the
        packed batch is request row `row_rep[k]` at `positions[k]`) and its block tables."""
        bs, nblk = self.block_size, metadata.block_table.shape[1]
        for table in self.batch.group_tables:
            slots = table[row_rep, positions // bs].astype(np.int64) * bs + positions % bs
            metadata.group_metadata.append(replace(
                metadata, slot_mapping=self._on_device(slots), group_metadata=[],
                block_table=self._on_device(np.ascontiguousarray(table[rows, :nblk]))))  # fmt: skip

    def _prepare_decode(self, so: SchedulerOutput) -> StepInputs:
        """`_prepare_inputs` for a step of one token per request, with no tokens of an earlier step
        still to fill in, no drafts and no grammar: each request's token sits at its computed count
        and every query start is its row index. The same inputs, in about half the calls: right
        after a step has streamed its weights each numpy or torch call costs several microseconds
        (benchmarks/cold_after_stream.py), and a batch-1 step's host work is ~20% of it. On the CPU
        a step of the batch's first rows in order, up to decode_inputs.MAX_ROWS of them, takes
        persistent tensors filled element by element instead (engine/worker/decode_inputs.py)."""
        b = self.batch
        req_ids = list(so.num_scheduled_tokens)
        r = len(req_ids)
        row_of = b.row_of
        if self._leading is not None and r <= LEADING_MAX_ROWS and all(row_of[rid] == i for i, rid in enumerate(req_ids)):
            lead = self._leading.prepare(b, r)
            if lead is not None:  # every row samples
                self._num_pending.update(dict.fromkeys(req_ids, 1))  # nothing was pending (the caller's condition)
                self._prev_sample_idx = {rid: i for i, rid in enumerate(req_ids)}
                return StepInputs(req_ids=req_ids, rows=lead.rows, input_ids=lead.input_ids, positions=lead.positions,
                                  metadata=lead.metadata, sample_req_idx=lead.sample_idx,
                                  logits_indices=lead.logits_indices,
                                  sampling=SamplingBatch(params=[b.params[i] for i in range(r)],  # type: ignore[misc]
                                                         generators=[b.generators[i] for i in range(r)]))  # fmt: skip
        rows = np.fromiter((row_of[rid] for rid in req_ids), dtype=np.int64, count=r)
        positions = b.num_computed[rows]
        bs = self.block_size
        slots = b.block_table[rows, positions // bs].astype(np.int64) * bs + positions % bs
        seq_lens = positions + 1
        metadata = self._attention_metadata(rows, np.arange(r + 1, dtype=np.int64), seq_lens, slots, 1)
        if b.group_tables:
            self._add_group_metadata(metadata, rows, rows, positions)
        sample_idx = np.nonzero(seq_lens >= b.num_tokens[rows])[0]
        sample_rows = rows[sample_idx].tolist()
        pending, prev = self._num_pending, {}
        for j, i in enumerate(sample_idx.tolist()):
            pending[req_ids[i]] = 1  # nothing was pending (the caller's condition)
            prev[req_ids[i]] = j
        self._prev_sample_idx = prev
        return StepInputs(
            req_ids=req_ids,
            rows=rows,
            input_ids=self._on_device(b.token_ids[rows, positions]),
            positions=self._on_device(positions),
            metadata=metadata,
            sample_req_idx=sample_idx,
            logits_indices=self._on_device(sample_idx),
            sampling=SamplingBatch(params=[b.params[row] for row in sample_rows],  # type: ignore[misc]
                                   generators=[b.generators[row] for row in sample_rows]),
        )

    def _placeholder_fill(
        self, req_ids: list[str], n: np.ndarray, positions: np.ndarray, known_rep: np.ndarray
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Packed rows whose token is an output placeholder, and where the previous step
        sampled it. Steps before the previous one have written their tokens (the engine
        waits for step N-1 before it prepares step N+1), so only the previous step's remain."""
        dst = np.nonzero(positions >= known_rep)[0]  # [P]
        if len(dst) == 0:
            return None, None
        req_of_row = np.repeat(np.arange(len(req_ids)), n)
        try:
            src = [self._prev_sample_idx[req_ids[i]] for i in req_of_row[dst].tolist()]
        except KeyError as exc:
            raise RuntimeError(f"request {exc.args[0]} needs a token no step in flight samples") from None
        return torch.from_numpy(dst).to(self.device), torch.tensor(src, dtype=torch.int64, device=self.device)

    def _add_penalty_ids(self, inp: StepInputs, sample_rows: np.ndarray) -> None:
        """Penalties read the outputs so far, the previous step's included (written by
        its `_collect`, on this thread); a row reused since belongs to a request whose
        token is discarded, so its ids do not matter."""
        b, batch = self.batch, inp.sampling
        with self._lock:
            batch.prompt_ids = [b.prompt_ids(r) for r in sample_rows]
            batch.output_ids = [b.output_ids(r) for r in sample_rows]

    # ---- step ------------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        inp = self.prepare_step(so)
        if inp is None:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        return self.run_step(inp)

    @torch.inference_mode()  # the step's tensors are inference tensors on any thread (dynamo guards on it)
    def prepare_step(self, so: SchedulerOutput) -> StepInputs | None:
        """Apply the SchedulerOutput to the persistent batch and build the step's inputs
        (None: nothing scheduled). Must be called in step order, each followed by its
        `run_step` before the next step's `run_step`."""
        t0 = time.perf_counter()
        with self.hooks.phase("prepare_inputs"), self._lock:
            self._update_states(so)
            if so.total_num_scheduled_tokens == 0:
                return None
            inp = self._prepare_inputs(so)
        inp.prepare_time = time.perf_counter() - t0
        return inp

    @torch.inference_mode()
    def run_step(self, inp: StepInputs) -> ModelRunnerOutput:
        """Forward and sample a prepared step (on the executor's thread with async scheduling)."""
        t1 = time.perf_counter()
        if inp.fill_dst is not None:
            assert self._last_sampled is not None
            inp.input_ids[inp.fill_dst] = torch.tensor(self._last_sampled, dtype=torch.int64, device=self.device)[inp.fill_src]
        self.attn_backend.begin_step(inp.metadata)
        with self.hooks.phase("forward"):
            # Greedy-only steps need each row's argmax only: the LM head's fused argmax where the
            # model has one (no logits stored), else the logits in the model's dtype (the C++
            # argmax reads bfloat16 directly). The sampler upcasts only what needs it (its
            # weights, penalties, logprobs), so no step stores a float32 copy of the logits.
            argmax_only = inp.sampling.argmax_only and inp.drafts is None and inp.grammar_rows is None
            # a step whose every row samples (a decode step) reads hidden's first rows as a view, not a gather
            n_logits = inp.logits_indices.shape[0]
            all_rows = inp.drafts is None and n_logits == inp.input_ids.shape[0]
            # ... and a greedy one of those may take the forward and the head's argmax in one call
            greedy_ids = self._greedy_decode(inp) if argmax_only and all_rows else None
            if greedy_ids is not None:
                mode = ForwardMode(False, inp.metadata.num_tokens)
                logits = None
            else:
                hidden, mode = self._forward(inp)
                if all_rows:  # hidden itself where it has no padding rows (a slice is one more op)
                    rows = hidden if hidden.shape[0] == n_logits else hidden[:n_logits]
                else:
                    rows = hidden[inp.logits_indices]
                fused_argmax = getattr(self.model, "greedy_ids", None) if argmax_only else None
                greedy_ids = fused_argmax(rows) if fused_argmax is not None else None
                logits = None if greedy_ids is not None else self.model.compute_logits(rows, upcast=False)
            if logits is not None and inp.grammar_rows is not None and inp.grammar_bitmask is not None:
                logits = apply_bitmask(logits, inp.grammar_rows, inp.grammar_bitmask)
        t2 = time.perf_counter()
        with self.hooks.phase("sample"):
            sample_rows = inp.rows[inp.sample_req_idx]
            if inp.sampling.needs_penalties:
                self._add_penalty_ids(inp, sample_rows)
            if greedy_ids is not None:
                ids = greedy_ids.tolist()
                sampled = [[t] for t in ids]
                logprobs: list[TokenLogprobs | None] = [None] * len(ids)
            elif inp.drafts is None:
                assert logits is not None
                ids, logprobs = self.sampler.sample(logits, inp.sampling)
                sampled = [[t] for t in ids]
            else:
                assert logits is not None
                sampled, logprobs = sample_with_drafts(self.sampler, logits, inp.sampling, inp.drafts)
            self._last_sampled = [t[-1] for t in sampled]  # a tensor only where a step fills placeholders
            out = self._collect(inp, sample_rows, sampled, logprobs)
        t3 = time.perf_counter()
        out.prepare_time, out.forward_time, out.sample_time = inp.prepare_time, t2 - t1, t3 - t2
        out.compiled, out.padded_tokens = mode.compiled, mode.padded_tokens
        return out

    def _greedy_decode(self, inp: StepInputs) -> torch.Tensor | None:
        """A greedy decode step's token ids from the model's one-call path (`greedy_decode`:
        the forward and the LM head's argmax together), or None (the caller runs them apart).
        Eager only: a compiled forward runs its own graph."""
        fused = getattr(self.model, "greedy_decode", None) if self.compiled is None else None
        return fused(inp.input_ids, inp.positions, self.kv_caches, inp.metadata) if fused is not None else None

    def _forward(self, inp: StepInputs) -> tuple[torch.Tensor, ForwardMode]:
        """hidden [T' >= T, H] (rows past T are padding) and how the forward ran."""
        if self.compiled is not None:
            return self.compiled(inp.input_ids, inp.positions, inp.metadata)
        hidden = self.model(inp.input_ids, inp.positions, self.kv_caches, inp.metadata)
        return hidden, ForwardMode(False, inp.metadata.num_tokens)

    def _collect(
        self, inp: StepInputs, sample_rows: np.ndarray, sampled: list[list[int]], logprobs
    ) -> ModelRunnerOutput:
        """Write the sampled tokens into the batch, for rows still owned by their request
        (with async scheduling a request may have finished and its row been reused)."""
        b, pending, row_of = self.batch, self._num_pending, self.batch.row_of
        per_req: list[list[int]] = [[] for _ in inp.req_ids]
        out_logprobs = {}
        with self._lock:
            for j, (i, row) in enumerate(zip(inp.sample_req_idx.tolist(), sample_rows.tolist(), strict=True)):
                rid = inp.req_ids[i]
                if row_of.get(rid) != row:
                    continue  # finished or preempted meanwhile: its token is discarded
                for tok in sampled[j]:
                    b.append_token(row, tok)
                left = pending.get(rid, 1) - 1
                if left > 0:
                    pending[rid] = left
                else:
                    pending.pop(rid, None)
        for j, i in enumerate(inp.sample_req_idx.tolist()):
            per_req[i] = sampled[j]
            if logprobs[j] is not None:
                out_logprobs[inp.req_ids[i]] = [logprobs[j]]
        return ModelRunnerOutput(req_ids=inp.req_ids, sampled_token_ids=per_req, logprobs=out_logprobs)


def _drafts_of(sampled_ids: list[str], spec: dict[str, list[int]]) -> list[list[int]] | None:
    """Per sampling request its draft tokens, or None when no request has any this step."""
    if not spec:
        return None
    return [spec.get(rid, []) for rid in sampled_ids]


def _grammar_rows(
    sampled_ids: list[str], drafts: list[list[int]] | None, bitmask: dict[str, np.ndarray] | None
) -> tuple[torch.Tensor | None, np.ndarray | None]:
    """Logits rows of the constrained sampling requests (each has one: never drafts) and
    their bitmask rows."""
    if not bitmask:
        return None, None
    rows, masks = [], []
    offset = 0
    for j, rid in enumerate(sampled_ids):
        last = offset + (len(drafts[j]) if drafts is not None else 0)
        if rid in bitmask:
            rows.append(last)
            masks.append(bitmask[rid])
        offset = last + 1
    if not rows:
        return None, None
    return torch.tensor(rows, dtype=torch.int64), np.stack(masks)

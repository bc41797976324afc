"""Sampling from logits: penalties, temperature, top-k / top-p / min-p, seeds, logprobs.

The runner builds a `SamplingBatch` (one row per request that samples this step)
and calls `Sampler.sample`. All-greedy batches take the argmax fast path. The others draw
by inverse CDF, one uniform per draw (engine/sample/inverse_cdf.py): a top-k row (k <=
`top_k.MAX_K`) among its k x 64 candidates, top-p and min-p applied there
(engine/sample/top_k.py), any other row from weights over the vocabulary, processed without
sorting it (engine/sample/row_weights.py). At 16 rows x 49,152 tokens the exponential race
this replaced drew 786,432 exponentials a step.
Logprobs are those of the raw model distribution (log-softmax of the logits before
penalties and temperature), as vLLM reports them by default.

Devices: every tensor built from host data (temperatures, penalty token ids) is made on
the logits' device. A seeded request's generator may live on another device than the
logits (the runner keeps CPU generators): its uniforms are drawn where the generator lives
and copied over, so a seed gives the same draws whatever device samples. What a seeded row
draws depends on its own logits and generator only, whatever the batch: a top-k row takes
one uniform a step (with or without top-p; before 2026-12-04 a top-k + top-p row took
`row_weights.CANDIDATES`, so its seeds now give other tokens), plus a full-vocabulary draw
in the rare step whose ties at the k-th value reach past the candidates; a row without
top-k takes 1, or `row_weights.CANDIDATES` with top-p, more when none fell in the nucleus.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from engine.kernels.cpu_kernels import kernels
from engine.sample.inverse_cdf import Workspace
from engine.sample.row_weights import RowWeights
from engine.sample.top_k import TopKCandidates, takes_top_k_path
from engine.sampling_params import SamplingParams
from engine.seam import TokenLogprobs


@dataclass
class SamplingBatch:
    params: list[SamplingParams]
    # Per row: the generator for seeded requests (None: the global one).
    generators: list[torch.Generator | None]
    # Per row: token ids seen so far (prompt + output) and output ids, for penalties.
    prompt_ids: list[list[int]] | None = None
    output_ids: list[list[int]] | None = None

    # Each is asked once or twice a step and the rows' parameters never change once the batch is
    # made: computed once (right after a step's weights have streamed every one costs microseconds).
    @cached_property
    def all_greedy(self) -> bool:
        return all(p.greedy for p in self.params)

    @cached_property
    def argmax_only(self) -> bool:
        """Every row greedy, no penalties, no logprobs: sampling needs only each row's argmax."""
        return self.all_greedy and not self.needs_penalties and self.max_logprobs is None

    @cached_property
    def needs_penalties(self) -> bool:
        return any(
            p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
            for p in self.params
        )

    @cached_property
    def max_logprobs(self) -> int | None:
        ks = [p.logprobs for p in self.params if p.logprobs is not None]
        return max(ks) if ks else None


class Sampler:
    def __init__(self) -> None:
        self.workspace = Workspace()  # the weights buffers, reused step after step

    def sample(
        self, logits: torch.Tensor, batch: SamplingBatch
    ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """logits: [N, V], float32 or the model's dtype (bfloat16 logits are upcast only where
        a step needs it: penalties, logprobs) -> (sampled id per row, logprobs per row or None).

        One device -> host transfer a step (the ids, with the rare top-p rows to finish)."""
        raw = logits
        if batch.needs_penalties:
            logits = apply_penalties(logits.to(torch.float32, copy=True), batch)
        if batch.all_greedy:
            sampled = greedy(logits)
            ids = sampled.tolist()  # the step's one device -> host sync
        else:
            sampled, ids = self._sample_random(logits, batch)
        return ids, self._logprobs(raw, sampled, ids, batch)

    def _sample_random(self, logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, list[int]]:
        """Greedy rows take their argmax; top-k rows draw among their candidates
        (engine/sample/top_k.py); the others by inverse CDF over the vocabulary
        (engine/sample/row_weights.py). -> ([N] int64 on logits' device, the same as a list)."""
        params, gens, device = batch.params, batch.generators, logits.device
        n = len(params)
        top_k_rows: list[int] = []
        vocab_rows: list[int] = []
        for i, p in enumerate(params):
            if takes_top_k_path(p):
                top_k_rows.append(i)
            elif not p.greedy:
                vocab_rows.append(i)
        if any(p.greedy for p in params):
            sampled = greedy(logits)
        else:
            sampled = torch.zeros(n, dtype=torch.int64, device=device)
        # Per row: 1 = a top-p draw outside the nucleus, 2 = a top-k tie past the candidates.
        late = torch.zeros(n, dtype=torch.int64, device=device)
        if top_k_rows:
            ix = torch.tensor(top_k_rows, device=device)
            cands = TopKCandidates(_rows(logits, top_k_rows), [params[i] for i in top_k_rows], self.workspace)
            ids_k, overflow = cands.draw([gens[i] for i in top_k_rows])
            sampled.index_copy_(0, ix, ids_k)
            late.index_copy_(0, ix, overflow.to(torch.int64) * 2)
        weights = None
        if vocab_rows:
            ix = torch.tensor(vocab_rows, device=device)
            weights = RowWeights(_rows(logits, vocab_rows), [params[i] for i in vocab_rows], self.workspace)
            ids_v, unresolved = weights.draw([gens[i] for i in vocab_rows])
            sampled.index_copy_(0, ix, ids_v)
            if unresolved is not None:
                late.index_copy_(0, ix, unresolved.to(torch.int64))
        ids, flags = torch.stack([sampled, late]).tolist()  # the step's one device -> host sync
        if not any(flags):
            return sampled, ids
        vocab_position = {row: j for j, row in enumerate(vocab_rows)}
        tied = [i for i, flag in enumerate(flags) if flag == 2]
        for i, flag in enumerate(flags):
            if flag == 1:  # a top-p row none of whose draws fell in the nucleus (rare)
                assert weights is not None
                ids[i] = weights.resolve_nucleus(vocab_position[i], gens[i])
        if tied:  # ties at the k-th value reach past the candidates (rare): those rows in one pass
            redrawn = self._sample_vocab(_rows(logits, tied), [params[i] for i in tied], [gens[i] for i in tied])
            for i, token in zip(tied, redrawn, strict=True):
                ids[i] = token
        return torch.tensor(ids, dtype=torch.int64, device=device), ids

    def _sample_vocab(
        self, rows: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
    ) -> list[int]:
        """Rows [M, V] sampled over their whole vocabulary, all in one pass (each seeded row from
        its own generator, as alone). Their own buffers: the step's full-vocabulary weights, in the
        shared workspace, may still have rows to resolve."""
        weights = RowWeights(rows, params, Workspace())
        sampled, unresolved = weights.draw(generators)
        ids = sampled.tolist()
        if unresolved is not None:
            for j in torch.nonzero(unresolved).flatten().tolist():
                ids[j] = weights.resolve_nucleus(j, generators[j])
        return ids

    @staticmethod
    def _logprobs(
        raw: torch.Tensor, sampled: torch.Tensor, ids: list[int], batch: SamplingBatch
    ) -> list[TokenLogprobs | None]:
        k = batch.max_logprobs
        if k is None:
            return [None] * len(batch.params)
        logp = torch.log_softmax(raw.float(), dim=-1)
        chosen = logp.gather(1, sampled[:, None]).squeeze(1).tolist()
        top_vals, top_ids = logp.topk(max(k, 1), dim=-1)
        top_vals_l, top_ids_l = top_vals.tolist(), top_ids.tolist()
        out: list[TokenLogprobs | None] = []
        for i, p in enumerate(batch.params):
            if p.logprobs is None:
                out.append(None)
                continue
            tops = list(zip(top_ids_l[i][: p.logprobs], top_vals_l[i][: p.logprobs], strict=True))
            out.append((ids[i], chosen[i], tops))
        return out


def _rows(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """logits [N, V] -> [len(rows), V]: the tensor itself when `rows` is every row in order."""
    if rows == list(range(logits.shape[0])):
        return logits
    return logits[torch.tensor(rows, device=logits.device)]


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """[N, V] -> [N] int64: the first index of each row's maximum, as `argmax`.

    On a CPU the C++ `argmax_rows` (engine/kernels/cpu_kernels.py; the same index, NaN included)
    reads float32 or bfloat16 logits in place: 64 x 49,152 bfloat16 in 0.23 ms on 2 threads,
    where converting them to float32 and `max(dim).indices` took 2.1 ms. Elsewhere
    `max(dim).indices` (the first maximum, documented; 2.5x `argmax` on a CPU).
    """
    if logits.device.type == "cpu" and logits.dim() == 2 and logits.is_contiguous() and logits.shape[1] > 0:
        ops = kernels() if logits.dtype in (torch.float32, torch.bfloat16) else None
        if ops is not None:
            return ops.argmax_rows(logits)
    return logits.max(dim=-1).indices


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Repetition (prompt + output, HF/vLLM style), presence and frequency (output only) penalties.

    Modifies and returns `logits` [N, V]; the token-id tensors are built on its device.
    """
    assert batch.prompt_ids is not None and batch.output_ids is not None
    vocab, device = logits.shape[1], logits.device
    for i, p in enumerate(batch.params):
        out_ids = torch.tensor(batch.output_ids[i], dtype=torch.long, device=device)
        out_ids = out_ids[(out_ids >= 0) & (out_ids < vocab)]
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(batch.prompt_ids[i] + batch.output_ids[i], dtype=torch.long, device=device)
            seen = seen.unique()
            seen = seen[(seen >= 0) & (seen < vocab)]
            row = logits[i, seen]
            logits[i, seen] = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and out_ids.numel():
            counts = torch.bincount(out_ids, minlength=vocab).to(logits.dtype)
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def apply_top_k_top_p_min_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Mask logits outside each row's top-k, nucleus (top-p) and min-p sets with -inf."""
    neg_inf = float("-inf")
    if any(p.top_k > 0 for p in params):
        vocab = logits.shape[1]
        ks = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=logits.device)
        ks = ks.clamp(max=vocab)
        sorted_desc = logits.sort(dim=-1, descending=True).values
        kth = sorted_desc.gather(1, (ks - 1)[:, None])
        logits = logits.masked_fill(logits < kth, neg_inf)
    if any(p.top_p < 1.0 for p in params):
        top_p = torch.tensor([p.top_p for p in params], device=logits.device, dtype=logits.dtype)
        sorted_logits, order = logits.sort(dim=-1, descending=False)
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= (1.0 - top_p)[:, None]
        drop[:, -1] = False  # always keep the most likely token
        logits = logits.masked_fill(drop.scatter(1, order, drop), neg_inf)
    if any(p.min_p > 0.0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], device=logits.device, dtype=logits.dtype)
        probs = logits.softmax(dim=-1)
        thresh = probs.max(dim=-1, keepdim=True).values * min_p[:, None]
        logits = logits.masked_fill(probs < thresh, neg_inf)
    return logits

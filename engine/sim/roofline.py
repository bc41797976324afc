"""Roofline step-time model: each part of a step is bound by compute or by memory.

Per tensor-parallel rank, for one step (sums from `StepBatch`, T = tokens, S = sampling
requests, L = layers, tp = tensor-parallel size, w/kv/a = weight/KV/activation bytes):

- linear:    FLOPs = 2 * T * L * (attn + mlp) / tp, dense model;
             MoE:   2 * T * L * (attn/tp + k * expert/tp + router)   (k = experts per token)
             bytes = L * (attn + mlp) / tp * w; MoE: experts touched E' = min(E, T * k):
                     L * (attn/tp + E' * expert/tp + router) * w      (weights read once a step)
- attention: FLOPs = 4 * L * heads/tp * head_dim * attn_pairs        (QK^T and PV)
             bytes = 2 * L * kv_heads_rank * head_dim * kv * (ctx read + q written)
- lm_head:   FLOPs = 2 * S * hidden * vocab / tp; bytes = hidden * vocab / tp * w (0 if S = 0)
- allreduce: 2 per layer, ring: 2 * L * (2 * (tp-1)/tp * T * hidden * a / comm_bw + latency)
- all_to_all (expert parallel, `ep`): MoE dispatch + combine per layer, each rank sending its
             T/tp tokens' k hidden states, (tp-1)/tp of them to other ranks, and getting them back:
             2 * L * (T/tp * k * (tp-1)/tp * hidden * a / comm_bw + latency); the expert weights
             a rank reads are min(E/tp, max(1, T*k/tp)) whole experts instead of min(E, T*k)
             slices of 1/tp (engine/distributed: EP keeps the all-reduce after the MoE block)
- overhead:  hw.step_overhead_s

Each compute part costs max(FLOPs / achievable FLOP/s, bytes / achievable bandwidth); the
step costs the sum of the parts. kv_heads_rank = ceil(kv_heads / tp) (KV heads are
replicated when tp exceeds them). Activations are bf16 when weights are fp8.
"""

from __future__ import annotations

from typing import NamedTuple

from engine.dtypes import DTYPE_BYTES, canonical_dtype
from engine.model.arch import ModelArch
from engine.sim.hardware import HardwareProfile
from engine.sim.model_counts import ParamCounts
from engine.sim.step_batch import StepBatch


class PartCost(NamedTuple):
    flops: float
    bytes: float
    seconds: float


class RooflineStepModel:
    """Analytic step time of `arch` on `tp` devices of `hw` (see the module docstring)."""

    def __init__(
        self,
        arch: ModelArch,
        hw: HardwareProfile,
        tp: int = 1,
        dtype: str = "bf16",
        kv_dtype: str | None = None,
        ep: bool = False,
    ) -> None:
        if ep and not arch.is_moe:
            raise ValueError(f"ep: model {arch.name!r} has no experts")
        if tp < 1 or arch.num_heads % tp:
            raise ValueError(f"tp={tp} must be >= 1 and divide num_heads={arch.num_heads}")
        if tp > hw.num_devices:
            raise ValueError(f"tp={tp} exceeds the {hw.num_devices} devices of {hw.name!r}")
        if tp > 1 and hw.comm_bw <= 0:
            raise ValueError(f"hardware {hw.name!r} has no interconnect bandwidth for tp={tp}")
        self.arch, self.hw, self.tp = arch, hw, tp
        self.ep = ep and tp > 1
        self.dtype = canonical_dtype(dtype)
        self.kv_dtype = canonical_dtype(kv_dtype or dtype)
        self._flops_per_s = hw.flops(self.dtype)
        self._bw = hw.mem_bw
        w = DTYPE_BYTES[self.dtype]
        self.act_bytes = 2 if self.dtype == "fp8" else w
        L = arch.num_layers
        # Linear layers, per rank: weights per layer (dense) or split into parts (MoE).
        counts = ParamCounts.of(arch)
        self._attn_w = counts.attn / tp
        self._expert_w = counts.mlp / tp
        self._router_w = counts.router
        dense_mlp = 0.0 if arch.is_moe else self._expert_w
        self._dense_w = self._attn_w + dense_mlp + self._router_w
        self._L, self._w = L, w
        # Attention, per rank.
        self.kv_heads_rank = -(-arch.num_kv_heads // tp)
        self._attn_flops_per_pair = 4 * L * (arch.num_heads // tp) * arch.head_dim
        self._kv_bytes_per_token = 2 * L * self.kv_heads_rank * arch.head_dim * DTYPE_BYTES[self.kv_dtype]
        # LM head, per rank.
        self._lm_w = arch.hidden_size * arch.vocab_size / tp

    # ---- parts ----------------------------------------------------------------------
    def _roof(self, flops: float, nbytes: float) -> PartCost:
        return PartCost(flops, nbytes, max(flops / self._flops_per_s, nbytes / self._bw))

    def linear(self, batch: StepBatch) -> PartCost:
        T, L, s = batch.num_tokens, self._L, self.arch
        if not s.is_moe:
            return self._roof(2 * T * L * self._dense_w, L * self._dense_w * self._w)
        k = s.num_experts_per_tok
        flops = 2 * T * L * (self._attn_w + k * self._expert_w + self._router_w)
        nbytes = L * (self._attn_w + self._experts_read(T) + self._router_w) * self._w
        return self._roof(flops, nbytes)

    def _experts_read(self, T: int) -> float:
        """Expert weights (elements) one rank reads for T tokens, per layer."""
        s, k = self.arch, self.arch.num_experts_per_tok
        if self.ep:  # whole experts, E / tp of them on this rank
            return min(s.num_experts / self.tp, max(1.0, T * k / self.tp)) * self._expert_w * self.tp
        return min(s.num_experts, T * k) * self._expert_w

    def all_to_all(self, batch: StepBatch) -> PartCost:
        if not self.ep:
            return PartCost(0.0, 0.0, 0.0)
        tp, k = self.tp, self.arch.num_experts_per_tok
        moved = 2 * batch.num_tokens / tp * k * (tp - 1) / tp * self.arch.hidden_size * self.act_bytes
        return PartCost(0.0, self._L * moved, self._L * (moved / self.hw.comm_bw + 2 * self.hw.allreduce_latency_s))

    def attention(self, batch: StepBatch) -> PartCost:
        flops = self._attn_flops_per_pair * batch.attn_pairs
        nbytes = self._kv_bytes_per_token * (batch.kv_tokens_read + batch.num_tokens)
        return self._roof(flops, nbytes)

    def lm_head(self, batch: StepBatch) -> PartCost:
        S = batch.num_sampled
        return self._roof(2 * S * self._lm_w, self._lm_w * self._w if S else 0.0)

    def allreduce(self, batch: StepBatch) -> PartCost:
        if self.tp == 1:
            return PartCost(0.0, 0.0, 0.0)
        moved = 2 * (self.tp - 1) / self.tp * batch.num_tokens * self.arch.hidden_size * self.act_bytes
        n = 2 * self._L
        return PartCost(0.0, n * moved, n * (moved / self.hw.comm_bw + self.hw.allreduce_latency_s))

    def parts(self, batch: StepBatch) -> dict[str, PartCost]:
        """Every part's FLOPs, bytes (per rank) and seconds; empty batch: no parts."""
        if batch.num_tokens == 0:
            return {}
        overhead = PartCost(0.0, 0.0, self.hw.step_overhead_s)
        return {
            "linear": self.linear(batch),
            "attention": self.attention(batch),
            "lm_head": self.lm_head(batch),
            "allreduce": self.allreduce(batch),
            **({"all_to_all": self.all_to_all(batch)} if self.ep else {}),
            "overhead": overhead,
        }

    # ---- StepModel --------------------------------------------------------------------
    def breakdown(self, batch: StepBatch) -> dict[str, float]:
        return {name: part.seconds for name, part in self.parts(batch).items()}

    def step_time(self, batch: StepBatch) -> float:
        """Same number as sum(breakdown(batch).values()), without building the parts (hot path)."""
        T = batch.num_tokens
        if T == 0:
            return 0.0
        fps, bw, L, w = self._flops_per_s, self._bw, self._L, self._w
        arch = self.arch
        if arch.is_moe:
            k = arch.num_experts_per_tok
            lin_flops = 2 * T * L * (self._attn_w + k * self._expert_w + self._router_w)
            lin_bytes = L * (self._attn_w + self._experts_read(T) + self._router_w) * w
        else:
            lin_flops, lin_bytes = 2 * T * L * self._dense_w, L * self._dense_w * w
        S = batch.num_sampled
        seconds = (
            max(lin_flops / fps, lin_bytes / bw)
            + max(self._attn_flops_per_pair * batch.attn_pairs / fps,
                  self._kv_bytes_per_token * (batch.kv_tokens_read + T) / bw)
            + (max(2 * S * self._lm_w / fps, self._lm_w * w / bw) if S else 0.0)
            + self.hw.step_overhead_s
        )  # fmt: skip
        if self.tp > 1:
            moved = 2 * (self.tp - 1) / self.tp * T * arch.hidden_size * self.act_bytes
            seconds += 2 * L * (moved / self.hw.comm_bw + self.hw.allreduce_latency_s)
        if self.ep:
            seconds += self.all_to_all(batch).seconds
        return seconds

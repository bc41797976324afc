"""Building blocks of the Llama family: RMSNorm, rotary embedding, SwiGLU MLP.

Performance notes (CPU decode is bound by per-op overhead as much as by bandwidth):
RMSNorm fuses the residual add; the rotary cos/sin table is built once and gathered
once per forward (not per layer); rotate-half RoPE is 4 ops with a signed sin table;
the MLP's gate and up projections are one fused GEMM. Float32 and bfloat16 CPU tensors use
the fused C++ kernels of `cpu_kernels` (residual-add + RMSNorm in place, in-place RoPE, SiLU(gate) * up;
`torch.ops.servelab.*`), computed in float32 and rounded once per output.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels.cpu_kernels import kernels
from engine.model.rope_scaling import RopeScaling

_FUSED_DTYPES = (torch.float32, torch.bfloat16)


def fused_ops(*ts: torch.Tensor) -> Any | None:
    """The fused C++ ops where they apply (contiguous CPU tensors of one dtype, float32 or
    bfloat16, no autograd), else None."""
    dtype = ts[0].dtype
    # Under torch.compile the torch-op fallbacks are traced instead: inductor fuses them itself.
    if torch.is_grad_enabled() or torch.compiler.is_compiling() or dtype not in _FUSED_DTYPES or not all(
        t.device.type == "cpu" and t.dtype == dtype and t.is_contiguous() for t in ts
    ):
        return None
    return kernels()


class RMSNorm(nn.Module):
    """y = x / rms(x) * weight, with an optional fused residual add.

    `forward(x)` -> normed; `forward(x, residual)` -> (normed(x + residual), x + residual).
    Low-precision inputs are normalised in float32 (as HF Llama does).
    """

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.shape = (hidden_size,)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        fused = fused_ops(x, self.weight) if residual is None else None
        if fused is not None:
            return fused.rms_norm(x, self.weight, self.eps)
        if residual is not None:
            x = x + residual
            residual = x
        if x.dtype == torch.float32:
            out = F.rms_norm(x, self.shape, self.weight, self.eps)
        else:
            out = F.rms_norm(x.float(), self.shape, None, self.eps).to(x.dtype) * self.weight
        return out if residual is None else (out, residual)

    def add_norm_(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """In place: residual += x, x = norm(residual); returns (x, residual). Both are overwritten."""
        fused = fused_ops(x, residual, self.weight) if x.shape == residual.shape else None
        if fused is not None:
            fused.add_rms_norm_(x, residual, self.weight, self.eps)
            return x, residual
        out, res = self.forward(x, residual)  # type: ignore[misc]
        return out, res


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE (HF Llama convention) with a cos/sin table built once.

    `cos_sin(positions)` gathers the table for one forward; `rotate(x, cos, sin)` rotates
    x: [T, heads, head_dim] with cos, sin: [T, 1, head_dim].
    """

    cos_table: torch.Tensor
    sin_table: torch.Tensor

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: RopeScaling | None = None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.theta = theta
        self.scaling = scaling  # Llama-3.1's long-context frequency scaling (engine/model/rope_scaling.py)
        self.register_buffer("cos_table", torch.empty(0), persistent=False)
        self.register_buffer("sin_table", torch.empty(0), persistent=False)
        if self.cos_table.device.type != "meta":  # built on meta: the loader rebuilds after to_empty (a
            self.rebuild()  # meta arange would cost ~1.3 s of torch's lazy imports per process)

    def rebuild(self, device: torch.device | None = None, dtype: torch.dtype | None = None) -> None:
        """(Re)compute the tables in float32, then cast (call after `to_empty`)."""
        device = device or self.cos_table.device
        dtype = dtype or (self.cos_table.dtype if self.cos_table.is_floating_point() else torch.float32)
        half = self.head_dim // 2
        exponents = torch.arange(0, half, dtype=torch.float32, device=device) * 2 / self.head_dim
        inv_freq = 1.0 / (self.theta**exponents)  # [D/2]
        if self.scaling is not None:
            inv_freq = self.scaling.scale(inv_freq)
        pos = torch.arange(self.max_positions, dtype=torch.float32, device=device)
        angles = torch.outer(pos, inv_freq)  # [P, D/2]
        cos, sin = angles.cos(), angles.sin()
        self.cos_table = torch.cat((cos, cos), dim=-1).to(dtype)  # [P, D]
        # Signed so that rotate_half(x) * sin == swap_halves(x) * sin_table.
        self.sin_table = torch.cat((-sin, sin), dim=-1).to(dtype)  # [P, D]

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] int64 -> cos, sin: [T, 1, D]."""
        return self.cos_table[positions].unsqueeze(1), self.sin_table[positions].unsqueeze(1)

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [T, H, D] (any strides) -> rotated, contiguous [T, H, D]."""
        half = x.shape[-1] // 2
        swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)  # [x2, x1]
        return x * cos + swapped * sin

    @staticmethod
    def rotate_heads_(qkv: torch.Tensor, heads: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate the first `heads` heads of qkv [T, H, D] in place; returns qkv (cos, sin: [T, 1, D])."""
        fused = fused_ops(qkv, cos, sin)
        if fused is not None:
            fused.rope_(qkv, cos, sin, heads)
        else:
            qkv[:, :heads] = RotaryEmbedding.rotate(qkv[:, :heads], cos, sin)
        return qkv


def norm_heads_(qkv: torch.Tensor, first: int, count: int, norm: nn.Module) -> None:
    """RMS-norm heads first .. first + count - 1 of qkv [T, heads, D] in place, each over its D values
    (`norm`: a head_dim norm module, Llama's RMSNorm or Gemma's: Qwen3's and Gemma 3's QK-norm)."""
    heads = qkv[:, first : first + count]  # [T, count, D], a strided view
    normed = norm(heads.reshape(-1, heads.shape[-1]))  # [T * count, D], contiguous (the fused kernel's rows)
    assert isinstance(normed, torch.Tensor)  # (no residual: one tensor)
    heads.copy_(normed.view(heads.shape))


class GatedMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)) with gate and up fused in one Linear.

    Weight `gate_up_proj.weight`: [2 * intermediate, hidden], gate rows first.
    """

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [T, 2I]
        fused = fused_ops(gate_up)
        if fused is not None:  # one pass, float32 inside, rounded once: 1.6-2x torch's silu + mul
            return self.down_proj(fused.silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)  # [T, H]

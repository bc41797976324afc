"""Compiled execution of the model's forward (`ModelConfig.enforce_eager=False`).

Design note:

- The attention call is the seam. Every layer's attention goes through ONE opaque torch
  custom op, `servelab::layer_attention(q, k, v, layer, scale, window)`, registered here. The op
  reads the step's backend, metadata and KV cache from a per-step forward context
  (`step_context`), so dynamo never sees the backend's Python planning, host lists or
  the cache write: the rest of the forward (embedding, norms, projections, rotary,
  SiLU-mul, residual adds) traces into one graph with no breaks. The same op is where the
  GPU path splits the graph into CUDA-graph pieces (`engine.worker.cuda_graphs`). When
  the CPU layer kernels become torch custom ops they trace as ops of the graph; until
  then `engine.model.layers` uses plain torch ops while compiling (inductor fuses them).
- Shapes on a CPU: the token count is a dynamic dimension. One graph (plus dynamo's
  size-1 specialisation, compiled at warm-up too) serves every step, prefill, decode and
  mixed, so nothing is padded and nothing recompiles after start-up. The alternative, one
  static graph per size of a padded ladder 1, 2, 4, ..., max_num_seqs, was built first and
  measured: 6 sizes took 480 s to compile on the shared 2-core machine (about 80 s each)
  against ~50 s for the dynamic graph, and it still left prefill steps eager. On a CPU
  the GEMMs are library calls whatever the shape, so static shapes buy little.
- Shapes on a GPU: a CUDA graph needs fixed shapes, so pure-decode batches are padded up
  to the ladder and one graph set is captured per size; steps with a prefill run eagerly.
  Padded rows get input id 0 at position 0; the attention op only ever sees the real
  rows (it slices them off and returns zeros for the pad), so the KV cache and the
  sampled rows are untouched by padding.
- Inductor settings: the defaults (`INDUCTOR_CONFIG` is empty). `freezing` (oneDNN weight
  prepacking) and `cpp_wrapper` are applied through `INDUCTOR_CONFIG` when set, but were
  not shown to help on this machine (see the branch report), so they stay off.
- Warm-up (compile + one run per graph) happens once, in `warm_up()`, before the engine
  takes requests; its time is logged, reported (`compile_time_s`), never part of a step.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from engine.attention.backend import AttentionBackend, AttentionMetadata

logger = logging.getLogger(__name__)

# torch._inductor.config values applied while compiling (see the design note).
INDUCTOR_CONFIG: dict[str, Any] = {}


# ---- the per-step forward context ------------------------------------------------------
@dataclass
class StepContext:
    backend: AttentionBackend
    metadata: AttentionMetadata
    kv_caches: list[torch.Tensor]


_context: StepContext | None = None


@contextmanager
def step_context(backend: AttentionBackend, metadata: AttentionMetadata, kv_caches: list[torch.Tensor]) -> Iterator[None]:
    """Makes (backend, metadata, caches) the attention op's context for one forward."""
    global _context
    prev, _context = _context, StepContext(backend, metadata, kv_caches)
    try:
        yield
    finally:
        _context = prev


# ---- the attention custom op -----------------------------------------------------------
@torch.library.custom_op("servelab::layer_attention", mutates_args=())
def layer_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, scale: float,
                    window: int = 0) -> torch.Tensor:  # fmt: skip
    """Write k/v of the step's real rows into layer `layer`'s cache, attend; [T, Hq, D] contiguous.
    `window`: the layer's sliding window (0: none; AttentionBackend.forward's `window`).

    q: [T, Hq, D], k/v: [T, Hkv, D] where T >= metadata.num_tokens (rows past it are
    padding: ignored, and their output rows are zero). The cache write is a side effect
    the graph does not see; it is ordered correctly because each layer's op both writes
    and reads its own layer's cache, and nothing else in the graph touches the cache.
    """
    ctx = _context
    if ctx is None:
        raise RuntimeError("servelab::layer_attention called outside step_context()")
    md = ctx.metadata
    n = md.num_tokens
    win = window or None
    if q.shape[0] == n:
        return ctx.backend.forward(q, k, v, ctx.kv_caches[layer], md, scale, window=win).contiguous()
    out = q.new_zeros(q.shape)
    out[:n] = ctx.backend.forward(q[:n], k[:n], v[:n], ctx.kv_caches[layer], md, scale, window=win)
    return out


@layer_attention.register_fake
def _layer_attention_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, scale: float,
                          window: int = 0) -> torch.Tensor:  # fmt: skip
    return q.new_empty(q.shape)


class LayerAttention:
    """Stands in for the backend inside one attention layer: forwards to the custom op.

    Has the backend's `forward` signature; the cache and metadata arguments are ignored
    (the op takes them from the step context), so the traced graph holds no Python objects.
    """

    def __init__(self, layer: int, backend: AttentionBackend) -> None:
        self.layer = layer
        self.backend = backend
        self.name = backend.name

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
        metadata: AttentionMetadata, scale: float, window: int | None = None,
    ) -> torch.Tensor:  # fmt: skip
        return torch.ops.servelab.layer_attention(q, k, v, self.layer, scale, window or 0)

    def begin_step(self, metadata: AttentionMetadata) -> None:
        self.backend.begin_step(metadata)


def route_attention_through_op(model: torch.nn.Module, backend: AttentionBackend) -> int:
    """Give every module holding `attn_backend` a `LayerAttention` (layer index in module order)."""
    layer = 0
    for module in model.modules():
        if hasattr(module, "attn_backend"):
            setattr(module, "attn_backend", LayerAttention(layer, backend))  # noqa: B010 (not an nn.Module)
            layer += 1
    return layer


# ---- batch sizes -----------------------------------------------------------------------
def decode_ladder(max_num_seqs: int) -> list[int]:
    """1, 2, 4, ... up to max_num_seqs (which is always the last size)."""
    sizes, n = [], 1
    while n < max_num_seqs:
        sizes.append(n)
        n *= 2
    sizes.append(max_num_seqs)
    return sizes


def padded_size(num_tokens: int, ladder: list[int]) -> int | None:
    """The smallest ladder size >= num_tokens, or None when past the ladder."""
    for size in ladder:
        if size >= num_tokens:
            return size
    return None


def dummy_decode_metadata(batch: int, block_size: int, device: torch.device) -> AttentionMetadata:
    """`batch` one-token requests, each a sequence of 1 token in block 0, slot 0 (warm-up only)."""
    zeros = torch.zeros(batch, dtype=torch.int32, device=device)
    return AttentionMetadata(
        num_reqs=batch,
        num_tokens=batch,
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=device),
        seq_lens=zeros + 1,
        slot_mapping=torch.zeros(batch, dtype=torch.int64, device=device),
        block_table=zeros.view(batch, 1),
        max_query_len=1,
        max_seq_len=1,
        query_start_loc_cpu=list(range(batch + 1)),
        seq_lens_cpu=[1] * batch,
        block_size=block_size,
    )


# ---- the compiled forward --------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ForwardMode:
    """How one step's forward ran: what steps.csv records."""

    compiled: bool
    padded_tokens: int  # tokens the forward computed (>= the step's tokens when padded)


class CompiledForward:
    """The model's forward, compiled: one dynamic-shape inductor graph on a CPU, piecewise CUDA
    graphs per padded decode batch size on a GPU.

    Contract: `__call__(input_ids [T], positions [T], metadata)` -> (hidden [T', H], mode)
    with T' >= T (rows past T are padding), after the caller ran `backend.begin_step(metadata)`.
    Never compiles after `warm_up()`: a step no warmed-up graph covers runs eagerly.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        backend: AttentionBackend,
        kv_caches: list[torch.Tensor],
        max_num_seqs: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.backend = backend
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.num_layers = route_attention_through_op(model, backend)
        self.cuda_graphs = device.type == "cuda"
        # CPU: every token count runs the dynamic graph (sizes 1 and >= 2: dynamo specialises 1).
        # GPU: a CUDA graph needs fixed shapes, so pure-decode batches are padded to the ladder.
        self.ladder = decode_ladder(max_num_seqs)
        self.warm_sizes = sorted(self.ladder, reverse=True) if self.cuda_graphs else [2, 1]
        self.ready = False
        self.compile_time = 0.0
        self._compiled = self._compile(model)

    def _compile(self, model: torch.nn.Module) -> Any:
        import torch._inductor.config as inductor_config

        for key, value in INDUCTOR_CONFIG.items():
            setattr(inductor_config, key, value)
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        if self.cuda_graphs:
            from engine.worker.cuda_graphs import piecewise_backend

            return torch.compile(model, backend=piecewise_backend(capture=True), fullgraph=True, dynamic=False)
        return torch.compile(model, fullgraph=True, dynamic=False)

    @torch.inference_mode()
    def warm_up(self) -> float:
        """Compile (and on a GPU capture) every graph once; returns the seconds taken.

        Writes dummy tokens into slot 0 of every layer's cache, then zeroes the caches:
        call before any request is scheduled.
        """
        t0 = time.perf_counter()
        for size in self.warm_sizes:
            md = dummy_decode_metadata(size, self.block_size, self.device)
            self.backend.begin_step(md)
            # Two distinct tensors: passing one for both would make dynamo guard on their aliasing.
            ids = torch.zeros(size, dtype=torch.int64, device=self.device)
            positions = torch.zeros(size, dtype=torch.int64, device=self.device)
            if not self.cuda_graphs and size > 1:
                torch._dynamo.mark_dynamic(ids, 0)
                torch._dynamo.mark_dynamic(positions, 0)
            with step_context(self.backend, md, self.kv_caches):
                self._compiled(ids, positions, self.kv_caches, md)
        for cache in self.kv_caches:
            cache.zero_()
        self.ready = True
        self.compile_time = time.perf_counter() - t0
        what = f"CUDA graphs for decode batch sizes {self.ladder}" if self.cuda_graphs else "one dynamic-shape graph"
        logger.info("compiled forward: %s, warmed up in %.1f s", what, self.compile_time)
        return self.compile_time

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> tuple[torch.Tensor, ForwardMode]:
        n = input_ids.shape[0]
        size: int | None = n
        if self.cuda_graphs:
            size = padded_size(n, self.ladder) if metadata.is_pure_decode else None
        with step_context(self.backend, metadata, self.kv_caches):
            if size is None or not self.ready:
                return self.model(input_ids, positions, self.kv_caches, metadata), ForwardMode(False, n)
            if size > n:
                pad = input_ids.new_zeros(size - n)
                input_ids, positions = torch.cat((input_ids, pad)), torch.cat((positions, pad))
            return self._compiled(input_ids, positions, self.kv_caches, metadata), ForwardMode(True, size)

"""The context length an engine serves: at most what its KV cache holds.

The one rule every executor applies once its KV cache is sized (the model's own limit is
`ModelArch.max_model_len`): a request as long as `max_model_len` must fit the cache alone, or
the scheduler would refuse it at run time after the server said it serves that length. A
`model.max_model_len` the cache cannot hold is a ConfigLimitError naming both numbers and the
setting that sized the cache (vLLM refuses it at start-up too); with none set, the model's own
context is lowered to the cache's with a warning naming both. Torch-free, so the simulated
executor and the real workers share it.
"""

from __future__ import annotations

import logging

from engine.config import ConfigLimitError

logger = logging.getLogger(__name__)


def kv_context_limit(max_model_len: int, requested: int | None, num_blocks: int, block_size: int, *,
                     sized_by: str, raise_what: str, holds: int | None = None) -> int:  # fmt: skip
    """The context length `num_blocks` blocks of `block_size` tokens serve: `max_model_len`
    when they hold one request that long. `requested` is ModelConfig.max_model_len (None: the
    model's own context); `sized_by` names what sized the cache ("cache.num_blocks=16") and
    `raise_what` the setting to raise. `holds`: the tokens one request may have in them, where
    several KV cache groups share the blocks (engine/kv_cache_spec.py `tokens_alone`)."""
    holds = num_blocks * block_size if holds is None else holds
    if max_model_len <= holds:
        return max_model_len
    if requested is not None:
        raise ConfigLimitError(
            f"model.max_model_len={max_model_len} is more than the KV cache holds ({holds} tokens: {num_blocks} "
            f"blocks of {block_size}, {sized_by}); raise {raise_what} or lower model.max_model_len"
        )
    logger.warning("max_model_len: the model's context of %d tokens is more than the KV cache holds; serving %d "
                   "(%s; raise %s for longer requests)", max_model_len, holds, sized_by, raise_what)  # fmt: skip
    return holds

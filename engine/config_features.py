"""The optional features' configs: speculative decoding, structured output and KV transfer
(`engine/config.py` holds the core sections and `EngineConfig`, which takes these by name)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any


@dataclass
class SpeculativeConfig:
    """Speculative decoding (vLLM's `speculative_config`), engine/spec_decode/.

    `method`: None (off) or "ngram" (prompt lookup: drafts are the tokens that followed
    the most recent earlier occurrence of the request's last n tokens, n from
    `prompt_lookup_max` down to `prompt_lookup_min`). Up to `num_speculative_tokens`
    drafts per request per step, verified in one forward.
    """

    method: str | None = None
    """null (off) or `ngram` (prompt lookup: drafts are the tokens that followed the most recent earlier
    occurrence of the request's last n tokens)."""
    num_speculative_tokens: int = 3
    """Most drafts per request per step (≥ 1), verified in one forward."""
    prompt_lookup_min: int = 2
    """`ngram`: the shortest n tried (1 ≤ min ≤ max)."""
    prompt_lookup_max: int = 5
    """`ngram`: the longest n tried first."""

    @property
    def enabled(self) -> bool:
        return self.method is not None

    def validate(self) -> None:
        if self.method is None:
            return
        if self.method != "ngram":
            raise ValueError(f"speculative_config.method: only 'ngram' is supported, got {self.method!r}")
        if not isinstance(self.num_speculative_tokens, int) or self.num_speculative_tokens < 1:
            raise ValueError("speculative_config.num_speculative_tokens must be an integer >= 1")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("speculative_config: need 1 <= prompt_lookup_min <= prompt_lookup_max")


def _speculative_from(value: Any) -> SpeculativeConfig:
    """`speculative_config=` as vLLM takes it: a dict (or None: off)."""
    if value is None:
        return SpeculativeConfig()
    if isinstance(value, SpeculativeConfig):
        return value
    if not isinstance(value, dict):
        raise ValueError(f"speculative_config: expected a dict, got {type(value).__name__}")
    known = {f.name for f in fields(SpeculativeConfig)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"speculative_config: unknown key {unknown[0]!r} (known: {', '.join(sorted(known))})")
    return SpeculativeConfig(**value)


@dataclass
class StructuredOutputsConfig:
    """Grammar compilation for constrained requests (vLLM's `structured_outputs_config`),
    engine/structured_output/.

    `grammar_cache_size`: compiled grammars kept, one per distinct spec; past it the least
    recently used is dropped (its next request compiles it again). `compile_timeout_s`: a
    compile still running this long after it started fails its requests (HTTP 400 naming the
    timeout; offline an error result) while other constrained requests go on.
    `max_compiles_in_flight`: compiles queued, running, or written off and still running (a
    native compile cannot be stopped); while that many are, a request for a grammar not yet
    compiled is refused (HTTP 429 naming the setting; offline an error result).
    """

    grammar_cache_size: int = 128
    """Compiled grammars kept, one per distinct spec (≥ 1); past it the least recently used is dropped."""
    compile_timeout_s: float = 10.0
    """A grammar compile still running this long after it began fails its requests (HTTP 400 naming the
    timeout; offline `finish_reason: "error"`) while the others go on (> 0)."""
    max_compiles_in_flight: int = 32
    """Grammar compiles queued, running, or past `compile_timeout_s` and still running (≥ 1); while that many
    are, a request whose grammar is not compiled yet is refused (HTTP 429 with `Retry-After`; offline
    `finish_reason: "error"`); compiled grammars are still served. The default serves a burst of 20 distinct
    schemas at once (a compile takes ~5 ms; 8 refused 12 of them) and still bounds what pathological schemas
    can leave burning."""

    def validate(self) -> None:
        if not isinstance(self.grammar_cache_size, int) or self.grammar_cache_size < 1:
            raise ValueError("structured_outputs_config.grammar_cache_size must be an integer >= 1")
        if not isinstance(self.max_compiles_in_flight, int) or self.max_compiles_in_flight < 1:
            raise ValueError("structured_outputs_config.max_compiles_in_flight must be an integer >= 1")
        if not self.compile_timeout_s > 0:
            raise ValueError("structured_outputs_config.compile_timeout_s must be > 0")


KV_CONNECTORS = ("CPUOffloadConnector", "MooncakeStoreConnector", "MooncakeTransferConnector")
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")


@dataclass
class KVTransferConfig:
    """vLLM's `kv_transfer_config`: an external KV store behind the connector boundary
    (engine/kv_transfer/). `kv_connector` None: no connector.

    `kv_role`: kv_producer saves computed blocks and never loads (a prefill instance),
    kv_consumer loads and never saves (a decode instance), kv_both does both (offload,
    a shared store); "producer" / "consumer" / "both" are accepted as short names.
    `kv_connector_extra_config`: the connector's own options (docs/kv_transfer.md).
    """

    kv_connector: str | None = None
    """`CPUOffloadConnector`, `MooncakeStoreConnector`, `MooncakeTransferConnector`, or null (no
    connector)."""
    kv_role: str = "kv_both"
    """`kv_producer` (saves only: a prefill instance), `kv_consumer` (loads only: a decode instance),
    `kv_both` (offload, a shared store); `producer` / `consumer` / `both` are accepted as short names."""
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)
    """The connector's own options (docs/kv_transfer.md)."""

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    def validate(self) -> None:
        if self.kv_role in ("producer", "consumer", "both"):
            self.kv_role = f"kv_{self.kv_role}"
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_transfer.kv_role must be one of {', '.join(KV_ROLES)}, got {self.kv_role!r}")
        if self.kv_connector is not None and self.kv_connector not in KV_CONNECTORS:
            raise ValueError(
                f"kv_transfer.kv_connector must be one of {', '.join(KV_CONNECTORS)} (or null), "
                f"got {self.kv_connector!r}"
            )

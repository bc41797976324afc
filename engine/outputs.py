"""What `LLM.generate()` and `AsyncLLM` return: `RequestOutput`, `CompletionOutput`, `RequestMetrics`.

The types that cross between the front end and the EngineCore process live in engine/seam.py
(the step seam, scheduler to worker, is engine/step_io.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.seam import TokenLogprobs


@dataclass
class RequestMetrics:
    arrival_time: float = 0.0
    first_scheduled_time: float = 0.0
    first_token_time: float = 0.0
    finished_time: float = 0.0
    # time.time() of the step that produced each output token (per token, not per chunk).
    token_times: list[float] = field(default_factory=list)
    # Speculative decoding: draft tokens verified for this request, and how many were accepted.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # External KV (engine/kv_transfer/): prompt tokens loaded from a store, bytes moved each
    # way, seconds waiting for loads and saving (0 without a connector).
    kv_external_tokens: int = 0
    kv_bytes_loaded: int = 0
    kv_bytes_saved: int = 0
    kv_load_wait: float = 0.0
    kv_save_time: float = 0.0

    def kv_figures(self) -> dict[str, float]:
        """The external-KV figures as requests.csv names them (analysis/runfolder.py)."""
        return {"kv_external_tokens": self.kv_external_tokens, "kv_bytes_loaded": self.kv_bytes_loaded,
                "kv_bytes_saved": self.kv_bytes_saved, "kv_load_wait_ms": self.kv_load_wait * 1000.0,
                "kv_save_ms": self.kv_save_time * 1000.0}  # fmt: skip

    @property
    def queued_time(self) -> float:
        return max(0.0, self.first_scheduled_time - self.arrival_time)

    @property
    def prefill_time(self) -> float:
        return max(0.0, self.first_token_time - self.first_scheduled_time)

    @property
    def decode_time(self) -> float:
        return max(0.0, self.finished_time - self.first_token_time)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] | None = None
    # What this output adds to the previous one of the same request (streaming).
    text_delta: str = ""
    token_ids_delta: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    metrics: RequestMetrics = field(default_factory=RequestMetrics)

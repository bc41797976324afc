"""A target that answers with known token timings (tests, driver capacity benchmarks).

Per request a `Script` says: first chunk `ttft_s` after the send, then one chunk every
`chunk_gap_s`, each carrying `tokens_per_chunk` tokens (the last one the remainder), for
`output_tokens` tokens in all (default: the spec's max_tokens); or fail with `error` after
`ttft_s`. `instant=True` skips every sleep (all chunks arrive at once): it measures the
driver, not a server. Output token ids are 0..n-1 and the text is "t0 t1 ...", so
multi-turn sessions can be driven too.

`expected_records(specs)` gives the records a perfect driver would measure (start = planned
arrival, chunk times exactly as scripted): the reference for hand-checked metric tests.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

from analysis.record import RequestRecord, TargetResult, token_times_from_chunks
from engine.seam import StepStats
from workloads.record_builder import build_record
from workloads.spec import RequestSpec
from workloads.targets.base import OnToken


@dataclass(frozen=True, slots=True)
class Script:
    ttft_s: float = 0.0
    chunk_gap_s: float = 0.0
    tokens_per_chunk: int = 1
    output_tokens: int | None = None
    prompt_tokens: int | None = None
    error: str = ""

    def chunks(self, max_tokens: int) -> tuple[list[float], list[int]]:
        """(offsets from the send in seconds, tokens per chunk)."""
        n = self.output_tokens if self.output_tokens is not None else max_tokens
        if self.error or n <= 0:
            return [], []
        k = max(1, self.tokens_per_chunk)
        counts = [k] * (n // k) + ([n % k] if n % k else [])
        return [self.ttft_s + j * self.chunk_gap_s for j in range(len(counts))], counts


class ScriptedTarget:
    """Target with scripted timings; `script(spec)` overrides the default per request."""

    name = "scripted"

    def __init__(
        self, default: Script | None = None, script: Callable[[RequestSpec], Script] | None = None,
        instant: bool = False,
    ) -> None:
        self.default = default or Script()
        self.script = script
        self.instant = instant
        self.sent: list[str] = []  # request ids in send order

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    def step_stats(self) -> list[StepStats] | None:
        return None

    async def scrape_metrics(self) -> dict[str, float] | None:
        return None

    def script_for(self, spec: RequestSpec) -> Script:
        return self.script(spec) if self.script is not None else self.default

    async def send(self, spec: RequestSpec, on_token: OnToken | None = None) -> TargetResult:
        t_start = time.perf_counter()
        self.sent.append(spec.request_id)
        script = self.script_for(spec)
        offsets, counts = script.chunks(spec.max_tokens)
        res = TargetResult(prompt_tokens=script.prompt_tokens or spec.prompt_len)
        if script.error:
            if not self.instant:
                await _sleep_until(t_start + script.ttft_s)
            res.error, res.finish_reason, res.done_time = script.error, "error", time.perf_counter()
            return res
        for off, k in zip(offsets, counts, strict=True):
            if not self.instant:
                await _sleep_until(t_start + off)
            t = time.perf_counter()
            res.chunk_times.append(t)
            res.chunk_tokens.append(k)
            if on_token is not None:
                on_token(t, k)
        n = sum(counts)
        res.output_tokens = n
        res.output_token_ids = list(range(n))
        res.output_text = " ".join(f"t{i}" for i in range(n))
        res.finish_reason = "length"
        res.done_time = time.perf_counter()
        return res

    def expected_records(self, specs: list[RequestSpec]) -> list[RequestRecord]:
        """Records of an ideal open-loop run: sent exactly at arrival, chunks exactly on time."""
        out = []
        for spec in specs:
            script = self.script_for(spec)
            offsets, counts = script.chunks(spec.max_tokens)
            chunk_times = [spec.arrival_s + o for o in offsets]
            times = token_times_from_chunks(chunk_times, counts)
            done = times[-1] if times else spec.arrival_s + script.ttft_s
            gaps = [b - a for a, b in zip(chunk_times[:-1], chunk_times[1:], strict=True)]
            out.append(
                build_record(
                    spec, scheduled_s=spec.arrival_s, start_s=spec.arrival_s, token_times=times, done_s=done,
                    prompt_tokens=script.prompt_tokens, output_tokens=sum(counts),
                    finish_reason="error" if script.error else "length", error=script.error,
                    chunk_itls_s=gaps if times else None, chunk_tokens=counts if times else None,
                )
            )
        return out


async def _sleep_until(t: float) -> None:
    delay = t - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)

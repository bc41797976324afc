"""OpenAI-compatible HTTP target: streamed /v1/completions or /v1/chat/completions.

Measurement choices (METRICS.md):
- `stream_options: {include_usage, continuous_usage_stats}`: the final usage gives the server's
  prompt / completion token counts; per-chunk cumulative usage (vLLM, servelab) gives each
  chunk's token count. Without it, the server's total is spread evenly over the content chunks.
- A content chunk is one with non-empty text; tokens reported on chunks without text (a
  partial UTF-8 character) are carried to the next content chunk.
- the servelab timing extension (engine/entrypoints/timing.py) is asked for with a header
  (`target.server_timing`; other servers ignore headers they do not know). When the answer
  carries it, each token's engine time, the engine's phase split and its TTFT are kept
  (analysis/record.py turns them into per-token ITLs); without it, chunk timing stays.
- aiohttp with large read buffers and a connector without a connection limit, so the client
  never queues requests or stalls on long SSE lines.
"""

from __future__ import annotations

import json
import time
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from analysis.record import TargetResult
from engine.entrypoints.timing import HEADER as TIMING_HEADER
from engine.seam import StepStats
from workloads.spec import RequestSpec
from workloads.sse import DONE as SSE_DONE
from workloads.sse import SSEParser
from workloads.targets.base import OnToken

_READ_BUFSIZE = 10 * 2**20
_GAUGES = {
    "vllm:num_requests_running": "num_running",
    "vllm:num_requests_waiting": "num_waiting",
    "vllm:kv_cache_usage_perc": "kv_usage",
    "vllm:gpu_cache_usage_perc": "kv_usage",
    "servelab:num_requests_running": "num_running",
    "servelab:num_requests_waiting": "num_waiting",
    "servelab:kv_cache_usage_perc": "kv_usage",
}


# Cumulative server counters (Prometheus counters carry `_total`; histograms `_sum` / `_count`),
# kept in each scraped row so a run's summary can take their change over the run.
_COUNTERS = {
    "vllm:prefix_cache_queries_total": "prefix_cache_queries",
    "vllm:prefix_cache_hits_total": "prefix_cache_hits",
    "vllm:num_preemptions_total": "num_preemptions",
    "vllm:prompt_tokens_total": "prompt_tokens",
    "vllm:generation_tokens_total": "generation_tokens",
    "vllm:request_queue_time_seconds_sum": "queue_time_sum",
    "vllm:request_queue_time_seconds_count": "queue_time_count",
    "vllm:request_prefill_time_seconds_sum": "prefill_time_sum",
    "vllm:request_prefill_time_seconds_count": "prefill_time_count",
    "vllm:request_decode_time_seconds_sum": "decode_time_sum",
    "vllm:request_decode_time_seconds_count": "decode_time_count",
}


class _Stream:
    """Accumulates one SSE response; `feed` takes one decoded event."""

    def __init__(self, chat: bool, on_token: OnToken | None) -> None:
        self.chat, self.on_token = chat, on_token
        self.res = TargetResult()
        self.counts: list[int | None] = []
        self.pending = 0  # tokens reported on chunks without text
        self.prev_cum = 0
        self.text: list[str] = []

    def feed(self, obj: dict[str, Any], t: float) -> None:
        if obj.get("servelab"):
            apply_engine_timing(self.res, obj["servelab"])
        if obj.get("error"):
            err = obj["error"]
            self.res.error = err.get("message", str(err)) if isinstance(err, dict) else str(err)
            return
        k = self._usage_delta(obj.get("usage"))
        text = ""
        for choice in obj.get("choices") or []:
            text += self._choice_text(choice)
            if choice.get("finish_reason"):
                self.res.finish_reason = choice["finish_reason"]
        if not text:
            self.pending += k or 0
            return
        count = None if k is None else k + self.pending
        self.pending = 0
        self.res.chunk_times.append(t)
        self.counts.append(count)
        self.text.append(text)
        if self.on_token is not None:
            self.on_token(t, count if count is not None else 1)

    def _choice_text(self, choice: dict[str, Any]) -> str:
        if self.chat:
            return (choice.get("delta") or {}).get("content") or ""
        return choice.get("text") or ""

    def _usage_delta(self, usage: dict[str, Any] | None) -> int | None:
        if not usage:
            return None
        self.res.prompt_tokens = usage.get("prompt_tokens", self.res.prompt_tokens)
        cum = usage.get("completion_tokens")
        if cum is None:
            return None
        self.res.output_tokens = cum
        delta, self.prev_cum = cum - self.prev_cum, cum
        return delta

    def finish(self) -> TargetResult:
        res = self.res
        res.chunk_tokens = reconcile_counts(self.counts, res.output_tokens, self.pending)
        res.output_text = "".join(self.text)
        if res.output_tokens is None:
            res.output_tokens = sum(res.chunk_tokens)
        res.done_time = time.perf_counter()
        return res


def apply_engine_timing(res: TargetResult, ext: Any) -> None:
    """Keep the first engine request's timestamps from a `servelab` extension object."""
    entries = ext.get("timing") if isinstance(ext, dict) else None
    if not entries or not isinstance(entries[0], dict):
        return
    e = entries[0]
    times = [float(t) for t in e.get("token_times") or []]
    arrival = e.get("arrival")
    phases = e.get("phases_s") or {}
    res.server_queued_s = phases.get("queue")
    res.server_prefill_s = phases.get("prefill")
    res.server_decode_s = phases.get("decode")
    if times:
        res.engine_token_offsets = [t - times[0] for t in times]
        if arrival:
            res.server_ttft_s = times[0] - float(arrival)
            res.server_e2el_s = times[-1] - float(arrival)


def reconcile_counts(counts: list[int | None], total: int | None, leftover: int = 0) -> list[int]:
    """Tokens per content chunk, summing to the server's total when it is known.

    Known per-chunk counts are kept (leftover tokens go to the last chunk); when no chunk
    had a count, the total is spread evenly (earlier chunks take the remainder); without a
    total, every unknown chunk counts 1.
    """
    if not counts:
        return []
    if all(c is None for c in counts) and total is not None and total >= len(counts):
        base, extra = divmod(total, len(counts))
        return [base + (i < extra) for i in range(len(counts))]
    out = [c if c is not None else 1 for c in counts]
    out[-1] += leftover
    if total is not None and sum(out) != total:
        out[-1] = max(0, out[-1] + total - sum(out))
    return out


class OpenAITarget:
    """Streams requests to an OpenAI-compatible server.

    `endpoint` is "completions" (text or token-id prompts) or "chat" (text prompts only, sent
    as one user message). `extra_body` is merged into every request (temperature, seed, ...).
    """

    name = "openai"

    def __init__(
        self, base_url: str, model: str, api_key: str | None = None, endpoint: str = "completions",
        extra_body: dict[str, Any] | None = None, timeout_s: float | None = None, server_timing: bool = True,
    ) -> None:
        if endpoint not in ("completions", "chat"):
            raise ValueError("endpoint must be completions or chat")
        self.base_url = base_url.rstrip("/")
        self.model, self.api_key, self.endpoint = model, api_key, endpoint
        self.extra_body = dict(extra_body or {})
        self.timeout_s = timeout_s
        self.server_timing = server_timing
        self._session: aiohttp.ClientSession | None = None

    @property
    def url(self) -> str:
        path = "chat/completions" if self.endpoint == "chat" else "completions"
        return f"{self.base_url}/v1/{path}"

    async def start(self) -> None:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        if self.server_timing:
            headers[TIMING_HEADER] = "1"
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, limit_per_host=0),
            timeout=aiohttp.ClientTimeout(total=self.timeout_s),
            read_bufsize=_READ_BUFSIZE,
            headers=headers,
        )
        if not self.model:
            self.model = await self._first_model()

    async def _first_model(self) -> str:
        """The first id of GET /v1/models (when no model name was given)."""
        assert self._session is not None
        try:
            async with self._session.get(f"{self.base_url}/v1/models") as resp:
                data = await resp.json(content_type=None)
                return str(data["data"][0]["id"])
        except (aiohttp.ClientError, OSError, KeyError, IndexError, TypeError, ValueError) as exc:
            raise RuntimeError(
                f"target.model_name not set and {self.base_url}/v1/models gave no model ({exc!r})"
            ) from exc

    async def stop(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def step_stats(self) -> list[StepStats] | None:
        return None

    def payload(self, spec: RequestSpec) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": spec.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        }
        if self.endpoint == "chat":
            if spec.prompt is None:
                raise ValueError(f"{spec.request_id}: the chat endpoint needs a text prompt")
            body["messages"] = [{"role": "user", "content": spec.prompt}]
        else:
            body["prompt"] = spec.prompt_token_ids if spec.prompt_token_ids is not None else spec.prompt
        if spec.ignore_eos:
            body["ignore_eos"] = True
        if spec.priority:
            body["priority"] = spec.priority
        body.update(self.extra_body)
        return body

    async def send(self, spec: RequestSpec, on_token: OnToken | None = None) -> TargetResult:
        if self._session is None:
            raise RuntimeError("OpenAITarget.send before start()")
        body = self.payload(spec)
        for attempt in range(1 + _STALE_CONNECTION_RETRIES):
            stream = _Stream(self.endpoint == "chat", on_token)
            answered = False
            try:
                async with self._session.post(self.url, json=body) as resp:
                    answered = True
                    if resp.status != 200:
                        stream.res.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                    else:
                        await _read_sse(resp, stream)
            except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                if not answered and attempt < _STALE_CONNECTION_RETRIES and _stale_connection(exc):
                    continue  # the server closed this kept-alive connection before reading the request
                stream.res.error = f"{type(exc).__name__}: {exc}"
            stream.res.reconnects = attempt
            return stream.finish()
        raise AssertionError("unreachable: the last attempt returns")

    async def scrape_metrics(self) -> dict[str, float] | None:
        """One row of server gauges and counters from GET /metrics (Prometheus text); None if
        unavailable. A non-200 answer sets `metrics_error` (the server has no such endpoint:
        the driver stops asking and the summary says why the server figures are missing)."""
        if self._session is None:
            return None
        try:
            async with self._session.get(f"{self.base_url}/metrics") as resp:
                if resp.status != 200:
                    self.metrics_error = f"GET /metrics answered HTTP {resp.status}"
                    return None
                return parse_gauges(await resp.text())
        except (aiohttp.ClientError, ValueError):  # unreachable, or not Prometheus text this time
            return None


# A kept-alive connection the server has closed (llama.cpp's llama-server closes idle ones) fails the next
# request written into it before any answer: sent again once on a fresh connection, and counted.
_STALE_CONNECTION_RETRIES = 1


def _stale_connection(exc: BaseException) -> bool:
    """The request died on a connection the server had closed: disconnected before any response, or the body
    could not be written. A timeout or a refused connection is not this."""
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return True
    return isinstance(exc, aiohttp.ClientOSError) and not isinstance(exc, aiohttp.ClientConnectorError)


async def _read_sse(resp: aiohttp.ClientResponse, stream: _Stream) -> None:
    """Feed each event's JSON to `stream`, stamped with the arrival of the chunk that completed it."""
    parser = SSEParser()
    async for chunk in resp.content.iter_any():
        t = time.perf_counter()
        for event in parser.feed(chunk):
            if event.data == SSE_DONE:
                return
            stream.feed(json.loads(event.data), t)


def parse_gauges(text: str) -> dict[str, float]:
    """Known queue / KV gauges and cumulative counters (`_COUNTERS`) from Prometheus text.

    One metric's label sets are summed (several engines behind one server); when several
    names mean the same figure (vLLM exports `kv_cache_usage_perc` and its deprecated alias
    `gpu_cache_usage_perc` side by side), the first name in `_GAUGES` order that is present
    wins: aliases are never added together. Parsed by prometheus_client (a sample's optional
    timestamp is not its value); ValueError for text that is not the exposition format.
    """
    per_name: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:  # a counter's sample is `<family>_total`, as named in _COUNTERS
            if sample.name in _GAUGES or sample.name in _COUNTERS:
                per_name[sample.name] = per_name.get(sample.name, 0.0) + float(sample.value)
    out: dict[str, float] = {}
    for name, key in (*_GAUGES.items(), *_COUNTERS.items()):
        if name in per_name and key not in out:
            out[key] = per_name[name]
    return out

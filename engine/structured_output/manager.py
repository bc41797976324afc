"""StructuredOutputManager: grammars for the EngineCore's constrained requests.

Lifecycle of a constrained request (one whose `SamplingParams.structured_outputs` is set):

1. `submit` (from `EngineCore.add_request`): its grammar is compiled on a background
   thread (llguidance drops the GIL while compiling), once per distinct spec: the compiled
   matcher is a template kept in an LRU cache (`GrammarCache`, bounded by
   `structured_outputs_config.grammar_cache_size`), and each request gets a cheap
   `deep_copy`. The request is not in the scheduler yet, so it holds no budget, no KV and
   no queue position that others would wait behind.
2. `take_ready` (each step, before `schedule`): requests whose grammar is ready go to the
   scheduler; a grammar that failed to compile, or is still compiling
   `structured_outputs_config.compile_timeout_s` after its compile began, fails its request
   with a message naming the field ("<field>: why"), which the HTTP layer answers with a 400.
   A grammar not compiled yet while `structured_outputs_config.max_compiles_in_flight`
   compiles are in flight fails at once with `params.COMPILES_BUSY` (a 429: retry later).
3. `fill_bitmask` (after `schedule`, before execute): one int32 bitmask row (bit `t` of
   word `t // 32`: token `t` is allowed) per constrained request that samples this step.
4. `accept_tokens` (after `update_from_output`): each request's grammar consumes the tokens
   the scheduler kept. Preemption keeps a request's output tokens (it recomputes their KV
   only), so its grammar state stays valid; tokens the scheduler dropped (after a stop) are
   never consumed, so there is nothing to roll back. A request is never speculated on while
   it is constrained (`engine/spec_decode/proposer.py`), so no draft token reaches a grammar.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import llguidance as llg
import numpy as np

from engine.config import StructuredOutputsConfig
from engine.request import Request
from engine.structured_output import grammar
from engine.structured_output.grammar_cache import CompileJob, GrammarCache

logger = logging.getLogger(__name__)

# Returns (tokenizer JSON, EOS id): run once, on a compile thread (loading the GGUF
# vocabulary takes seconds).
TokenizerSource = Callable[[], tuple[str, int | None]]


@dataclass(slots=True)
class _Awaiting:
    request: Request
    job: CompileJob


class StructuredOutputManager:
    def __init__(
        self, tokenizer_source: TokenizerSource, config: StructuredOutputsConfig | None = None,
        compiler: grammar.GrammarCompiler = grammar.compile_grammar,
    ) -> None:  # fmt: skip
        """`compiler` is the compile seam (`grammar.GrammarCompiler`); `compiler` can also be
        set later, before the compiles it should run."""
        config = config or StructuredOutputsConfig()
        self._tokenizer_source = tokenizer_source
        self.cache = GrammarCache(self._make_tokenizer, compiler, config.grammar_cache_size, config.compile_timeout_s,
                                  max_in_flight=config.max_compiles_in_flight)  # fmt: skip
        self._awaiting: dict[str, _Awaiting] = {}
        self._matchers: dict[str, llg.LLMatcher] = {}
        self.vocab_words = 0  # int32 words per bitmask row, known once the tokenizer is

    def set_tokenizer_source(self, source: TokenizerSource) -> None:
        """Use a tokenizer the caller already has (the offline LLM's), before the first compile."""
        self._tokenizer_source = source

    @property
    def compiler(self) -> grammar.GrammarCompiler:
        return self.cache.compiler

    @compiler.setter
    def compiler(self, compiler: grammar.GrammarCompiler) -> None:
        self.cache.compiler = compiler

    @property
    def num_compiles(self) -> int:
        """Distinct grammars compiled (cache misses)."""
        return self.cache.num_compiles

    # ---- admission ---------------------------------------------------------------------
    def submit(self, request: Request) -> None:
        """Start (or reuse) the compile of `request`'s grammar; the request waits here."""
        params = request.sampling_params.structured_outputs
        assert params is not None
        self._awaiting[request.request_id] = _Awaiting(request, self.cache.get(params))

    def _make_tokenizer(self) -> llg.LLTokenizer:
        tokenizer_json, eos = self._tokenizer_source()
        tok = grammar.make_tokenizer(tokenizer_json, eos)
        self.vocab_words = (tok.vocab_size + 31) // 32
        return tok

    @property
    def num_awaiting(self) -> int:
        return len(self._awaiting)

    def take_ready(self) -> tuple[list[Request], list[tuple[Request, str]]]:
        """Requests whose grammar is ready (each now has its own matcher), and requests
        whose grammar failed or timed out, with a one-line reason."""
        self.cache.expire()
        ready: list[Request] = []
        failed: list[tuple[Request, str]] = []
        for rid, entry in list(self._awaiting.items()):
            job = entry.job
            if not job.done.is_set():
                continue
            del self._awaiting[rid]
            if job.matcher is None:
                failed.append((entry.request, job.error or "grammar compile failed"))
                continue
            self._matchers[rid] = job.matcher.deep_copy()
            ready.append(entry.request)
        return ready, failed

    def wait_for_any(self, timeout: float) -> None:
        """Block up to `timeout` s until some grammar is ready or a compile's deadline passes
        (only when the engine has nothing else to do)."""
        if self._awaiting:
            self.cache.wait(timeout)

    def abort(self, req_ids: list[str]) -> list[Request]:
        """Forget these requests; returns those that were still waiting for their grammar."""
        dropped = []
        for rid in req_ids:
            self._matchers.pop(rid, None)
            entry = self._awaiting.pop(rid, None)
            if entry is not None:
                dropped.append(entry.request)
        return dropped

    def is_constrained(self, req_id: str) -> bool:
        return req_id in self._matchers

    # ---- per step ----------------------------------------------------------------------
    def fill_bitmask(self, req_ids: Iterable[str], requests: dict[str, Request]) -> dict[str, np.ndarray] | None:
        """Bitmask rows [vocab_words] int32 for the constrained requests among `req_ids`
        (scheduled this step; `requests` maps ids to requests) that sample this step (their computed tokens reach every known token). A grammar in
        an error state allows only EOS, so the request ends instead of sampling garbage."""
        if not self._matchers:
            return None
        rows: dict[str, np.ndarray] = {}
        for rid in req_ids:
            matcher = self._matchers.get(rid)
            request = requests.get(rid) if matcher is not None else None
            if matcher is None or request is None or request.num_computed_tokens < request.num_tokens:
                continue
            row = np.frombuffer(matcher.compute_bitmask(), dtype=np.int32)
            if matcher.is_error() or not row.any():
                # As wide as the matchers' rows (llguidance's may have a word more than the
                # vocabulary needs): the step stacks every constrained request's row.
                row = _only(request.eos_token_id, len(row) or self.vocab_words)
            rows[request.request_id] = row
        return rows or None

    def accept_tokens(self, req_id: str, token_ids: list[int], finished: bool) -> None:
        matcher = self._matchers.get(req_id)
        if matcher is None:
            return
        if finished:
            del self._matchers[req_id]
            return
        if not matcher.consume_tokens(token_ids):
            logger.warning("request %s: grammar rejected tokens %s (%s)", req_id, token_ids, matcher.get_error())

    def shutdown(self) -> None:
        self.cache.shutdown()


def _only(token_id: int | None, words: int) -> np.ndarray:
    row = np.zeros(max(words, 1), dtype=np.int32)
    if token_id is not None and token_id // 32 < len(row):
        row[token_id // 32] = np.int32(np.uint32(1 << (token_id % 32)).view(np.int32))
    return row


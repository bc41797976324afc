"""The offline API, mirroring vLLM's `LLM`.

    from engine import LLM, SamplingParams

    llm = LLM(model="smollm2", max_num_batched_tokens=512)
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0))
    outs[0].outputs[0].text

`generate()` takes vLLM's prompt forms (see `engine/inputs.py`). It is a loop over
`EngineCore.step()`: it adds every request, then steps until all have finished, so
requests join and leave the running batch at every step (continuous batching),
exactly as the online server does. Input goes through the same admission path as
`AsyncLLM` (`InputProcessor.process`, then `fan_out` for n > 1). A step whose executor
raises ends that step's requests with `finish_reason` "error"; the others go on.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tqdm import tqdm

from engine.config import DEFAULT_MODEL, EngineConfig
from engine.core.engine_core import EngineCore
from engine.frontend.output_processor import OutputProcessor
from engine.frontend.processor import InputProcessor, ProcessedRequest, fan_out
from engine.inputs import PromptType, parse_prompts
from engine.outputs import CompletionOutput, RequestOutput
from engine.request import RequestStatus
from engine.sampling_params import SamplingParams
from engine.seam import EngineCoreOutputs, EngineCoreRequest, StepStats
from engine.tokenizer import get_tokenizer

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Pending:
    """One prompt of a `generate()` call: its id, its text and its `n` core requests."""

    request_id: str
    prompt: str | None
    children: list[EngineCoreRequest]


class LLM:
    def __init__(self, model: str = DEFAULT_MODEL, config: EngineConfig | None = None, **engine_args: Any) -> None:
        if config is not None and engine_args:
            raise ValueError(f"LLM: pass either config= or engine arguments, not both (got {sorted(engine_args)})")
        self.config = config if config is not None else EngineConfig.from_kwargs(model=model, **engine_args)
        self.engine_core = EngineCore(self.config)
        self.tokenizer = get_tokenizer(self.config.model)
        tok = self.tokenizer  # grammars compile against the same vocabulary, loaded once
        self.engine_core.structured_output.set_tokenizer_source(lambda: (tok.backend.to_str(), tok.eos_token_id))
        vocab = getattr(self.engine_core.executor, "vocab_size", None)
        self.processor = InputProcessor(self.tokenizer, self.engine_core.max_model_len, vocab)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.step_stats: list[StepStats] = []
        self._counter = itertools.count()

    # ---- public API ------------------------------------------------------------------
    def generate(
        self,
        prompts: PromptType,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in prompt order, each with `n` completions.

        `prompts`: a string, a list of token ids, a `{"prompt": ...}` or
        `{"prompt_token_ids": [...]}` dict, or a list of any of those.
        """
        parsed = parse_prompts(prompts)
        params = _broadcast(sampling_params, len(parsed))
        prios = list(priority) if priority is not None else [0] * len(parsed)
        if len(prios) != len(parsed):
            raise ValueError(f"priority: {len(prios)} given for {len(parsed)} prompts")
        reqs = [
            self._admit(self.processor.process(p.prompt, sp, priority=prio, cache_salt=p.cache_salt))
            for p, sp, prio in zip(parsed, params, prios, strict=True)
        ]
        return self._run(reqs, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate."""
        conversations: list[list[dict[str, Any]]]
        if messages and isinstance(messages[0], dict):
            conversations = [messages]  # type: ignore[list-item]
        else:
            conversations = messages  # type: ignore[assignment]
        params = _broadcast(sampling_params, len(conversations))
        reqs = [
            self._admit(self.processor.process(None, sp, messages=conv))
            for conv, sp in zip(conversations, params, strict=True)
        ]
        return self._run(reqs, use_tqdm)

    def reset_prefix_cache(self) -> None:
        self.engine_core.scheduler.kv_cache_manager.reset_prefix_cache()

    # ---- internals -------------------------------------------------------------------
    def _admit(self, req: ProcessedRequest) -> _Pending:
        request_id = str(next(self._counter))
        return _Pending(request_id, req.prompt, fan_out(request_id, req))

    def _run(self, reqs: list[_Pending], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        for pending in reqs:
            for i, child in enumerate(pending.children):
                self.output_processor.add_request(
                    child.request_id, pending.prompt, child.prompt_token_ids, child.sampling_params,
                    child.arrival_time, i,
                )
                self.engine_core.add_request(child)
        total = sum(len(p.children) for p in reqs)
        bar = tqdm(total=total, desc="Generating", unit="req", disable=not use_tqdm, dynamic_ncols=True)
        try:
            while self.engine_core.has_unfinished_requests():
                core_out = self._step()
                st = core_out.stats
                if st is not None and (st.num_prefill_tokens + st.num_decode_tokens or st.kv_blocks_loaded
                                       or st.kv_load_failures):  # fmt: skip
                    self.step_stats.append(st)
                with self.engine_core.hooks.phase("detokenize"):
                    outs, to_finish = self.output_processor.process_outputs(core_out)
                if to_finish:  # stop strings end on the front end; finish them in the core
                    self.engine_core.finish_requests(to_finish, RequestStatus.FINISHED_STOPPED)
                for out in outs:
                    if out.finished:
                        finished[out.request_id] = out
                        bar.update(1)
        except BaseException:
            ids = [c.request_id for p in reqs for c in p.children]
            self.engine_core.abort_requests(ids)
            self.output_processor.abort_requests(ids)
            raise
        finally:
            bar.close()
        return [_merge(p.request_id, [finished[c.request_id] for c in p.children]) for p in reqs]

    def _step(self) -> EngineCoreOutputs:
        """One engine step. When it fails, its requests' outputs (`finish_reason` "error") stand
        for it and the others go on; a fatal failure (a lost rank), or one that ended no request
        (it would fail forever), is raised."""
        core = self.engine_core
        try:
            return core.step()
        except Exception as exc:
            failed = core.take_failed_outputs()
            if getattr(exc, "fatal", False) or not failed.outputs:
                raise
            logger.warning("LLM: a step failed (%s: %s); its requests end with an error", type(exc).__name__, exc)
            return failed


def _merge(parent_id: str, children: list[RequestOutput]) -> RequestOutput:
    first = children[0]
    completions: list[CompletionOutput] = [c.outputs[0] for c in children]
    return RequestOutput(
        request_id=parent_id,
        prompt=first.prompt,
        prompt_token_ids=first.prompt_token_ids,
        outputs=completions,
        finished=True,
        num_cached_tokens=first.num_cached_tokens,
        metrics=first.metrics,
    )


def _broadcast(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(params, SamplingParams):
        return [params] * n
    if len(params) != n:
        raise ValueError(f"sampling_params: {len(params)} given for {n} prompts")
    return list(params)

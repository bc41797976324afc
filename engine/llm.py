"""The offline API, mirroring vLLM's `LLM`.

    llm = LLM(model="smollm2", max_num_batched_tokens=512)
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0))
    outs[0].outputs[0].text

`generate()` is a loop over `EngineCore.step()`: it adds every request, then
steps until all have finished, so requests join and leave the running batch at
every step (continuous batching), exactly as the online server does.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from engine.config import DEFAULT_MODEL, EngineConfig
from engine.core.engine_core import EngineCore, EngineCoreRequest
from engine.output_processor import OutputProcessor
from engine.outputs import CompletionOutput, RequestOutput, StepStats
from engine.processor import InputProcessor
from engine.request import RequestStatus
from engine.sampling_params import SamplingParams
from engine.tokenizer import get_tokenizer

PromptType = str | list[int]


class LLM:
    def __init__(self, model: str = DEFAULT_MODEL, config: EngineConfig | None = None, **engine_args: Any) -> None:
        if config is not None and engine_args:
            raise ValueError(f"LLM: pass either config= or engine arguments, not both (got {sorted(engine_args)})")
        self.config = config if config is not None else EngineConfig.from_kwargs(model=model, **engine_args)
        self.engine_core = EngineCore(self.config)
        self.tokenizer = get_tokenizer(self.config.model)
        vocab = getattr(self.engine_core.executor, "vocab_size", None)
        self.processor = InputProcessor(self.tokenizer, self.engine_core.max_model_len, vocab)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.step_stats: list[StepStats] = []
        self._counter = itertools.count()

    # ---- public API ------------------------------------------------------------------
    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in prompt order, each with `n` completions."""
        prompt_list = _as_prompt_list(prompts)
        params = _broadcast(sampling_params, len(prompt_list))
        prios = list(priority) if priority is not None else [0] * len(prompt_list)
        reqs = [
            self._prepare(p, sp, prio, messages=None)
            for p, sp, prio in zip(prompt_list, params, prios, strict=True)
        ]
        return self._run(reqs, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        params = _broadcast(sampling_params, len(conversations))
        reqs = [
            self._prepare(None, sp, 0, messages=conv)  # type: ignore[arg-type]
            for conv, sp in zip(conversations, params, strict=True)
        ]
        return self._run(reqs, use_tqdm)

    def reset_prefix_cache(self) -> None:
        self.engine_core.scheduler.kv_cache_manager.reset_prefix_cache()

    # ---- internals -------------------------------------------------------------------
    def _prepare(
        self, prompt: PromptType | None, params: SamplingParams, priority: int, messages: Any
    ) -> tuple[str, str | None, list[EngineCoreRequest]]:
        parent_id = str(next(self._counter))
        children = []
        for i in range(params.n):
            child_params = params.clone(n=1, seed=None if params.seed is None else params.seed + i)
            req = self.processor.process(f"{parent_id}-{i}", prompt, child_params, messages, priority)
            children.append(req)
        return parent_id, prompt if isinstance(prompt, str) else None, children

    def _run(self, reqs: list[tuple[str, str | None, list[EngineCoreRequest]]], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        for _, prompt, children in reqs:
            for i, child in enumerate(children):
                self.output_processor.add_request(
                    child.request_id, prompt, child.prompt_token_ids, child.sampling_params, child.arrival_time, i
                )
                self.engine_core.add_request(child)
        total = sum(len(c) for _, _, c in reqs)
        bar = tqdm(total=total, desc="Generating", unit="req", disable=not use_tqdm, dynamic_ncols=True)
        try:
            while self.engine_core.has_unfinished_requests():
                core_out = self.engine_core.step()
                if core_out.stats is not None and core_out.stats.num_prefill_tokens + core_out.stats.num_decode_tokens:
                    self.step_stats.append(core_out.stats)
                with self.engine_core.hooks.phase("detokenize"):
                    outs, to_finish = self.output_processor.process_outputs(core_out)
                if to_finish:
                    self.engine_core.finish_requests(to_finish, RequestStatus.FINISHED_STOPPED)
                for out in outs:
                    if out.finished:
                        finished[out.request_id] = out
                        bar.update(1)
        except BaseException:
            ids = [c.request_id for _, _, cs in reqs for c in cs]
            self.engine_core.abort_requests(ids)
            self.output_processor.abort_requests(ids)
            raise
        finally:
            bar.close()
        return [_merge(parent, [finished[c.request_id] for c in children]) for parent, _, children in reqs]


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


def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, list) and prompts and isinstance(prompts[0], int):
        return [prompts]  # type: ignore[list-item]
    if not isinstance(prompts, Sequence) or isinstance(prompts, bytes):
        raise ValueError("prompts: must be a string, a list of token ids, or a list of those")
    return list(prompts)  # type: ignore[arg-type]


def _broadcast(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(params, SamplingParams):
        return [params] * n
    if len(params) != n:
        raise ValueError(f"sampling_params: {len(params)} given for {n} prompts")
    return list(params)

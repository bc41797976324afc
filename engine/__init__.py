"""servelab's engine. The offline API, as vLLM spells it:

    from engine import LLM, SamplingParams

    llm = LLM(model="smollm2")
    outputs = llm.generate(["Hello, my name is"], SamplingParams(temperature=0.8, top_p=0.95))
    print(outputs[0].outputs[0].text)

The names below load on first use, so `import engine.<module>` stays light (no torch)
for code that needs only part of the engine.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.frontend.async_llm import AsyncLLM
    from engine.frontend.llm import LLM
    from engine.inputs import PromptType, TextPrompt, TokensPrompt
    from engine.outputs import CompletionOutput, RequestOutput
    from engine.sampling_params import SamplingParams

_EXPORTS = {
    "LLM": "engine.frontend.llm",
    "AsyncLLM": "engine.frontend.async_llm",
    "SamplingParams": "engine.sampling_params",
    "EngineConfig": "engine.config",
    "RequestOutput": "engine.outputs",
    "CompletionOutput": "engine.outputs",
    "PromptType": "engine.inputs",
    "TextPrompt": "engine.inputs",
    "TokensPrompt": "engine.inputs",
}

__all__ = [
    "LLM", "AsyncLLM", "SamplingParams", "EngineConfig", "RequestOutput", "CompletionOutput",
    "PromptType", "TextPrompt", "TokensPrompt",
]  # fmt: skip


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)

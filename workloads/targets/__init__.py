"""Targets: what the driver sends requests to (an HTTP server, a scripted fake, an engine).

Implementations: `OpenAITarget` (any OpenAI-compatible server, SSE streaming) and
`ScriptedTarget` (known token timings, for tests and driver benchmarks). An in-process engine
target wrapping `engine.frontend.async_llm.AsyncLLM` belongs in `workloads/targets/engine.py`: it
implements the same `Target` protocol, fills `TargetResult.server_*` from
`RequestOutput.metrics`, and returns per-step `StepStats` from `step_stats()`.
"""

from workloads.targets.base import OnToken, Target
from workloads.targets.openai import OpenAITarget
from workloads.targets.scripted import Script, ScriptedTarget

__all__ = ["OnToken", "OpenAITarget", "Script", "ScriptedTarget", "Target"]

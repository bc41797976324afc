"""The target kinds `servelab-run` knows (`target.kind`), each declared once, here.

A kind is either driven (`make`: the driver sends it the workload's requests; build.py) or runs
the whole experiment itself (`run`: offline.py, simulated.py). Beside that it declares:

- `config`: the fields of the `target` section it reads (conf/target/<kind>.yaml, conf/schema.py
  `TargetSection`), the engine's own sections aside;
- `scraped`: an HTTP server whose /metrics the driver reads every `target.metrics_interval_s`;
- `engine`: servelab's engine runs on this machine, so on a CPU summary.json records the kernels
  it chose (`CPU_KERNEL_KEYS`);
- `model_dtype`: a model runs, so summary.json records its `dtype` (`model.dtype` resolved);
- `summary`: summary.json keys of its own (beyond every run's and the two groups above).

workloads/experiment.py and workloads/run_summary.py look a kind up with `target_kind(name)`; an
unknown name is one error naming every kind.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from conf.schema import RunConfig
from engine.config import EngineConfig
from workloads.targets import build
from workloads.targets.build import Made, Ran
from workloads.targets.offline import run_offline
from workloads.targets.simulated import run_simulated

MakeTarget = Callable[[RunConfig, EngineConfig, Path], Made]
RunItself = Callable[[RunConfig, EngineConfig, Path], Ran]

# What an engine target on a CPU adds to summary.json (workloads/run_summary.py): the linears'
# kernels (`float32_linear` or `bfloat16_linear`, and `block_linear`), the CPU flags the kernels
# saw, the weights each step size multiplied, and whether the batch-invariant path ran.
CPU_KERNEL_KEYS = ("float32_linear", "bfloat16_linear", "block_linear", "cpu_flags", "linear_weights",
                   "batch_invariant")  # fmt: skip
SCRAPED_KEYS = ("server_metrics",)  # "unavailable: ..." when /metrics did not answer
HTTP = ("endpoint", "request_timeout_s", "startup_timeout_s")  # a server the harness starts and waits for
PEER = ("venv", "peer_args", "peer_env", *HTTP)


@dataclass(frozen=True, slots=True)
class TargetKind:
    """One `target.kind`: how it is made or run, and what its runs record (module docstring)."""

    name: str
    description: str
    make: MakeTarget | None = None
    run: RunItself | None = None
    config: tuple[str, ...] = ()
    scraped: bool = False
    engine: bool = False
    model_dtype: bool = True
    summary: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if (self.make is None) == (self.run is None):
            raise TypeError(f"target kind {self.name!r}: give make (driven) or run (runs itself), not both")

    def summary_keys(self) -> tuple[str, ...]:
        """Every summary.json key this kind may add beyond every run's."""
        return (("dtype",) if self.model_dtype else ()) + (CPU_KERNEL_KEYS if self.engine else ()) \
            + (SCRAPED_KEYS if self.scraped else ()) + self.summary


TARGETS: dict[str, TargetKind] = {kind.name: kind for kind in (
    TargetKind("inprocess", "AsyncLLM in this process, the EngineCore in a thread, streaming",
               make=build.make_inprocess, engine=True, summary=("compile_time_s",)),
    TargetKind("offline", "LLM.generate with every request at once: deterministic (the CI gate)",
               run=run_offline, engine=True, summary=("compile_time_s",)),
    TargetKind("server", "a servelab-serve process the harness starts and stops",
               make=build.make_server, config=("server", "server_timing", "metrics_interval_s", *HTTP),
               scraped=True, engine=True),
    TargetKind("pd", "prefill/decode disaggregation: Mooncake, prefill and decode servers, servelab-router",
               make=build.make_pd, config=("num_prefill", "num_decode", "router_policy", "kv_connector",
                                           "metrics_interval_s", *HTTP),
               scraped=True, engine=True, summary=("kv_connector_instances",)),
    TargetKind("openai", "any OpenAI-compatible server at target.url",
               make=build.make_openai, config=("url", "model_name", "api_key", "endpoint", "request_timeout_s",
                                               "server_timing", "metrics_interval_s"),
               scraped=True),
    TargetKind("vllm", "vLLM's OpenAI server, started from a side venv",
               make=build.make_vllm, config=("hf_model", "metrics_interval_s", *PEER), scraped=True),
    TargetKind("llamacpp", "llama-cpp-python's OpenAI server on the same GGUF, started from a side venv",
               make=build.make_llamacpp, config=("gguf", "metrics_interval_s", *PEER), scraped=True),
    TargetKind("simulated", "no model: the engine's scheduler on a virtual clock, step times from `sim`",
               run=run_simulated, model_dtype=False, summary=("simulation_wall_s",)),
)}  # fmt: skip


def target_kind(name: str) -> TargetKind:
    """The kind called `name`; a ValueError naming every known kind otherwise."""
    kind = TARGETS.get(name)
    if kind is None:
        raise ValueError(f"target.kind: unknown {name!r} ({'|'.join(TARGETS)})")
    return kind

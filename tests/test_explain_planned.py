"""servelab-explain sees the kernels that run (issue 60 item 7): the CPU forward plan is profiled as
it runs, its parts named (`servelab::plan:<part>`, engine/kernels/forward_plan.py), and a candidate
whose compiled kernel does more work inside one part is named as `forward › <that part>`.

The candidate is a copy of engine/kernels/csrc/layer_ops.cpp built under its own extension name
and op namespace (two libraries cannot register one op), whose `silu_mul` runs its loop PASSES
times: what a tree with a slower kernel in the plan's MLP part would run. It reaches the engine as
the plan's ops table with that one op replaced, entered around each candidate rep.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from analysis.explain import explain, format_explain
from engine.kernels import forward_plan
from engine.kernels.cpu_extension import cflags, translation_unit
from workloads.explain_pairs import Side, run_pairs
from workloads.explain_probe import PLAN_PREFIX, find_model, module_ranges, profiled_rep

REQUESTS = [{"prompt_token_ids": list(range(200 + 7 * i, 230 + 7 * i)), "max_tokens": 8} for i in range(4)]
REPEATS = 4  # pairs: the injected change is ~15% of the time per token, tens of standard errors
CAND_NS = "servelab_explain_cand"  # the candidate's C++ namespace and op library
PASSES = 40  # its silu_mul's loop runs this many times: ~40x the MLP part's own time


def _candidate_unit() -> str:
    """layer_ops.cpp's translation unit, renamed into CAND_NS, its silu_mul looping PASSES times."""
    unit = re.sub(r"\bservelab\b", CAND_NS, translation_unit("layer_ops.cpp"))
    signature = "torch::Tensor silu_mul(torch::Tensor gate_up) {"
    library = f"TORCH_LIBRARY_FRAGMENT({CAND_NS},"
    assert unit.count(signature) == 1 and unit.count(library) == 1, "layer_ops.cpp's silu_mul or library moved"
    unit = unit.replace(signature, signature.replace("silu_mul(", "silu_mul_once("))
    slower = (f"namespace {CAND_NS} {{\n// the candidate's change: the same kernel, {PASSES} times\n"
              f"torch::Tensor silu_mul(torch::Tensor gate_up) {{\n"
              f"  torch::Tensor out = silu_mul_once(gate_up);\n"
              f"  for (int pass = 1; pass < {PASSES}; ++pass) out = silu_mul_once(gate_up);\n"
              f"  return out;\n}}\n}}  // namespace {CAND_NS}\n\n")  # fmt: skip
    return unit.replace(library, slower + library)


@pytest.fixture(scope="module")
def candidate_silu_mul() -> Any:
    """The candidate's `silu_mul` op, built once (torch's extension cache keeps it by name)."""
    if shutil.which("g++") is None and shutil.which("c++") is None:
        pytest.skip("no C++ compiler (g++) to build the candidate's kernel with")
    from torch.utils.cpp_extension import load_inline

    unit = _candidate_unit()
    flags = [*cflags(), "-ffp-contract=off"]
    digest = hashlib.sha256("\0".join((unit, *flags, torch.__version__)).encode()).hexdigest()[:12]
    load_inline(name=f"{CAND_NS}_{digest}", cpp_sources=[unit], extra_cflags=flags, extra_ldflags=["-fopenmp"],
                is_python_module=False, verbose=False)  # fmt: skip
    return getattr(torch.ops, CAND_NS).silu_mul


@pytest.fixture(scope="module")
def llm() -> Iterator[Any]:
    from engine.frontend.llm import LLM

    torch.set_num_threads(1)
    # float32 on every CPU: its plan's decode steps read the GGUF blocks (cpu_blocks) and call `silu_mul` and
    # `block_linear` from the plan's ops table, where a bfloat16 plan on AMX / AVX512-BF16 fuses the SiLU into
    # its linear kernel (amx_linear_silu_mul) and has no separate MLP kernel to swap
    engine = LLM(model="smollm2", dtype="float32", max_num_seqs=8, num_gpu_blocks_override=64)
    model = find_model(engine)
    if model is None or model.model.plan is None:  # type: ignore[union-attr]
        engine.engine_core.shutdown()
        pytest.skip("no CPU forward plan here (it needs the C++ layer kernels)")
    # The candidate reaches the plan through its Python ops table, which the one-call decode op of the
    # blocks path (engine/kernels/block_layers.py: it calls the kernels through the dispatcher) does
    # not read: both sides run the plan's Python loop, the same calls in the same parts.
    inner = model.model  # type: ignore[union-attr]
    inner.plan = dataclasses.replace(inner.plan, block_layers=None)
    yield engine
    engine.engine_core.shutdown()


class _OpsWith:
    """The plan's ops table (`torch.ops.servelab`) with `silu_mul` replaced."""

    def __init__(self, ops: Any, silu_mul: Any) -> None:
        self._ops, self.silu_mul = ops, silu_mul

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ops, name)


def _slower_mlp(llm: Any, silu_mul: Any) -> contextlib.AbstractContextManager[None]:
    @contextlib.contextmanager
    def around() -> Iterator[None]:
        inner = find_model(llm).model  # type: ignore[union-attr]
        plan = inner.plan
        inner.plan = dataclasses.replace(plan, ops=_OpsWith(plan.ops, silu_mul))
        try:
            yield
        finally:
            inner.plan = plan

    return around()


def _groups(rep: dict[str, Any]) -> dict[str, set[str]]:
    """{group: its ops} over a rep's steps."""
    out: dict[str, set[str]] = {}
    for step in rep["steps"]:
        for key in step["ops"]:
            group, _, op = key.partition("|")
            out.setdefault(group, set()).add(op)
    return out


def test_a_profiled_rep_runs_the_plan_and_names_its_parts(llm: Any) -> None:
    groups = _groups(profiled_rep(llm, REQUESTS))
    assert find_model(llm).model.plan is not None  # type: ignore[union-attr]  # (put back, if it was ever taken)
    # the plan's norms are ops of its "norm" part; with the plan set aside (the modules' forward) they run
    # outside every module range (RMSNorm.add_norm_ is no module call) and land in "lm head / logits"
    assert "servelab::add_rms_norm_" in groups.get("norm", set()), groups
    assert "servelab::silu_mul" in groups.get("mlp", set()), groups
    assert "servelab::block_linear" in groups.get("linears", set()), groups  # decode steps: the checkpoint's blocks
    assert "servelab::paged_attention" in groups.get("attention", set()), groups


def test_a_slower_kernel_in_the_plan_is_named_by_its_part(llm: Any, candidate_silu_mul: Any) -> None:
    base, cand = run_pairs(Side(llm), Side(llm, around=lambda: _slower_mlp(llm, candidate_silu_mul)), REQUESTS,
                           REPEATS)  # fmt: skip
    report = explain(base, cand)
    print(format_explain(report))
    assert report["contributors"], "the candidate's MLP kernel runs 40 times: something must be beyond noise"
    top = report["contributors"][0]
    beyond = sum(abs(e["contribution"]) for e in report["contributors"])
    assert top["component"] == "forward › mlp" and top["contribution"] > 0, report["contributors"]
    assert top["contribution"] >= 0.6 * beyond, report["contributors"]
    ops = {op["op"]: op for op in top["ops"]}
    moved = ops[f"{CAND_NS}::silu_mul"]  # the candidate's kernel, one call per layer as the baseline's
    assert moved["cand_calls_per_step"] == pytest.approx(ops["servelab::silu_mul"]["base_calls_per_step"])


class _Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.plan = "a plan"  # type: ignore[assignment]


def test_an_engine_whose_plan_names_no_parts_is_profiled_through_its_modules(monkeypatch) -> None:
    """A baseline tree older than the part ranges (no PLAN_RANGE_PREFIX): its plan is set aside for
    the rep, its modules named as before, and put back after."""
    model = _Plain()
    with module_ranges(model):
        assert model.model.plan == "a plan"
    monkeypatch.delattr(forward_plan, "PLAN_RANGE_PREFIX")
    with module_ranges(model):
        assert model.model.plan is None
    assert model.model.plan == "a plan"


def test_the_part_names_agree_with_the_probe_and_the_cpp_loop() -> None:
    assert forward_plan.PLAN_RANGE_PREFIX == PLAN_PREFIX
    # the C++ loops' range names (planned_layers.cpp, block_layers.cpp) live in one header
    cpp = (Path(forward_plan.__file__).parent / "csrc" / "dispatch_ops.h").read_text()
    named = set(re.findall(r'"servelab::plan:([a-z ]+)"', cpp))
    assert named == set(forward_plan.PLAN_PARTS), named

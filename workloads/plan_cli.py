"""servelab-plan's command line: Hydra overrides as servelab-run takes them, the old `--flag`
options as aliases of override keys (`FLAG_ALIASES`; docs/capacity.md lists the mapping). What it
plans and writes: workloads/plan.py.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from conf.schema import PlanConfig
from workloads import plan as planner
from workloads.plan import STATS, PlanError, plan


def _csv(kind: type, text: str, flag: str) -> str:
    """An old flag's comma-separated values as a Hydra list literal (`2,4` -> `[2.0,4.0]`)."""
    try:
        vals = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise PlanError(f"{flag}: expected comma-separated {kind.__name__} values, got {text!r}") from None
    if not vals or any(v <= 0 for v in vals):
        raise PlanError(f"{flag}: values must be > 0, got {text!r}")
    return "[" + ",".join(repr(v) for v in vals) + "]"


_CSV_FLAGS = {"plan.rates": ("--rates", float), "plan.time_scales": ("--time-scales", float),
              "plan.max_num_batched_tokens": ("--max-num-batched-tokens", int),
              "plan.max_num_seqs": ("--max-num-seqs", int)}  # fmt: skip


# old flag -> (the override key it sets, argparse options); a flag without a value sets `value`.
FLAG_ALIASES: dict[str, tuple[str, dict[str, Any]]] = {
    "--model": ("model", {}),  # a conf/model option, else model.model (a shape name or path)
    "--hardware": ("sim.hardware", {}),
    "--tp": ("sim.tp", {"type": int}),
    "--dtype": ("sim.dtype", {}),
    "--step-model": ("sim.step_model", {}),
    "--num-blocks": ("cache.num_blocks", {"type": int}),
    "--gpu-memory-utilization": ("sim.gpu_memory_utilization", {"type": float}),
    "--no-prefix-caching": ("cache.enable_prefix_caching", {"action": "store_const", "const": "false"}),
    "--trace": ("workload.trace.path", {}),  # also sets workload.kind=trace
    "--first-n": ("workload.trace.max_requests", {"type": int}),
    "--start-s": ("workload.trace.start_s", {"type": float}),
    "--end-s": ("workload.trace.end_s", {"type": float}),
    "--num-requests": ("workload.num_requests", {"type": int}),
    "--prompt-len": ("workload.prompt_len.value", {"type": int}),
    "--output-len": ("workload.output_len.value", {"type": int}),
    "--seed": ("workload.seed", {"type": int}),
    "--rates": ("plan.rates", {}),
    "--time-scales": ("plan.time_scales", {}),
    "--search": ("plan.search", {"action": "store_const", "const": "true"}),
    "--search-start": ("plan.search_start", {"type": float}),
    "--search-tol": ("plan.search_tol", {"type": float}),
    "--search-max": ("plan.search_max", {"type": float}),
    "--target-rate": ("plan.target_rate", {"type": float}),
    "--slo-ttft-ms": ("slo.ttft_ms", {"type": float}),
    "--slo-tpot-ms": ("slo.tpot_ms", {"type": float}),
    "--slo-stat": ("plan.slo_stat", {"choices": STATS}),
    "--max-num-batched-tokens": ("plan.max_num_batched_tokens", {}),
    "--max-num-seqs": ("plan.max_num_seqs", {}),
    "--out": ("plan.out", {}),
    "--plain": ("plan.plain", {"action": "store_const", "const": "true"}),
    "--progress": ("plan.progress", {"action": "store_const", "const": "true"}),
}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="servelab-plan", description=planner.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        argument_default=argparse.SUPPRESS,
    )
    ap.add_argument("overrides", nargs="*", help="Hydra overrides (key=value), as servelab-run takes")
    for flag, (key, opts) in FLAG_ALIASES.items():
        ap.add_argument(flag, dest=key, help=f"alias of {key}=...", **opts)
    return ap


def to_overrides(argv: Sequence[str]) -> list[str]:
    """The command line as Hydra overrides: `key=value` as given, each old flag as its key."""
    ns = vars(build_parser().parse_args(list(argv)))
    out: list[str] = []
    for key, value in ns.items():
        if key == "overrides":
            continue
        if key == "model":
            out.append(f"model={value}" if _is_model_option(value) else f"model.model={value}")
            continue
        if key == "workload.trace.path":
            out.append("workload.kind=trace")
        if key in _CSV_FLAGS:
            flag, kind = _CSV_FLAGS[key]
            value = _csv(kind, value, flag)
        out.append(f"{key}={value}")
    return out + list(ns.get("overrides", []))


def _is_model_option(name: str) -> bool:
    from conf.schema import config_groups

    return name in config_groups().get("model", [])


def load_config(overrides: list[str]) -> PlanConfig:
    """Compose conf/plan.yaml with `overrides` into the typed PlanConfig; PlanError (one line)."""
    from conf.schema import compose_typed

    try:
        cfg: PlanConfig = compose_typed(PlanConfig, "plan", overrides)
    except ValueError as exc:
        raise PlanError(str(exc)) from None
    return cfg


def main(argv: Sequence[str] | None = None) -> int:
    try:
        cfg = load_config(to_overrides(sys.argv[1:] if argv is None else argv))
        plan(cfg)
    except PlanError as e:
        print(f"servelab-plan: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"servelab-plan: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("servelab-plan: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())

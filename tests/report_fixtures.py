"""Synthetic run folders in the workbench's schema, for report/compare/gate tests.

`make_run(path, ...)` writes config.yaml, requests.csv, steps.csv, summary.json and,
on request, kernels.csv, telemetry.csv/json and error.txt, with values that are
consistent with one another (summary statistics are computed from requests.csv with
the METRICS.md definitions). `slow` scales every latency (and divides throughputs).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import yaml

STAT_KEYS = ("mean", "median", "std", "p50", "p90", "p95", "p99")


def _config(rate: float, backend: str) -> dict:
    return {
        "workload": {"name": "synthetic", "arrival": "poisson", "request_rate": rate, "num_requests": 40,
                     "input_len": 128, "output_len": 32, "seed": 0},
        "target": {"kind": "inprocess", "model": "smollm2"},
        "engine": {"scheduler": {"max_num_batched_tokens": 2048, "max_num_seqs": 128},
                   "cache": {"block_size": 16, "num_blocks": 512, "enable_prefix_caching": True},
                   "attention": {"backend": backend}, "model": {"model": "smollm2", "dtype": "float32"}},
        "slo": {"ttft_ms": 400.0, "tpot_ms": 60.0, "e2el_ms": None},
    }  # fmt: skip


def _requests(rng: np.random.Generator, n: int, rate: float, slow: float) -> pd.DataFrame:
    scheduled = np.cumsum(rng.exponential(1.0 / rate, n))
    lateness = rng.exponential(0.4, n)
    start = scheduled + lateness / 1e3
    out_tokens = rng.integers(8, 48, n)
    rows = []
    for i in range(n):
        ttft = (0.08 + rng.gamma(2.0, 0.05)) * slow
        itls = rng.gamma(4.0, 0.008, int(out_tokens[i]) - 1) * slow
        times = start[i] + ttft + np.concatenate([[0.0], np.cumsum(itls)])
        e2el = times[-1] - start[i]
        queued = ttft * 0.3
        rows.append({
            "request_id": f"req-{i}", "is_warmup": i < 2, "scheduled_s": scheduled[i], "start_s": start[i],
            "first_token_s": times[0], "end_s": times[-1], "client_queue_ms": lateness[i],
            "lateness_ms": lateness[i], "ttft_ms": ttft * 1e3, "tpot_ms": (e2el - ttft) / (len(times) - 1) * 1e3,
            "e2el_ms": e2el * 1e3, "prompt_tokens": int(rng.integers(64, 256)), "output_tokens": len(times),
            "finish_reason": "length", "error": "", "server_queued_ms": queued * 1e3,
            "server_prefill_ms": (ttft - queued) * 1e3 * 0.9, "server_decode_ms": (e2el - ttft) * 1e3 * 0.95,
            "token_times": json.dumps([round(t, 6) for t in times]),
            "itls_ms": json.dumps([round(x * 1e3, 4) for x in itls]), "group": f"g{i % 4}",
        })  # fmt: skip
    df = pd.DataFrame(rows)
    bad = n - 1  # the last request failed
    latency_cols = ["first_token_s", "end_s", "ttft_ms", "tpot_ms", "e2el_ms", "output_tokens",
                    "server_prefill_ms", "server_decode_ms", "token_times", "itls_ms"]  # fmt: skip
    df[latency_cols] = df[latency_cols].astype(object)
    df.loc[bad, latency_cols] = None
    df.loc[bad, ["finish_reason", "error"]] = ["error", "ConnectionResetError: server closed the stream"]
    return df


def _steps(rng: np.random.Generator, duration: float, slow: float, metrics_only: bool) -> pd.DataFrame:
    n = max(20, int(duration / (0.02 * slow)))
    t = np.linspace(0.05, duration, n)
    running = rng.integers(1, 12, n)
    waiting = np.maximum(0, rng.integers(-4, 4, n))
    used = np.minimum(512, running * 10 + rng.integers(0, 20, n))
    df = pd.DataFrame({"time": t, "num_running": running, "num_waiting": waiting, "kv_usage": used / 512})
    if metrics_only:
        df["source"] = "metrics"
        return df
    prefill = np.where(rng.random(n) < 0.2, rng.integers(64, 512, n), 0)
    phases = {k: rng.gamma(3.0, s, n) * slow for k, s in
              (("schedule_time", 1e-4), ("prepare_time", 3e-4), ("forward_time", 5e-3),
               ("sample_time", 4e-4), ("update_time", 1e-4))}  # fmt: skip
    df = df.assign(
        step=np.arange(n),
        **phases,
        step_time=sum(phases.values()),
        num_prefill_tokens=prefill,
        num_decode_tokens=running,
        num_prefill_reqs=(prefill > 0).astype(int),
        num_decode_reqs=running,
        kv_blocks_used=used,
        kv_blocks_total=512,
        prefix_cache_queries=prefill,
        prefix_cache_hits=(prefill * rng.uniform(0, 0.6, n)).astype(int),
        num_preemptions=(rng.random(n) < 0.03).astype(int),
        num_finished=(rng.random(n) < 0.3).astype(int),
        # An external KV store (engine/kv_transfer/): blocks loaded on some admissions, saved on prefills.
        kv_blocks_loaded=np.where(prefill > 0, rng.integers(0, 8, n), 0),
        kv_blocks_saved=prefill // 16,
    )
    return df


def _stats(prefix: str, values: np.ndarray) -> dict:
    if len(values) == 0:
        return {f"{s}_{prefix}_ms": None for s in STAT_KEYS}
    out = {f"mean_{prefix}_ms": float(np.mean(values)), f"median_{prefix}_ms": float(np.median(values)),
           f"std_{prefix}_ms": float(np.std(values))}  # fmt: skip
    out |= {f"p{p}_{prefix}_ms": float(np.percentile(values, p)) for p in (50, 90, 95, 99)}
    return out


def _summary(req: pd.DataFrame, steps: pd.DataFrame, slo: dict, time_reference_s: float | None) -> dict:
    m = req[~req["is_warmup"].astype(bool)]
    ok = m[m["error"].fillna("") == ""]
    duration = float(ok["end_s"].astype(float).max() - m["start_s"].min())
    out_tokens = ok["output_tokens"].astype(float)
    itls = np.concatenate([json.loads(s) for s in ok["itls_ms"]])
    good = (ok["ttft_ms"].astype(float) <= slo["ttft_ms"]) & (ok["tpot_ms"].astype(float) <= slo["tpot_ms"])
    s = {
        "completed": len(ok), "failed": len(m) - len(ok), "duration": duration,
        "total_input_tokens": int(ok["prompt_tokens"].sum()), "total_output_tokens": int(out_tokens.sum()),
        "request_throughput": len(ok) / duration, "output_throughput": out_tokens.sum() / duration,
        "total_token_throughput": (ok["prompt_tokens"].sum() + out_tokens.sum()) / duration,
        "request_goodput": int(good.sum()) / duration, "max_output_tokens_per_s": out_tokens.sum() / duration * 2,
        "max_concurrent_requests": 6,
        "mean_client_queue_ms": float(m["client_queue_ms"].mean()), "mean_lateness_ms": float(m["lateness_ms"].mean()),
        "p99_lateness_ms": float(np.percentile(m["lateness_ms"], 99)), "max_lateness_ms": float(m["lateness_ms"].max()),
        "driver_bottleneck": bool(m["lateness_ms"].quantile(0.99) > 50),
    }  # fmt: skip
    for name in ("ttft", "tpot", "e2el"):
        s |= _stats(name, ok[f"{name}_ms"].astype(float).to_numpy())
    s |= _stats("itl", itls)
    for part in ("queued", "prefill", "decode"):
        s[f"mean_server_{part}_ms"] = float(ok[f"server_{part}_ms"].astype(float).mean())
    if "step" in steps:
        s |= {"num_steps": len(steps), "num_preemptions": int(steps["num_preemptions"].sum()),
              "prefix_cache_hit_rate": float(steps["prefix_cache_hits"].sum() / max(1, steps["prefix_cache_queries"].sum())),
              "mean_tokens_per_step": float((steps["num_prefill_tokens"] + steps["num_decode_tokens"]).mean())}  # fmt: skip
    if time_reference_s is not None:
        s["time_reference_s"] = time_reference_s
    s["errors"] = sorted(set(m.loc[m["error"].fillna("") != "", "error"]))[:5]
    s["definitions"] = {
        "ttft_ms": "first content chunk - send time",
        "tpot_ms": "(E2EL - TTFT) / (output tokens - 1)",
    }
    return s


def _kernels(steps: pd.DataFrame) -> pd.DataFrame:
    shares = {"gemm": 0.55, "attention": 0.2, "norm_act": 0.1, "sampling": 0.05, "copy": 0.06, "other": 0.04}
    rows = [(int(st), cat, float(fwd) * 1e3 * share)
            for st, fwd in zip(steps["step"][2:6], steps["forward_time"][2:6], strict=True)
            for cat, share in shares.items()]  # fmt: skip
    return pd.DataFrame(rows, columns=["step", "category", "time_ms"])


def _telemetry(run: Path, duration: float, gpu: bool) -> None:
    t = np.arange(0.0, duration, 0.25)
    df = pd.DataFrame(
        {"time": t, "cpu_util_pct": 60 + 20 * np.sin(t), "rss_mb": 900 + 5 * t, "gpu_index": None}
    )
    if gpu:
        df = df.assign(
            gpu_index=0, gpu_util_pct=85.0, gpu_mem_used_mb=40_000.0, gpu_power_w=450.0, sm_clock_mhz=1980.0
        )
        info = {"gpu": True, "devices": ["NVIDIA H200"]}
    else:
        info = {
            "gpu": False,
            "reason": "NVML unavailable: NVMLError_LibraryNotFound: NVML Shared Library Not Found",
        }
    df.to_csv(run / "telemetry.csv", index=False)
    (run / "telemetry.json").write_text(json.dumps(info))


def make_run(
    run: Path, *, n: int = 40, seed: int = 0, rate: float = 8.0, slow: float = 1.0, backend: str = "torch",
    profile: bool = True, telemetry: bool = True, gpu: bool = False, metrics_only: bool = False,
    error: str | None = None, time_reference_s: float | None = 0.05,
) -> Path:  # fmt: skip
    """Writes a complete, consistent run folder at `run` and returns it."""
    rng = np.random.default_rng(seed)
    run.mkdir(parents=True, exist_ok=True)
    config = _config(rate, backend)
    (run / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    req = _requests(rng, n, rate, slow)
    duration = float(req["end_s"].astype(float).max())
    steps = _steps(rng, duration, slow, metrics_only)
    req.to_csv(run / "requests.csv", index=False)
    steps.to_csv(run / "steps.csv", index=False)
    ref = time_reference_s * slow if time_reference_s is not None else None
    summary = _summary(req, steps, config["slo"], ref)
    (run / "summary.json").write_text(json.dumps(summary, indent=2))
    if profile and not metrics_only:
        _kernels(steps).to_csv(run / "kernels.csv", index=False)
    if telemetry:
        _telemetry(run, duration, gpu)
    if error:
        (run / "error.txt").write_text(error)
    return run


def make_sweep(
    root: Path, rates: tuple[float, ...] = (2.0, 8.0), backends: tuple[str, ...] = ("torch", "triton")
) -> Path:
    """A sweep folder: one run per (rate, backend) under root/jobs, and root/sweep.csv."""
    rows = []
    for i, (rate, backend) in enumerate((r, b) for b in backends for r in rates):
        slow = (1.0 + rate / 10) * (0.8 if backend == "triton" else 1.0)
        run = make_run(
            root / "jobs" / str(i), n=24, seed=i, rate=rate, slow=slow, backend=backend, profile=False
        )
        summary = json.loads((run / "summary.json").read_text())
        flat = {k: v for k, v in summary.items() if not isinstance(v, list | dict)}
        rows.append(
            {"workload.request_rate": rate, "attention.backend": backend, **flat, "run_dir": str(run)}
        )
    pd.DataFrame(rows).to_csv(root / "sweep.csv", index=False)
    return root

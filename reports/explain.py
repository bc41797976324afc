"""The "Regression explained" HTML section and page (servelab-explain's explain.html).

`explain_section(report)` is an HTML fragment: the change with its interval, a table of the
contributors beyond noise (share, ms per output token, interval, the operators that moved) with
the folded rest on one line, a bar chart of the contributions (inline SVG, an interval whisker
on each bar), and the step composition of both sides. `explain_page(report)` wraps it in a
page, and `write_outputs` both as explain.html and explain.json. Reads only the report dict of
`analysis.explain.explain`.
"""

from __future__ import annotations

from html import escape
from pathlib import Path
from typing import Any

BAR_H, LABEL_W, CHART_W = 22, 260, 420


def _bar_chart(contributors: list[dict[str, Any]], noise: dict[str, Any]) -> str:
    """Horizontal bars from a zero line: right slower, left faster; whisker = the interval."""
    rows = [(e["name"], e["contribution"], e["low"], e["high"]) for e in contributors]
    if noise["count"]:
        rows.append((f"{noise['count']} within noise", noise["contribution"], noise["contribution"],
                     noise["contribution"]))  # fmt: skip
    if not rows:
        return ""
    scale = max(max(abs(v) for r in rows for v in r[1:]), 1e-9)
    zero = LABEL_W + CHART_W / 2
    px = (CHART_W / 2 - 10) / scale
    parts = [f'<svg width="{LABEL_W + CHART_W + 90}" height="{BAR_H * len(rows) + 10}" '
             'xmlns="http://www.w3.org/2000/svg" font-family="sans-serif" font-size="12">']  # fmt: skip
    for i, (name, value, low, high) in enumerate(rows):
        y = 5 + i * BAR_H
        x0, x1 = sorted((zero, zero + value * px))
        colour = "#c0392b" if value > 0 else "#27ae60"
        parts.append(f'<text x="{LABEL_W - 6}" y="{y + 15}" text-anchor="end">{escape(name[:40])}</text>')
        parts.append(f'<rect x="{x0:.1f}" y="{y + 3}" width="{max(x1 - x0, 1):.1f}" height="{BAR_H - 8}" '
                     f'fill="{colour}"/>')  # fmt: skip
        parts.append(f'<line x1="{zero + low * px:.1f}" x2="{zero + high * px:.1f}" y1="{y + 11}" y2="{y + 11}" '
                     'stroke="black"/>')  # fmt: skip
        parts.append(f'<text x="{LABEL_W + CHART_W + 4}" y="{y + 15}">{value:+.3f}</text>')
    parts.append(f'<line x1="{zero}" x2="{zero}" y1="0" y2="{BAR_H * len(rows) + 10}" stroke="#555"/></svg>')
    return "".join(parts)


def _ops_cell(entry: dict[str, Any]) -> str:
    return "<br>".join(
        f"{escape(op['op'])}: {op['base_ms_per_call']:.3f} → {op['cand_ms_per_call']:.3f} ms/call, "
        f"{op['base_calls_per_step']:.1f} → {op['cand_calls_per_step']:.1f} calls/step"
        for op in entry.get("ops", [])
    )


def _family(report: dict[str, Any]) -> str:
    """The sentence on the contributors' simultaneous intervals (absent from reports before they were)."""
    if "components" not in report:
        return ""
    return (f" The contributors' intervals are simultaneous over {report['components']} components (Bonferroni: "
            f"{1 - report['alpha']:.0%} that all hold, {report['component_confidence']:.2%} each), so identical code "
            f"names none at least {1 - report['alpha']:.0%} of the time.")


def explain_section(report: dict[str, Any]) -> str:
    """The section's HTML (module docstring)."""
    ch = report["change"]
    out = ["<section><h2>Regression explained</h2>",
           f"<p>{report['baseline_ms_per_token']:.2f} → {report['candidate_ms_per_token']:.2f} ms per output token "
           f"({report['change_pct']:+.1f}%; change {ch['point']:+.3f} ms, 95% CI {ch['low']:+.3f} .. "
           f"{ch['high']:+.3f}; {report['repeats']} paired repeats, profiled). A contributor is beyond noise "
           f"when its interval excludes zero and it is at least {report['min_effect']:.0%} of the baseline.{_family(report)}"
           "</p>"]  # fmt: skip
    if not report["contributors"]:
        out.append("<p><b>No component changed beyond noise.</b></p>")
    else:
        out.append("<table><tr><th>contributor</th><th>share</th><th>ms / output token</th><th>interval</th>"
                   "<th>operators that moved</th></tr>")  # fmt: skip
        for e in report["contributors"]:
            out.append(f"<tr><td>{escape(e['name'])}</td><td>{e['share']:.0%}</td><td>{e['contribution']:+.3f}</td>"
                       f"<td>{e['low']:+.3f} .. {e['high']:+.3f}</td><td>{_ops_cell(e)}</td></tr>")  # fmt: skip
        n = report["noise"]
        if n["count"]:
            out.append(f"<tr><td>{n['count']} component(s) within noise</td><td></td>"
                       f"<td>{n['contribution']:+.3f}</td><td></td><td></td></tr>")  # fmt: skip
        out.append("</table>")
    out.append(_bar_chart(report["contributors"], report["noise"]))
    comp = report["composition"]
    out.append("<h3>Step composition (mean per rep)</h3><table><tr><th></th><th>baseline</th><th>candidate</th></tr>")
    for key in comp["baseline"]:
        out.append(f"<tr><td>{escape(key)}</td><td>{comp['baseline'][key]:.3g}</td>"
                   f"<td>{comp['candidate'][key]:.3g}</td></tr>")  # fmt: skip
    out.append("</table>")
    phases = report.get("phases_per_step_ms")
    if phases:
        out.append("<h3>Engine phases (ms per step)</h3><table><tr><th></th><th>baseline</th><th>candidate</th></tr>")
        for key in phases["baseline"]:
            out.append(f"<tr><td>{escape(key)}</td><td>{phases['baseline'][key]:.3f}</td>"
                       f"<td>{phases['candidate'][key]:.3f}</td></tr>")  # fmt: skip
        out.append("</table>")
    out.append("</section>")
    return "\n".join(out)


def explain_page(report: dict[str, Any], title: str = "servelab-explain") -> str:
    """A standalone page holding `explain_section`."""
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{escape(title)}</title>"
            "<style>body{font-family:sans-serif;margin:2em}td,th{padding:2px 8px;text-align:left}"
            "table{border-collapse:collapse}tr:nth-child(even){background:#f4f4f4}</style></head><body>"
            f"<h1>{escape(title)}</h1>{explain_section(report)}</body></html>")  # fmt: skip


def write_outputs(report: dict[str, Any], out_dir: Path, title: str) -> tuple[Path, Path]:
    """explain.json and explain.html in `out_dir`; their paths."""
    import json

    out_dir.mkdir(parents=True, exist_ok=True)
    js, page = out_dir / "explain.json", out_dir / "explain.html"
    js.write_text(json.dumps(report, indent=2, default=float))
    page.write_text(explain_page(report, title))
    return js, page


def reps_from_run(run_dir: Path) -> dict[str, Any]:
    """A run folder's profiled steps as one explain rep (workloads/explain_probe.py's shape).

    Reads steps.csv and trace.json (a run with profiling on); keeps the steps the trace's active
    window covers. Operator groups are the kernel table's categories (gemm, attention, norm_act,
    ...: a run's trace has no module ranges); output tokens are counted as the sampled rows
    (requests per step); idle is not known (wall = the steps' time)."""
    import json

    import pandas as pd

    from profiling.kernel_table import kernel_table

    steps_csv, trace = run_dir / "steps.csv", run_dir / "trace.json"
    if not steps_csv.exists() or not trace.exists():
        raise FileNotFoundError(f"{run_dir}: --explain needs steps.csv and trace.json (a run with profiling on)")
    table = kernel_table(json.loads(trace.read_text()).get("traceEvents", []))
    table = table[(table["phase"] == "forward") & (table["category"] != "host")]
    frame = pd.read_csv(steps_csv)
    frame = frame[frame["step"].isin(set(table["step"]))]
    ops: dict[int, dict[str, list[float]]] = {}
    for (step, category, name), cell in table.groupby(["step", "category", "name"])["time_ms"]:
        ops.setdefault(int(step), {})[f"{category}|{name}"] = [float(cell.sum()), int(cell.size)]
    steps = []
    for row in frame.to_dict("records"):
        s = {"step": int(row["step"]), "tokens": int(row["num_prefill_tokens"] + row["num_decode_tokens"]),
             "prefill_tokens": int(row["num_prefill_tokens"]),
             "requests": int(row["num_prefill_reqs"] + row["num_decode_reqs"]),
             "preemptions": int(row.get("num_preemptions", 0)), "prefix_hits": int(row.get("prefix_cache_hits", 0)),
             **{p: float(row.get(f"{p}_time", 0.0)) for p in ("schedule", "prepare", "forward", "sample", "update")},
             "ops": ops.get(int(row["step"]), {})}  # fmt: skip
        s["other"] = max(float(row["step_time"]) - sum(s[p] for p in ("schedule", "prepare", "forward", "sample",
                                                                       "update")), 0.0)  # fmt: skip
        steps.append(s)
    if not steps:
        raise ValueError(f"{run_dir}: trace.json covers none of steps.csv's steps")
    return {"wall_s": float(frame["step_time"].sum()), "output_tokens": sum(s["requests"] for s in steps),
            "steps": steps}  # fmt: skip


SEGMENTS = 5  # a single run's pairs: the simultaneous intervals of 2 halves (t at 1 - 0.05/15, 1 df) hold anything


def explain_runs(a: list[Path], b: list[Path]) -> dict[str, Any]:
    """servelab-compare --explain: one rep per run folder, run i of A paired with run i of B;
    with one run a side, each run's profiled steps are split into up to five consecutive segments,
    segment k of A paired with segment k of B (within-run noise only: said in the report's notes)."""
    from analysis.explain import explain

    base, cand = [reps_from_run(p) for p in a], [reps_from_run(p) for p in b]
    notes = []
    n = min(len(base), len(cand))
    if n < 2:
        k = max(min(SEGMENTS, len(base[0]["steps"]) // 2, len(cand[0]["steps"]) // 2), 2)
        base, cand = _segments(base[0], k), _segments(cand[0], k)
        notes.append(f"one run a side: its profiled steps split in {k} consecutive segments; the intervals hold "
                     "within-run noise only")  # fmt: skip
    else:
        base, cand = base[:n], cand[:n]
    report = explain(base, cand, same_work=False)
    report["notes"] = notes
    return report


def _segments(rep: dict[str, Any], k: int) -> list[dict[str, Any]]:
    """`rep`'s steps in `k` consecutive parts of near-equal length, each a rep of its own."""
    steps = rep["steps"]
    bounds = [round(i * len(steps) / k) for i in range(k + 1)]
    parts = [steps[lo:hi] for lo, hi in zip(bounds, bounds[1:], strict=False) if hi > lo]
    return [{"wall_s": sum(s[p] for s in part for p in ("schedule", "prepare", "forward", "sample", "update", "other")),
             "output_tokens": sum(s["requests"] for s in part), "steps": part} for part in parts]  # fmt: skip

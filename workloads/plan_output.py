"""servelab-plan's outputs: the console table, and plan.csv / plan.json / plan.html.

plan.html is self-contained: the TTFT and TPOT statistic against the rate as inline SVG,
one line per configuration, the SLO as a dashed line, then the table of every run.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

COLUMNS = [
    "max_num_batched_tokens", "max_num_seqs", "rate", "time_scale", "requests", "completed",
    "request_throughput", "output_throughput", "mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms",
    "p99_tpot_ms", "request_goodput", "goodput_fraction", "mean_kv_usage", "max_kv_usage",
    "num_preemptions", "sim_s", "wall_s", "saturated", "meets_slo", "violations",
]  # fmt: skip


def render(rows: Sequence[dict[str, Any]], best: dict[str, Any] | None, plain: bool) -> None:
    cols = [("max_num_batched_tokens", "budget", "{:d}"), ("max_num_seqs", "seqs", "{:d}"),
            ("rate", "rate/s", "{:.4g}"), ("request_throughput", "req/s", "{:.3g}"),
            ("output_throughput", "tok/s", "{:.0f}"), ("mean_ttft_ms", "TTFT mean", "{:.1f}"),
            ("p99_ttft_ms", "TTFT p99", "{:.1f}"), ("mean_tpot_ms", "TPOT mean", "{:.2f}"),
            ("p99_tpot_ms", "TPOT p99", "{:.2f}"), ("request_goodput", "goodput/s", "{:.3g}"),
            ("mean_kv_usage", "KV mean", "{:.0%}"), ("max_kv_usage", "KV max", "{:.0%}"),
            ("num_preemptions", "preempt", "{:d}"), ("meets_slo", "SLO", "{}")]  # fmt: skip

    def cell(r: dict[str, Any], key: str, fmt: str) -> str:
        v = r[key]
        if v is None:
            return "-"
        if key == "meets_slo":
            return "ok" if v else "no"
        return fmt.format(int(v) if fmt == "{:d}" else v)

    body = [[cell(r, k, f) for k, _, f in cols] for r in rows]
    if not plain:
        try:
            import rich  # noqa: F401 - a declared dependency, but the plain table must not depend on it
        except ImportError:
            plain = True
    if plain:
        widths = [max(len(h), *(len(b[i]) for b in body)) for i, (_, h, _) in enumerate(cols)]
        print("  ".join(h.rjust(w) for (_, h, _), w in zip(cols, widths, strict=True)))
        for b in body:
            print("  ".join(c.rjust(w) for c, w in zip(b, widths, strict=True)))
    else:
        from rich.console import Console
        from rich.table import Table

        table = Table(title="servelab-plan")
        for _, h, _ in cols:
            table.add_column(h, justify="right")
        for r, b in zip(rows, body, strict=True):
            table.add_row(*b, style="bold green" if r is best else None)
        console = Console()
        if not console.is_terminal:  # piped or captured: do not squeeze the table into 80 columns
            console = Console(width=200)
        console.print(table)
    if best is None:
        print("best: no configuration met the SLOs at any evaluated rate")
    else:
        print(f"best: max_num_batched_tokens={best['max_num_batched_tokens']} max_num_seqs={best['max_num_seqs']} "
              f"at {best['rate']:.4g} req/s (output {best['output_throughput']:.0f} tok/s, "
              f"p99 TTFT {best['p99_ttft_ms']:.1f} ms, p99 TPOT {best['p99_tpot_ms']:.2f} ms)")  # fmt: skip


def pareto(rows: Sequence[dict[str, Any]], devices: int | None) -> list[dict[str, Any]]:
    """reports.pareto's points for the plan's runs: one per configuration and rate, labelled
    `budget B, seqs S @ R/s`; per device over the simulated tensor-parallel ranks."""
    import pandas as pd

    from reports.pareto import pareto_points

    if not rows:
        return []
    labels = [f"budget {r['max_num_batched_tokens']}, seqs {r['max_num_seqs']} @ {r['rate']:.4g}/s" for r in rows]
    df = pd.DataFrame(list(rows), columns=COLUMNS)
    points = pareto_points(df, labels, [devices] * len(rows) if devices else None)
    return [{k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in p.items()}
            for p in points.to_dict("records")]  # fmt: skip


def render_pareto(points: Sequence[dict[str, Any]]) -> None:
    """The front's points, fastest per user first (the console's short form of plan.html's)."""
    front = sorted((p for p in points if p["on_front"]), key=lambda p: -(p["output_tok_s_per_user"] or 0))
    print(f"pareto front ({len(front)} of {len(points)} runs): output tok/s per user / per instance")
    for p in front:
        print(f"  {p['config']}: {p['output_tok_s_per_user']:.1f} / {p['output_tok_s_per_instance']:.0f}")


def _pareto_html(points: Sequence[dict[str, Any]]) -> str:
    """The Pareto section of plan.html: the labelled plot (inline PNG) and the table."""
    if not points:
        return ""
    import pandas as pd

    from reports.page import render as render_png
    from reports.pareto import plot

    df = pd.DataFrame(list(points))
    fig = render_png(plot(df, "output tok/s per user against per instance"), "Pareto front", "")
    table = df.sort_values(["on_front", "output_tok_s_per_instance"], ascending=[False, False]).to_html(
        index=False, float_format=lambda v: f"{v:.4g}")
    return (f"<h2>Pareto front</h2><p>{int(df['on_front'].sum())} of {len(df)} runs on the front "
            "(per user: 1000 / mean TPOT).</p>"
            f"<img alt='Pareto front' src='data:image/png;base64,{fig.png_b64}'/>{table}")  # fmt: skip


def write(folder: Path, rows: Sequence[dict[str, Any]], out: dict[str, Any]) -> None:
    import pandas as pd

    folder.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(list(rows), columns=COLUMNS).to_csv(folder / "plan.csv", index=False)
    (folder / "plan.json").write_text(json.dumps(out, indent=2, default=str))
    (folder / "plan.html").write_text(report_html(rows, out))


_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf")


def _svg_curve(rows: Sequence[dict[str, Any]], key: str, title: str, limit: float | None) -> str:
    """One inline SVG: `key` against the rate, a polyline per (budget, seqs), log-free, 0-based."""
    w, h, pad = 520, 300, 48
    series: dict[tuple[int, int], list[tuple[float, float]]] = {}
    for r in rows:
        if r[key] is not None and math.isfinite(r[key]):
            series.setdefault((r["max_num_batched_tokens"], r["max_num_seqs"]), []).append(
                (r["rate"], r[key])
            )
    pts = [p for ps in series.values() for p in ps]
    if not pts:
        return f"<p>{title}: no data</p>"
    xmax = max(x for x, _ in pts) or 1.0
    ymax = max([y for _, y in pts] + ([limit] if limit else [])) or 1.0

    def xy(x: float, y: float) -> str:
        return f"{pad + (w - 2 * pad) * x / xmax:.1f},{h - pad - (h - 2 * pad) * min(y, ymax) / ymax:.1f}"

    parts = [f'<svg width="{w}" height="{h}" xmlns="http://www.w3.org/2000/svg" font-size="11">',
             f'<text x="{w / 2}" y="16" text-anchor="middle" font-weight="bold">{title}</text>',
             f'<line x1="{pad}" y1="{h - pad}" x2="{w - pad}" y2="{h - pad}" stroke="#000"/>',
             f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{h - pad}" stroke="#000"/>',
             f'<text x="{w / 2}" y="{h - 12}" text-anchor="middle">request rate (req/s), max {xmax:.4g}</text>',
             f'<text x="{pad - 4}" y="{pad - 6}" text-anchor="start">{ymax:.4g} ms</text>']  # fmt: skip
    if limit:
        a, b = xy(0, limit), xy(xmax, limit)
        parts.append(f'<polyline points="{a} {b}" stroke="#888" stroke-dasharray="5,4" fill="none"/>')
    for i, ((budget, seqs), ps) in enumerate(sorted(series.items())):
        color = _COLORS[i % len(_COLORS)]
        ps.sort()
        parts.append(f'<polyline points="{" ".join(xy(x, y) for x, y in ps)}" stroke="{color}" fill="none"/>')
        parts += [f'<circle cx="{xy(x, y).split(",")[0]}" cy="{xy(x, y).split(",")[1]}" r="3" fill="{color}"/>'
                  for x, y in ps]  # fmt: skip
        parts.append(
            f'<text x="{w - pad - 150}" y="{pad + 14 * i}" fill="{color}">budget {budget}, seqs {seqs}</text>'
        )
    parts.append("</svg>")
    return "\n".join(parts)


def report_html(rows: Sequence[dict[str, Any]], out: dict[str, Any]) -> str:
    """A self-contained page: the search curves, the table of every run, the Pareto front and
    the verified picks."""
    import html

    import pandas as pd

    from workloads.plan_verify import verify_html

    args, stat = out["args"], out["args"]["slo_stat"]
    curves = "".join(
        _svg_curve(rows, f"{stat}_{name}_ms" if stat in ("p99", "mean") else f"p99_{name}_ms",
                   f"{stat if stat in ('p99', 'mean') else 'p99'} {name.upper()} (ms)", args.get(f"slo_{name}_ms"))
        for name in ("ttft", "tpot")
    )  # fmt: skip
    best = out.get("best")
    best_line = ("no configuration met the SLOs" if best is None else
                 f"best: max_num_batched_tokens={best['max_num_batched_tokens']}, "
                 f"max_num_seqs={best['max_num_seqs']} at {best['rate']:.4g} req/s")  # fmt: skip
    if out.get("replicas") is not None:
        best_line += f"; {out['replicas']} replica(s) for {args['target_rate']:.4g} req/s"
    table = pd.DataFrame(list(rows), columns=COLUMNS).to_html(index=False, float_format=lambda v: f"{v:.4g}")
    parallel = f"TP={args['tp']}" + (", EP" if args.get("ep") else "")
    title = f"servelab-plan: {args['model']} on {args['tp']} x {args['hardware']} ({parallel})"
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            "<style>body{font-family:sans-serif;margin:2em} table{border-collapse:collapse;font-size:12px}"
            "td,th{border:1px solid #ccc;padding:2px 6px;text-align:right}</style></head><body>"
            f"<h1>{html.escape(title)}</h1><p>{html.escape(best_line)}</p>"
            f"<p>SLO: {html.escape(json.dumps(out['slo']))}</p>{curves}{table}"
            f"{_pareto_html(out.get('pareto') or [])}{verify_html(out.get('verify') or [])}</body></html>")  # fmt: skip



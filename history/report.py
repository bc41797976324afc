"""The history report: each series over commits, its change points and the gate's verdicts.

One self-contained HTML page (reports/page.py: matplotlib figures embedded as PNG): a table of
every change point first, then one figure per series: the value at each commit (the median of
its records), the level of each segment between change points as a line, each change point as a
dashed line labelled with its change, and the commits a paired gate judged marked by verdict
(a red cross: FAIL, a green dot: PASS).
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from history.changes import ChangePoint, Scan, Series
from reports.page import Section, guarded, html_table, new_figure, render, render_page

MAX_TICKS = 12


def changes_table(changes: list[ChangePoint]) -> pd.DataFrame:
    return pd.DataFrame([{
        "metric": c.series.metric, "machine": c.series.machine, "config": c.series.config_name or c.series.config,
        "commits": f"{c.last_before[:10]}..{c.first_after[:10]}", "change": f"{c.change:+.1%}",
        "interval": f"{c.interval[0]:+.1%} .. {c.interval[1]:+.1%}", "p": c.p_value, "kind": c.kind,
        "before": c.before, "after": c.after,
    } for c in changes])  # fmt: skip


def _series_figure(series: Series, changes: list[ChangePoint]) -> Section:
    x = list(range(len(series.points)))
    y = series.values
    fig, (ax,) = new_figure(9.0, 3.4)
    ax.plot(x, y, "o", ms=3, color="#4c72b0", label="commit (median of its records)")
    bounds = [0, *(c.index for c in changes), len(y)]
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        ax.hlines(y[a:b].mean(), a - 0.4, b - 0.6, color="#333333", lw=1.5)
    for c in changes:
        ax.axvline(c.index - 0.5, ls="--", color="#c44e52" if c.kind == "regression" else "#55a868", lw=1)
        ax.annotate(f"{c.change:+.1%}", (c.index - 0.5, 0.97), xycoords=("data", "axes fraction"), ha="left",
                    va="top", fontsize=8, xytext=(3, 0), textcoords="offset points")  # fmt: skip
    for verdict, marker, color in (("fail", "x", "#c44e52"), ("pass", ".", "#55a868")):
        idx = [i for i, p in enumerate(series.points) if p.verdict == verdict]
        if idx:
            ax.plot(idx, y[idx], marker, ms=9 if marker == "x" else 5, color=color, ls="none",
                    label=f"gate {verdict.upper()}")  # fmt: skip
    step = max(1, len(x) // MAX_TICKS)
    ax.set_xticks(x[::step], [series.points[i].commit[:7] for i in x[::step]], rotation=45, fontsize=7)
    ax.set_ylabel(series.key.metric)
    ax.legend(fontsize=7, loc="best")
    caption = (f"{len(x)} commits on {series.key.cpu_model or series.key.machine} (fingerprint {series.key.machine}), "
               f"config {series.key.config_name or series.key.config}; {series.direction} is better")  # fmt: skip
    sid = f"s-{series.key.machine}-{series.key.config}-{series.key.metric}"
    section = Section(sid, series.key.label(), figures=[render(fig, series.key.metric, caption)])
    if changes:
        section.tables.append(html_table(changes_table(changes)))
    return section


def build_history_report(result: Scan, out: Path, title: str = "Performance history") -> Path:
    """Writes the page to `out`; its path."""
    everything = result.all_changes()
    overview = Section("changes", "Change points",
                       intro="Every significant change point, most significant first; the commit range is where "
                       "the change is (`servelab-bisect` a range with unrecorded commits in it).")  # fmt: skip
    if everything:
        overview.tables.append(html_table(changes_table(everything)))
    else:
        overview.notes.append("No significant change point in any series.")
    single = sorted(s.key.label() for s in result.series if len(s.points) < 2)
    if single:  # a first record: nothing to draw yet, but the series exists
        overview.notes.append(f"{len(single)} series with one commit so far (drawn from the second on): "
                              + ", ".join(single))  # fmt: skip
    sections = [overview]
    for s in result.series:
        if len(s.points) >= 2:
            sections.append(guarded(_series_figure, f"s-{s.key.metric}", s.key.label())(s, result.changes[s.key]))
    out.parent.mkdir(parents=True, exist_ok=True)
    subtitle = f"{len(result.series)} series, {len(everything)} change point(s)"
    return render_page(title, subtitle, sections, out)

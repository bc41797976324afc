"""The Markdown summary CI shows: the gate's verdict, its table, and the history's top changes.

Written for `$GITHUB_STEP_SUMMARY` and a pull request comment (GitHub-flavoured Markdown) and a
GitLab merge request note alike: a verdict line, the gated metrics' table (regressions first),
then the most significant change points of the history, if a store is given.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from history.changes import ChangePoint


def _pct(x: Any) -> str:
    return "" if x is None else f"{float(x):+.1%}"


def gate_markdown(gate: Mapping[str, Any]) -> list[str]:
    checks = list(gate.get("checks", []))
    bad = [c["metric"] for c in checks if c.get("verdict") == "REGRESSION"]
    base = str(gate.get("baseline_commit", ""))[:12]
    icon = ":x:" if gate.get("verdict") == "fail" else ":white_check_mark:"
    head = (f"### {icon} Performance gate: {str(gate.get('verdict', '?')).upper()}"
            f" ({len(bad)} regression(s) in {len(checks)} metrics; {gate.get('pairs', '?')} pairs against `{base}`,"
            f" {float(gate.get('elapsed_s', 0)):.0f} s)")  # fmt: skip
    lines = [head, ""]
    if bad:
        lines += [f"Regressed: {', '.join(f'`{m}`' for m in bad)}", ""]
    lines += ["| metric | baseline | candidate | change | interval | verdict |", "|---|---|---|---|---|---|"]
    order = sorted(checks, key=lambda c: (c.get("verdict") != "REGRESSION", not (c.get("rule") or {}).get("gate", True)))
    for c in order:
        iv = c.get("interval")
        interval = f"{_pct(iv[0])} .. {_pct(iv[1])}" if iv else ""
        verdict = f"**{c['verdict']}**" if c.get("verdict") == "REGRESSION" else str(c.get("verdict", ""))
        lines.append(f"| `{c['metric']}` | {float(c['baseline']):.4g} | {float(c['candidate']):.4g} | "
                     f"{_pct(c.get('change'))} | {interval} | {verdict} |")  # fmt: skip
    return lines


def changes_markdown(changes: list[ChangePoint], top: int = 5) -> list[str]:
    lines = ["", "#### Change points in the history" + (f" (top {top})" if len(changes) > top else ""), ""]
    if not changes:
        return [*lines, "No significant change point."]
    lines += ["| metric | commits | change | interval | p | kind |", "|---|---|---|---|---|---|"]
    for c in changes[:top]:
        lines.append(f"| `{c.series.metric}` ({c.series.machine}) | `{c.last_before[:10]}..{c.first_after[:10]}` | "
                     f"{c.change:+.1%} | {c.interval[0]:+.1%} .. {c.interval[1]:+.1%} | {c.p_value:.3g} | "
                     f"{c.kind} |")  # fmt: skip
    return lines


def summary_markdown(gate: Mapping[str, Any] | None, changes: list[ChangePoint] | None, top: int = 5,
                     note: str = "") -> str:  # fmt: skip
    lines = gate_markdown(gate) if gate is not None else ["### Performance history", ""]
    if note:
        lines += [note]
    if changes is not None:
        lines += changes_markdown(changes, top)
    return "\n".join(lines) + "\n"

"""benchmarks/gate_power.py --summarize: one power table over the rows of several processes' files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _rows(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _summarize(*paths: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gate_power.py"), "--summarize", *map(str, paths)],
                          capture_output=True, text=True, cwd=ROOT, timeout=60)  # fmt: skip


def test_rows_of_two_files_make_one_table(tmp_path: Path) -> None:
    core0, core1 = tmp_path / "core0.jsonl", tmp_path / "core1.jsonl"
    _rows(core0, [{"slowdown": 0.0, "failed": False, "elapsed_s": 61.0, "cpu_change": -0.01, "pairs": 16, "generations": 8},
                  {"slowdown": 0.1, "failed": True, "elapsed_s": 70.0, "cpu_change": 0.11}])  # fmt: skip
    _rows(core1, [{"slowdown": 0.0, "failed": True, "elapsed_s": 65.0, "cpu_change": 0.03, "pairs": 10, "generations": 5},
                  {"slowdown": 0.1, "failed": False, "elapsed_s": 90.0, "cpu_change": 0.07}])  # fmt: skip
    out = _summarize(core0, core1)
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stdout.splitlines() if line.startswith("| ")]
    assert lines[1] == "| none (false alarms) | 2 | 1 | 50% | +1.0% | -1.0% .. +3.0% | 13 (6) | 65 s |"
    # rows written before the pairs and generations were kept (benchmarks/gate_power_2026-12-02.jsonl)
    assert lines[2] == "| 10% | 2 | 1 | 50% | +9.0% | +7.0% .. +11.0% | n/a | 90 s |"


def test_a_bad_file_is_one_line_not_a_traceback(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    out = _summarize(bad)
    assert out.returncode == 2
    assert "bad.jsonl:1: not a gate_power row" in out.stderr and "Traceback" not in out.stderr
    missing = _summarize(tmp_path / "missing.jsonl")
    assert missing.returncode == 2 and "cannot read" in missing.stderr

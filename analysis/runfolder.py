"""Run folder files: requests.csv, steps.csv, summary.json, the journal of finished requests.

Written by the workbench (workloads/), read by `reports/` (which reads only these files); the
format's writer and reader live here, below both. The schema is their contract. requests.csv
has one row per request with the columns of `REQUEST_COLUMNS` (times in s since the run
start, latencies in ms, empty cells where a value does not apply); `token_times` and
`itls_ms` are JSON list strings. `timing_source` says where the token times came from
("engine": engine step times, "chunks": chunk arrival); `server_ttft_ms` / `server_e2el_ms` are
the engine's arrival->first / last token and `front_end_ms` the client TTFT minus the engine's
(network + HTTP front end); `chunk_itls_ms` the gaps between content chunks on the client's clock
(vLLM's ITL; `itls_ms` holds the same gaps, `ttft_ms` / `tpot_ms` / `e2el_ms` and `end_s` are
vLLM's too) and `chunk_tokens` the output tokens of each chunk. `done_s` (response fully read) is one column beyond the
shared schema: it lets a summary be recomputed from the file alone.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from analysis.record import RequestRecord
from engine.seam import StepStats

REQUEST_COLUMNS = [
    "request_id", "is_warmup", "scheduled_s", "start_s", "first_token_s", "end_s", "done_s",
    "client_queue_ms", "lateness_ms", "ttft_ms", "tpot_ms", "e2el_ms", "prompt_tokens",
    "output_tokens", "finish_reason", "error", "server_queued_ms", "server_prefill_ms",
    "server_decode_ms", "token_times", "itls_ms", "group", "sent_prompt_tokens",
    "timing_source", "server_ttft_ms", "server_e2el_ms", "front_end_ms", "chunk_itls_ms", "chunk_tokens",
]
# External KV per request (engine targets with a kv_transfer connector; empty otherwise): prompt
# tokens loaded from the store, bytes loaded / saved, ms waiting for loads, ms spent saving.
KV_COLUMNS = ["kv_external_tokens", "kv_bytes_loaded", "kv_bytes_saved", "kv_load_wait_ms", "kv_save_ms"]
REQUEST_COLUMNS += KV_COLUMNS
# Derived per step: spec_acceptance_rate = accepted / draft tokens; spec_mean_accepted_length =
# 1 + accepted / requests verified with drafts (vLLM's mean acceptance length), empty without drafts.
# `members` (the requests of each step) goes to step_members.csv (analysis/step_members.py).
STEP_COLUMNS = [*(f for f in StepStats.__struct_fields__ if f != "members"), "kv_usage", "spec_acceptance_rate",
                "spec_mean_accepted_length"]  # fmt: skip
# Speculative decoding per request (in-process targets; empty for the others).
REQUEST_COLUMNS += ["spec_draft_tokens", "spec_accepted_tokens", "spec_acceptance_rate"]
# Sends repeated on a fresh connection after a kept-alive one was found closed (HTTP targets).
REQUEST_COLUMNS += ["reconnects"]


def _ms(v: float | None) -> float | None:
    return None if v is None else v * 1000.0


def request_row(r: RequestRecord) -> dict[str, Any]:
    """One requests.csv row; a failed request has empty latency fields."""
    return {
        "spec_draft_tokens": r.spec_draft_tokens, "spec_accepted_tokens": r.spec_accepted_tokens,
        "spec_acceptance_rate": _ratio(r.spec_accepted_tokens, r.spec_draft_tokens),
        "reconnects": r.reconnects,
        "request_id": r.request_id, "is_warmup": r.is_warmup, "scheduled_s": r.scheduled_s,
        "start_s": r.start_s, "first_token_s": r.first_token_s, "end_s": r.end_s, "done_s": r.done_s,
        "client_queue_ms": r.client_queue_s * 1000.0, "lateness_ms": r.lateness_s * 1000.0,
        "ttft_ms": _ms(r.ttft_s), "tpot_ms": _ms(r.tpot_s), "e2el_ms": _ms(r.e2el_s),
        "prompt_tokens": r.prompt_tokens, "output_tokens": r.output_tokens,
        "finish_reason": r.finish_reason, "error": r.error,
        "server_queued_ms": _ms(r.server_queued_s), "server_prefill_ms": _ms(r.server_prefill_s),
        "server_decode_ms": _ms(r.server_decode_s),
        "token_times": json.dumps(r.token_times if r.ok else []),
        "itls_ms": json.dumps([g * 1000.0 for g in r.itls_s]),
        "group": r.group, "sent_prompt_tokens": r.sent_prompt_tokens,
        **(r.kv or dict.fromkeys(KV_COLUMNS)),
        "timing_source": r.timing_source,
        "server_ttft_ms": _ms(r.server_ttft_s), "server_e2el_ms": _ms(r.server_e2el_s),
        "front_end_ms": _ms(r.front_end_s),
        "chunk_itls_ms": "" if r.chunk_itls_s is None else json.dumps([g * 1000.0 for g in r.chunk_itls_s]),
        "chunk_tokens": "" if r.chunk_tokens is None else json.dumps(r.chunk_tokens),
    }


def _ratio(num: int | None, den: int | None) -> float | None:
    return None if not den or num is None else num / den


JOURNAL = "requests.partial.jsonl"


class RequestJournal:
    """Appends each finished request's requests.csv row to <run>/requests.partial.jsonl as it
    completes (one JSON line, flushed), so a harness killed mid-run loses no finished request.
    `write_requests` removes the journal once requests.csv holds the same rows."""

    def __init__(self, run_dir: str | Path) -> None:
        self.path = Path(run_dir) / JOURNAL
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")

    def __call__(self, record: RequestRecord) -> None:
        self._file.write(json.dumps(request_row(record), default=_json_default) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def _json_default(v: Any) -> Any:
    return v.item() if isinstance(v, np.generic) else str(v)


def read_journal(run_dir: str | Path) -> pd.DataFrame | None:
    """The journal's rows as a requests.csv frame (a torn last line is skipped), or None."""
    path = Path(run_dir) / JOURNAL
    if not path.exists():
        return None
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # the line being written when the process died
    return pd.DataFrame(rows, columns=REQUEST_COLUMNS)


def requests_frame(records: Sequence[RequestRecord]) -> pd.DataFrame:
    return pd.DataFrame([request_row(r) for r in records], columns=REQUEST_COLUMNS)


def write_requests(run_dir: str | Path, records: Sequence[RequestRecord]) -> Path:
    path = Path(run_dir) / "requests.csv"
    path.parent.mkdir(parents=True, exist_ok=True)
    requests_frame(records).to_csv(path, index=False)
    (Path(run_dir) / JOURNAL).unlink(missing_ok=True)
    return path


def read_requests(run_dir: str | Path) -> pd.DataFrame:
    """requests.csv as a DataFrame (strings for text columns, '' for empty ones)."""
    df = pd.read_csv(Path(run_dir) / "requests.csv", dtype={"request_id": str, "group": str,
                                                            "error": str, "finish_reason": str})
    for col in ("group", "error", "finish_reason"):
        df[col] = df[col].fillna("")
    return df


def json_list(cell: Any) -> list[float]:
    """A JSON list stored in a CSV cell (token_times, itls_ms); [] when empty or bad."""
    if not isinstance(cell, str) or not cell.strip():
        return []
    try:
        return [float(x) for x in json.loads(cell)]
    except (ValueError, TypeError):
        return []


def _opt(v: Any) -> float | None:
    return None if v is None or (isinstance(v, float) and np.isnan(v)) else float(v) / 1000.0


def _count(v: Any) -> int:
    """An integer cell; 0 when empty (a folder written before the column existed)."""
    return 0 if v is None or (isinstance(v, float) and np.isnan(v)) else int(v)


def _ms_list(cell: Any) -> list[float] | None:
    if not isinstance(cell, str) or not cell:
        return None
    return [v / 1000.0 for v in json.loads(cell)]


def records_from_frame(df: pd.DataFrame) -> list[RequestRecord]:
    """Rebuild records from requests.csv rows (enough to recompute the summary)."""
    out = []
    for row in df.to_dict("records"):
        out.append(RequestRecord(
            request_id=row["request_id"], scheduled_s=float(row["scheduled_s"]), start_s=float(row["start_s"]),
            token_times=json.loads(row["token_times"]) if isinstance(row["token_times"], str) else [], done_s=float(row.get("done_s", row.get("end_s")) or 0.0),
            prompt_tokens=int(row["prompt_tokens"]), output_tokens=int(row["output_tokens"]),
            finish_reason=row["finish_reason"], error=row["error"], lateness_s=float(row["lateness_ms"]) / 1000.0,
            is_warmup=bool(row["is_warmup"]), group=row["group"],
            server_queued_s=_opt(row["server_queued_ms"]), server_prefill_s=_opt(row["server_prefill_ms"]),
            server_decode_s=_opt(row["server_decode_ms"]),
            sent_prompt_tokens=int(row.get("sent_prompt_tokens") or 0),
            timing_source=str(row.get("timing_source") or "chunks"),
            server_ttft_s=_opt(row.get("server_ttft_ms")), server_e2el_s=_opt(row.get("server_e2el_ms")),
            chunk_itls_s=_ms_list(row.get("chunk_itls_ms")),
            chunk_tokens=json.loads(row["chunk_tokens"]) if isinstance(row.get("chunk_tokens"), str) and row["chunk_tokens"] else None,
            reconnects=_count(row.get("reconnects")),
        ))
    return out


def steps_frame(steps: Sequence[StepStats], t0_wall: float) -> pd.DataFrame:
    """Engine steps with `time` rebased to seconds since the run start, plus kv_usage."""
    rows = []
    for s in steps:
        row = {f: getattr(s, f) for f in StepStats.__struct_fields__}
        row["num_accepted_tokens_per_pos"] = json.dumps(s.num_accepted_tokens_per_pos)
        row["time"] = s.time - t0_wall
        row["kv_usage"] = s.kv_usage
        row["spec_acceptance_rate"] = _ratio(s.num_accepted_tokens, s.num_draft_tokens)
        row["spec_mean_accepted_length"] = (
            1.0 + s.num_accepted_tokens / s.num_drafts if s.num_drafts else None
        )
        rows.append(row)
    return pd.DataFrame(rows, columns=STEP_COLUMNS)


def scraped_frame(rows: Sequence[dict[str, float]]) -> pd.DataFrame:
    """Scraped /metrics rows (time, num_running, num_waiting, kv_usage, ...), source='metrics'."""
    df = pd.DataFrame(list(rows))
    if df.empty:
        df = pd.DataFrame(columns=["time", "num_running", "num_waiting", "kv_usage"])
    df["source"] = "metrics"
    return df


def write_steps(run_dir: str | Path, frame: pd.DataFrame) -> Path:
    path = Path(run_dir) / "steps.csv"
    path.parent.mkdir(parents=True, exist_ok=True)
    frame.to_csv(path, index=False)
    return path


def read_steps(run_dir: str | Path) -> pd.DataFrame | None:
    path = Path(run_dir) / "steps.csv"
    return pd.read_csv(path) if path.exists() else None


def write_summary(run_dir: str | Path, summary: dict[str, Any]) -> Path:
    path = Path(run_dir) / "summary.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=2, sort_keys=False) + "\n", encoding="utf-8")
    return path


def read_summary(run_dir: str | Path) -> dict[str, Any]:
    return json.loads((Path(run_dir) / "summary.json").read_text(encoding="utf-8"))


def write_error(run_dir: str | Path, message: str) -> Path:
    """error.txt: why the run failed or stopped early (the other files stay valid); appends."""
    path = Path(run_dir) / "error.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as f:
        f.write(message.rstrip() + "\n")
    return path


def recover_partial(run_dir: str | Path, slo: dict[str, float | None] | None, reason: str) -> dict[str, Any] | None:
    """After an interrupted or killed run: requests.csv and summary.json (`partial: true`)
    from the journal of finished requests (and steps.csv when it was written). None when
    there is no journal, or a summary already exists."""
    from analysis.metrics import summarize

    run_dir = Path(run_dir)
    if (run_dir / "summary.json").exists():
        return None
    frame = read_journal(run_dir)
    if frame is None:
        return None
    for col in ("group", "error", "finish_reason"):
        frame[col] = frame[col].fillna("").astype(str)
    records = records_from_frame(frame)
    frame.to_csv(run_dir / "requests.csv", index=False)
    (run_dir / JOURNAL).unlink(missing_ok=True)
    summary = summarize(records, slo=slo, steps=read_steps(run_dir))
    summary["partial"] = True
    summary["stop_reason"] = reason
    write_summary(run_dir, summary)
    return summary

"""A recorded run folder's link to its history: `history.html` beside `report.html`.

When a run folder is recorded (`servelab-run ... run.history=URL`, or `servelab-history record
RUN`), the history of the series the run belongs to (every metric on this machine fingerprint under
this config digest) is written into the run folder as `history.html`: the history report
(history/report.py) limited to those series, as the store held them once this run was in it.
`history.json` beside it says where it came from (the store, with any password hidden; the run's
commit; how many series and change points), and the run's `report.html`, where the folder has one,
is written again: its header then links to the page (reports/run_report.py `history_link`).

Why in the run folder and not a link to a shared page: a run folder is copied, archived and uploaded
as a CI artifact on its own, and a PostgreSQL store has no page on disk; a page beside the report
goes wherever the report goes. It is a snapshot: `servelab-history report` draws the store as it is now.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path

from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

from history.changes import Settings, scan
from history.ingest import Record
from history.store import Store

PAGE = "history.html"
META = "history.json"


def shown_url(url: str) -> str:
    """The store's URL as a page may show it: a password is replaced by ***."""
    if "://" not in url:  # an SQLite file's path
        return url
    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return url


def link_run_history(store: Store, url: str, record: Record, run_dir: Path,
                     settings: Settings = Settings()) -> Path:  # fmt: skip
    """Writes `run_dir`/history.html and history.json for a run `record` just stored; rewrites the
    folder's report.html (if any) so that it links to them. Returns the page's path."""
    from history.report import build_history_report

    rows = store.measurements(machine=record.machine.fingerprint)
    rows = rows[rows["config_digest"] == record.config_digest]
    result = scan(rows, settings)
    changes = result.all_changes()
    sha = record.commit.sha[:12]
    page = build_history_report(result, run_dir / PAGE,
                                title=f"Performance history of run {run_dir.name} ({record.config_name or 'run'})")  # fmt: skip
    meta = {
        "report": PAGE, "store": shown_url(url), "commit": record.commit.sha, "dirty": record.commit.dirty,
        "machine": record.machine.fingerprint, "config_digest": record.config_digest,
        "config_name": record.config_name, "series": len(result.series), "change_points": len(changes),
        "regressions": sum(c.kind == "regression" for c in changes),
        "commits": max((len(s.points) for s in result.series), default=0),
        "written_at": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
    }  # fmt: skip
    (run_dir / META).write_text(json.dumps(meta, indent=2))
    if (run_dir / "report.html").is_file():
        from reports.run_report import build_report

        build_report(run_dir)
    print(f"history: {page}: {meta['series']} series of this config on this machine, {meta['change_points']} "
          f"change point(s); linked from the run report (commit {sha})")  # fmt: skip
    return page

"""The results store: runs and gates recorded in SQLite (default) or any SQLAlchemy database.

A URL with `://` is SQLAlchemy's (`postgresql+psycopg://user@host/db`, `sqlite:////abs/path.db`);
anything else is the path of an SQLite file, made with its folder where missing.

Durability, the two cases a CI fleet meets:
- a writer killed mid-record: one record is one transaction (the run row and all its
  measurements), so it is stored whole or not at all, and what was stored before stays;
- writers at once: SQLite in WAL mode with every transaction `BEGIN IMMEDIATE` (writers queue
  on the file lock, `busy_timeout` long enough to wait, instead of failing on a lock upgrade),
  PostgreSQL's row inserts under its own concurrency; the schema is migrated under a lock
  (history/schema.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import IntegrityError

from history.ingest import Record
from history.schema import MEASUREMENTS, RUNS, migrate

if TYPE_CHECKING:
    import pandas as pd

DEFAULT_URL = "runs/history.sqlite"
SQLITE_BUSY_TIMEOUT_S = 120  # a writer waits this long for another's transaction before failing


def normalise_url(url: str) -> str:
    if "://" in url:
        return url
    path = Path(url).expanduser().resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{path}"


def _sqlite_events(engine: Engine) -> None:
    """pysqlite's own transaction handling off (it would start transactions late and deferred):
    every transaction starts as BEGIN IMMEDIATE, the database in WAL mode (readers never block)."""

    @event.listens_for(engine, "connect")
    def _connect(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        cur.execute(f"PRAGMA busy_timeout = {SQLITE_BUSY_TIMEOUT_S * 1000}")
        cur.execute("PRAGMA journal_mode = WAL")
        cur.execute("PRAGMA foreign_keys = ON")
        cur.close()

    @event.listens_for(engine, "begin")
    def _begin(conn: Connection) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE")


def make_engine(url: str) -> Engine:
    url = normalise_url(url)
    if url.startswith("sqlite"):
        engine = sa.create_engine(url, connect_args={"timeout": SQLITE_BUSY_TIMEOUT_S})
        _sqlite_events(engine)
        return engine
    return sa.create_engine(url, pool_pre_ping=True)


class Store:
    """One results database; opening it migrates its schema to this code's version."""

    def __init__(self, url: str = DEFAULT_URL) -> None:
        self.url = normalise_url(url)
        self.engine = make_engine(self.url)
        with self.engine.begin() as conn:
            self.migrated_from, self.version = migrate(conn)

    def close(self) -> None:
        self.engine.dispose()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def transaction(self) -> Iterator[Connection]:
        """A connection in one transaction: committed when the block ends, rolled back if it raises."""
        with self.engine.begin() as conn:
            yield conn

    def add(self, record: Record) -> int | None:
        """Stores `record` in one transaction; its run id, or None when that input is already stored."""
        try:
            with self.transaction() as conn:
                return insert_record(conn, record)
        except IntegrityError:  # the same input recorded by another writer at the same moment
            return None

    def measurements(self, metric: str | None = None, machine: str | None = None,
                     since_time: float | None = None, include_dirty: bool = False) -> pd.DataFrame:  # fmt: skip
        """Every stored value with its run's context, one row per measurement."""
        import pandas as pd  # not for writers: a CI step that only records starts faster
        m, r = MEASUREMENTS, RUNS
        q = sa.select(
            m.c.run_id, m.c.commit_sha, m.c.commit_time, m.c.role, m.c.metric, m.c.value, m.c.change, m.c.ci_low,
            m.c.ci_high, m.c.verdict, m.c.direction, r.c.kind, r.c.machine_fp, r.c.cpu_model, r.c.config_digest,
            r.c.config_name, r.c.verdict.label("run_verdict"), r.c.recorded_at, r.c.branch,
            r.c.commit_sha.label("run_commit"), r.c.dirty,
        ).join(r, r.c.id == m.c.run_id)  # fmt: skip
        if metric is not None:
            q = q.where(m.c.metric == metric)
        if machine is not None:
            q = q.where(r.c.machine_fp.startswith(machine))
        if since_time is not None:
            q = q.where(m.c.commit_time >= since_time)
        if not include_dirty:
            q = q.where(sa.not_(r.c.dirty))
        with self.engine.connect() as conn:
            return pd.DataFrame(conn.execute(q.order_by(m.c.commit_time, r.c.recorded_at, m.c.id)).mappings().all(),
                                columns=list(q.selected_columns.keys()))  # fmt: skip

    def runs(self) -> pd.DataFrame:
        """Every stored run, oldest recorded first."""
        import pandas as pd
        with self.engine.connect() as conn:
            rows = conn.execute(sa.select(RUNS).order_by(RUNS.c.recorded_at, RUNS.c.id)).mappings().all()
        return pd.DataFrame(rows, columns=[c.name for c in RUNS.columns])


def insert_record(conn: Connection, record: Record) -> int | None:
    """The record's run row and measurements, in the caller's transaction; None if already there."""
    seen = conn.execute(sa.select(RUNS.c.id).where(RUNS.c.source_digest == record.source_digest)).first()
    if seen is not None:
        return None
    c, mach, v = record.commit, record.machine, record.versions
    inserted = conn.execute(RUNS.insert().values(
        source_digest=record.source_digest, kind=record.kind, recorded_at=record.recorded_at, commit_sha=c.sha,
        commit_time=c.time, commit_subject=c.subject, dirty=c.dirty, branch=record.branch,
        baseline_commit=record.baseline_commit, verdict=record.verdict, config_digest=record.config_digest,
        config_name=record.config_name, machine_fp=mach.fingerprint, cpu_model=mach.cpu_model,
        cpu_flags=" ".join(mach.cpu_flags), cores=mach.cores, arch=mach.arch,
        torch_version=v.get("torch", "unknown"), engine_version=v.get("engine", "unknown"),
        python_version=v.get("python", "unknown"), source_path=record.source_path,
    ))  # fmt: skip
    assert inserted.inserted_primary_key is not None
    run_id = inserted.inserted_primary_key[0]
    rows = [{"run_id": run_id, "commit_sha": x.commit, "commit_time": x.commit_time, "role": x.role,
             "metric": x.metric, "value": x.value, "change": x.change, "ci_low": x.ci_low, "ci_high": x.ci_high,
             "verdict": x.verdict, "direction": x.direction} for x in record.measurements]  # fmt: skip
    if rows:
        conn.execute(MEASUREMENTS.insert(), rows)
    return int(run_id)

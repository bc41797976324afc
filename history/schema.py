"""The store's tables and the migrations that build them, version by version.

The schema's version is one row of `servelab_schema`. Opening a store runs every migration
above that version, in order, in one transaction that also sets the new version, under a lock
(SQLite: the transaction is `BEGIN IMMEDIATE`; PostgreSQL: an advisory transaction lock), so
two processes opening a fresh store at once build it once and a failed migration leaves the
store at its old version. A store newer than this code is refused, never written.

Each migration spells out its own DDL (it must build the same tables whatever the current
model below says); `TABLES` is the current model, what queries use. To change the schema: add
a migration at the end of `MIGRATIONS` and change `TABLES` to match.

- v1: `runs` (one row per recorded run or gate: commit, machine, versions, verdict) and
  `measurements` (one row per metric value of a run, with the gate's change and interval).
- v2: `measurements.direction` (which way is better, from the gate's rules) and an index on
  the series key (machine fingerprint, config digest).
"""

from __future__ import annotations

from collections.abc import Callable

import sqlalchemy as sa
from sqlalchemy.engine import Connection

# An arbitrary constant: the PostgreSQL advisory lock that serialises migrations.
PG_MIGRATION_LOCK = 59_0001


def _runs_v1(md: sa.MetaData) -> sa.Table:
    return sa.Table(
        "runs", md,
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("source_digest", sa.String(64), nullable=False, unique=True),  # the same input twice: once
        sa.Column("kind", sa.String(16), nullable=False),  # "run" | "gate"
        sa.Column("recorded_at", sa.Float, nullable=False),  # epoch seconds, UTC
        sa.Column("commit_sha", sa.String(40), nullable=False),
        sa.Column("commit_time", sa.Float, nullable=False),
        sa.Column("commit_subject", sa.Text, nullable=False, default=""),
        sa.Column("dirty", sa.Boolean, nullable=False, default=False),
        sa.Column("branch", sa.String(200), nullable=False, default=""),
        sa.Column("baseline_commit", sa.String(40)),  # the gate's baseline
        sa.Column("verdict", sa.String(8)),  # "pass" | "fail" | None
        sa.Column("config_digest", sa.String(16), nullable=False),
        sa.Column("config_name", sa.String(200), nullable=False, default=""),
        sa.Column("machine_fp", sa.String(12), nullable=False),
        sa.Column("cpu_model", sa.Text, nullable=False),
        sa.Column("cpu_flags", sa.Text, nullable=False),
        sa.Column("cores", sa.Integer, nullable=False),
        sa.Column("arch", sa.String(32), nullable=False),
        sa.Column("torch_version", sa.String(64), nullable=False),
        sa.Column("engine_version", sa.String(64), nullable=False),
        sa.Column("python_version", sa.String(32), nullable=False),
        sa.Column("source_path", sa.Text, nullable=False, default=""),
    )  # fmt: skip


def _measurements_v1(md: sa.MetaData) -> sa.Table:
    return sa.Table(
        "measurements", md,
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("run_id", sa.Integer, sa.ForeignKey("runs.id", ondelete="CASCADE"), nullable=False),
        sa.Column("commit_sha", sa.String(40), nullable=False),  # the commit this value measured
        sa.Column("commit_time", sa.Float, nullable=False),
        sa.Column("role", sa.String(16), nullable=False),  # "run" | "candidate" | "baseline"
        sa.Column("metric", sa.String(100), nullable=False),
        sa.Column("value", sa.Float, nullable=False),
        sa.Column("change", sa.Float),  # the gate's paired change over its baseline
        sa.Column("ci_low", sa.Float),
        sa.Column("ci_high", sa.Float),
        sa.Column("verdict", sa.String(16)),  # the gate's verdict for this metric
        sa.Index("ix_measurements_metric_commit", "metric", "commit_sha"),
        sa.Index("ix_measurements_run", "run_id"),
    )  # fmt: skip


def _v1(conn: Connection) -> None:
    md = sa.MetaData()
    _runs_v1(md)
    _measurements_v1(md)
    md.create_all(conn)


def _v2(conn: Connection) -> None:
    conn.exec_driver_sql("ALTER TABLE measurements ADD COLUMN direction VARCHAR(8)")
    conn.exec_driver_sql("CREATE INDEX ix_runs_series ON runs (machine_fp, config_digest)")


MIGRATIONS: list[Callable[[Connection], None]] = [_v1, _v2]  # MIGRATIONS[i] builds version i + 1
LATEST = len(MIGRATIONS)

METADATA = sa.MetaData()
RUNS = _runs_v1(METADATA)
sa.Index("ix_runs_series", RUNS.c.machine_fp, RUNS.c.config_digest)
MEASUREMENTS = _measurements_v1(METADATA)
MEASUREMENTS.append_column(sa.Column("direction", sa.String(8)))  # v2: "lower" | "higher" | None

VERSION = sa.Table(
    "servelab_schema", sa.MetaData(),
    sa.Column("id", sa.Integer, primary_key=True),
    sa.Column("version", sa.Integer, nullable=False),
)  # fmt: skip


class SchemaTooNew(RuntimeError):
    pass


def current_version(conn: Connection) -> int:
    if not sa.inspect(conn).has_table(VERSION.name):
        return 0
    return int(conn.execute(sa.select(VERSION.c.version).where(VERSION.c.id == 1)).scalar() or 0)


def migrate(conn: Connection, target: int = LATEST) -> tuple[int, int]:
    """Brings the store in `conn`'s open transaction to `target`; (version before, after).
    The caller commits (one transaction for every step and the version row)."""
    if conn.dialect.name == "postgresql":
        conn.execute(sa.text("SELECT pg_advisory_xact_lock(:k)"), {"k": PG_MIGRATION_LOCK})
    before = current_version(conn)
    if before > LATEST:
        raise SchemaTooNew(f"the store's schema is v{before}, newer than this servelab's v{LATEST}: upgrade servelab")
    if before >= target:
        return before, before
    if before == 0:
        VERSION.create(conn, checkfirst=True)
        conn.execute(VERSION.insert().values(id=1, version=0))
    for version in range(before + 1, target + 1):
        MIGRATIONS[version - 1](conn)
    conn.execute(VERSION.update().where(VERSION.c.id == 1).values(version=target))
    return before, target

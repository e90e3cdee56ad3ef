"""Run-store files of work that runs on other hosts, merged into the one store that owns them.

Several hosts must never write one SQLite file over a shared filesystem. So a job that
runs elsewhere (a batch item on another host) gets a store file of its own
(:func:`job_store`: a fresh file seeded with the job's run), finds it through
``RAPYDLI_STORE_PATH``, and writes only there; when the job ends, the process that owns
the main store copies it in (:func:`merge`). Merging is idempotent: runs, artifacts and
records are keyed, and a metric row already present (same run, step, name and time) is
not added again, so a merge repeated after a crash adds nothing twice.
"""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path
from typing import TYPE_CHECKING

from rapydli.errors import StoreError

if TYPE_CHECKING:
    from rapydli.experiments.store.runstore import RunStore


def job_store(store: RunStore, run_id: str, path: str | os.PathLike[str]) -> Path:
    """Create ``path`` as an empty store of the same schema holding a copy of run ``run_id`` (and its tracker links).

    The job's process opens it (``RAPYDLI_STORE_PATH=path``) and records its run there.
    """
    from rapydli.experiments.store.runstore import MIGRATIONS, SCHEMA_VERSION

    path = Path(path)
    for stale in (path, path.with_name(path.name + "-journal")):
        stale.unlink(missing_ok=True)
    row = store._read("SELECT * FROM runs WHERE id = ?", (run_id,))
    if not row:
        raise StoreError(f"no run {run_id!r} in {store.path} to hand to a job")
    conn = sqlite3.connect(str(path), isolation_level=None)
    try:
        conn.execute("PRAGMA journal_mode = DELETE")  # one writer (the job), maybe on a network filesystem
        conn.execute("BEGIN")
        for script in MIGRATIONS:
            for statement in script.split(";"):
                if statement.strip():
                    conn.execute(statement)
        conn.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
        conn.execute("INSERT INTO schema_version VALUES (?)", (SCHEMA_VERSION,))
        conn.execute(f"INSERT INTO runs VALUES ({', '.join('?' * len(row[0]))})", tuple(row[0]))
        for record in store._read("SELECT * FROM records WHERE run_id = ? AND name LIKE 'tracker.%'", (run_id,)):
            conn.execute(
                f"INSERT INTO records VALUES ({', '.join('?' * len(record))})", tuple(record)
            )  # its tracker runs' links
        conn.execute("COMMIT")
    finally:
        conn.close()
    return path


def merge(store: RunStore, path: str | os.PathLike[str]) -> dict[str, int]:
    """Copy the runs, metrics, artifacts and records of job store ``path`` into ``store``.

    One transaction; safe to repeat. Returns the number of rows added or updated per table.
    """
    from rapydli.experiments.store.runstore import SCHEMA_VERSION

    path = Path(path)
    if not path.exists():
        raise StoreError(f"no job store {path} to merge")
    counts: dict[str, int] = {}

    def copy(conn: sqlite3.Connection) -> None:
        version = conn.execute("SELECT version FROM job.schema_version").fetchone()
        if version is None or version[0] != SCHEMA_VERSION:
            raise StoreError(f"job store {path} has schema version {version and version[0]}, not {SCHEMA_VERSION}")
        for table in ("runs", "artifacts", "records"):
            counts[table] = conn.execute(f"INSERT OR REPLACE INTO main.{table} SELECT * FROM job.{table}").rowcount
        counts["metrics"] = conn.execute(
            "INSERT INTO main.metrics (run_id, step, name, value, time)"
            " SELECT j.run_id, j.step, j.name, j.value, j.time FROM job.metrics j"
            " WHERE NOT EXISTS (SELECT 1 FROM main.metrics m WHERE m.run_id = j.run_id AND m.step = j.step"
            " AND m.name = j.name AND m.time = j.time) ORDER BY j.seq"
        ).rowcount

    with store._lock:
        try:
            store._conn.execute("ATTACH DATABASE ? AS job", (str(path),))
        except sqlite3.Error as exc:
            raise StoreError(f"cannot read job store {path}: {exc}") from exc
        try:
            store._write(copy)
        finally:
            store._conn.execute("DETACH DATABASE job")
    return counts

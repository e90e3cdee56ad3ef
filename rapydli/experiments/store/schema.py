"""The run store's SQLite schema: the migrations that build it, one version at a time.

:data:`MIGRATIONS` ``[i]`` moves a store from schema version ``i`` to ``i + 1``;
:class:`~rapydli.experiments.store.runstore.RunStore` applies the ones a file lacks when it opens
it, and :mod:`rapydli.experiments.store.merge` builds a job's store with all of them.
"""

from __future__ import annotations

# Each entry moves the schema from version i to i + 1; append, never edit.
MIGRATIONS: list[str] = [
    """
    CREATE TABLE runs (
        id TEXT PRIMARY KEY,
        kind TEXT NOT NULL,
        name TEXT NOT NULL,
        parent TEXT,
        params TEXT NOT NULL,
        status TEXT NOT NULL,
        error TEXT,
        seed INTEGER,
        world_size INTEGER NOT NULL DEFAULT 1,
        started REAL NOT NULL,
        ended REAL,
        heartbeat REAL NOT NULL,
        host TEXT NOT NULL,
        pid INTEGER NOT NULL,
        pid_started REAL,
        cwd TEXT,
        git_commit TEXT,
        versions TEXT NOT NULL
    );
    CREATE INDEX runs_kind ON runs(kind, started);
    CREATE INDEX runs_status ON runs(status);
    CREATE INDEX runs_parent ON runs(parent);
    CREATE TABLE metrics (
        seq INTEGER PRIMARY KEY AUTOINCREMENT,
        run_id TEXT NOT NULL REFERENCES runs(id),
        step INTEGER NOT NULL,
        name TEXT NOT NULL,
        value REAL,
        time REAL NOT NULL
    );
    CREATE INDEX metrics_run ON metrics(run_id, seq);
    CREATE TABLE artifacts (
        run_id TEXT NOT NULL REFERENCES runs(id),
        path TEXT NOT NULL,
        kind TEXT NOT NULL,
        time REAL NOT NULL,
        PRIMARY KEY (run_id, path)
    );
    CREATE TABLE records (
        run_id TEXT NOT NULL REFERENCES runs(id),
        name TEXT NOT NULL,
        type TEXT NOT NULL,
        value TEXT NOT NULL,
        time REAL NOT NULL,
        PRIMARY KEY (run_id, name)
    );
    """,
    # 2: a free-text note per run and any number of tags (rapydli.experiments.store.annotations)
    """
    ALTER TABLE runs ADD COLUMN note TEXT;
    CREATE TABLE tags (
        run_id TEXT NOT NULL REFERENCES runs(id),
        tag TEXT NOT NULL,
        time REAL NOT NULL,
        PRIMARY KEY (run_id, tag)
    );
    CREATE INDEX tags_tag ON tags(tag)
    """,
]
SCHEMA_VERSION = len(MIGRATIONS)

"""The run store: every train, sweep, trial, scaling, batch and tune run, in SQLite.

One file, ``$RAPYDLI_HOME/runs.db`` (default ``~/.rapydli/runs.db``; ``RAPYDLI_STORE_PATH``
names another), in WAL mode with a busy timeout, so several processes of this host (engines,
batch items, the notebook, the REST server) write at once and lose nothing: every write is
one short ``BEGIN IMMEDIATE`` transaction. On a network filesystem the file is opened with a
rollback journal instead (:mod:`rapydli.experiments.store.files`); work on other hosts writes its
own file, merged by the owner (:mod:`rapydli.experiments.store.merge`).
The schema carries a version number; the migrations of :mod:`rapydli.experiments.store.schema`
bring an older file up to date on open. ``RAPYDLI_STORE=off`` disables recording
(:func:`open_store` returns ``None``).

A run records what is needed to compare and repeat it: kind, name, parent, parameters
(JSON), seed, world size, status, error text, start/end/heartbeat times, host, pid, the
git commit of the working directory and the versions of python, torch, mpi4py, the MPI
library and rapydli; then metric rows ``(step, name, value)``, artifact paths and
recorded values (:func:`rapydli.record`).

A process that dies leaves its run ``running``; the next :func:`open_store` marks it
``interrupted`` when its pid is gone (same host) or its heartbeat is older than
``RAPYDLI_HEARTBEAT_TIMEOUT`` seconds (default 900, other hosts).

Examples
--------
>>> store = open_store()
>>> run_id = store.create_run("train", "mlp", {"lr": 0.1}, seed=0)
>>> store.log_metrics(run_id, [(1, "loss", 0.9), (2, "loss", 0.7)])
>>> store.finish_run(run_id)
>>> store.get_run(run_id)["status"]
'finished'
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
import sqlite3
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from rapydli.cluster.processes import alive, started_at
from rapydli.errors import ConfigError, NotFoundError, RapydliWarning, StoreError
from rapydli.experiments.store.annotations import RunAnnotations
from rapydli.experiments.store.files import journal_mode
from rapydli.experiments.store.provenance import git_commit, versions
from rapydli.experiments.store.schema import MIGRATIONS, SCHEMA_VERSION
from rapydli.paths import home, private_file
from rapydli.settings import settings

KINDS = ("train", "sweep", "trial", "scaling", "batch", "tune")
#: ``pruned``: a sweep's trial stopped early by the pruner. The schema does not restrict
#: statuses, so adding one needs no migration.
STATUSES = ("running", "finished", "failed", "interrupted", "pruned")

_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")
_BUSY_TIMEOUT_MS = 60_000


def store_enabled() -> bool:
    """False when ``RAPYDLI_STORE`` is ``off`` (or ``0``/``false``/``no``)."""
    return settings().store


def validate_run_id(run_id: object) -> str:
    """Return ``run_id`` if it is a safe id (letters, digits, ``_``, ``-``), else raise NotFoundError."""
    if not isinstance(run_id, str) or not _ID_RE.match(run_id):
        raise NotFoundError(f"no run {run_id!r}: run ids are 1-64 letters, digits, '_' or '-'")
    return run_id


def _now() -> float:
    return time.time()


def _json_default(value: Any) -> Any:
    item = getattr(value, "item", None)  # numpy / torch scalars
    if callable(item):
        return item()
    if isinstance(value, (set, tuple)):
        return list(value)
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def to_json(value: Any) -> str:
    """JSON text of ``value`` (numpy scalars and paths allowed); ConfigError if it cannot be stored."""
    try:
        return json.dumps(value, default=_json_default, sort_keys=True)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"value cannot be stored as JSON: {exc}") from exc


class RunStore(RunAnnotations):
    """A connection to the run store. Thread-safe; open one per process with :func:`open_store`.

    Parameters
    ----------
    path
        SQLite file; created (with its folder) if missing.
    detect_interrupted
        Mark ``running`` runs whose process is gone as ``interrupted`` on open.
    """

    def __init__(self, path: str | os.PathLike[str], *, detect_interrupted: bool = True) -> None:
        self.path = Path(path)
        try:
            private_file(self.path)  # 0600, its -wal and -shm too, also in a folder others share
            #: ``WAL``, or ``DELETE`` (rollback journal) where the directory is on a network filesystem
            self.journal_mode, self.filesystem = journal_mode(self.path.parent)
            self._conn = sqlite3.connect(
                str(self.path), timeout=_BUSY_TIMEOUT_MS / 1000, isolation_level=None, check_same_thread=False
            )
        except (OSError, sqlite3.Error) as exc:
            raise StoreError(f"cannot open the run store {self.path}: {exc}") from exc
        self._conn.row_factory = sqlite3.Row
        self._lock = threading.RLock()
        self._host = socket.gethostname()
        try:
            self._conn.execute(f"PRAGMA busy_timeout = {_BUSY_TIMEOUT_MS}")
            self._conn.execute(f"PRAGMA journal_mode = {self.journal_mode}")
            self._conn.execute("PRAGMA synchronous = NORMAL")
            self._migrate()
        except sqlite3.DatabaseError as exc:
            raise StoreError(f"the run store {self.path} is unreadable: {exc}") from exc
        if self.journal_mode != "WAL":
            warnings.warn(
                f"the run store {self.path} is on a network filesystem ({self.filesystem}), where SQLite's WAL mode is "
                "unsafe: it is opened with a rollback journal (slower, one writer at a time); set RAPYDLI_HOME to "
                "local disk for speed",
                RapydliWarning,
                stacklevel=3,
            )
        if detect_interrupted:
            self.mark_interrupted()

    # -- plumbing -------------------------------------------------------------------
    def _write(self, fn: Callable[[sqlite3.Connection], Any]) -> Any:
        """Run ``fn(conn)`` in one BEGIN IMMEDIATE transaction (retried while the file is locked).

        A write cut short between its BEGIN and its COMMIT (a Ctrl-C lands anywhere in the
        notebook's thread) is rolled back here or by the next write: its caller saw it fail,
        and the connection never stays inside a transaction that blocks every later write.
        """
        deadline = time.monotonic() + _BUSY_TIMEOUT_MS / 1000
        with self._lock:
            if self._conn.in_transaction:  # an earlier write interrupted before its COMMIT or ROLLBACK ran
                self._conn.execute("ROLLBACK")
            while True:
                try:
                    self._conn.execute("BEGIN IMMEDIATE")
                except sqlite3.OperationalError as exc:
                    if "locked" in str(exc) and time.monotonic() < deadline:
                        time.sleep(0.05)
                        continue
                    raise StoreError(f"run store {self.path}: {exc}") from exc
                try:
                    result = fn(self._conn)
                    self._conn.execute("COMMIT")
                except BaseException:
                    if self._conn.in_transaction:
                        self._conn.execute("ROLLBACK")
                    raise
                return result

    def _read(self, sql: str, args: Iterable[Any] = ()) -> list[sqlite3.Row]:
        with self._lock:
            return self._conn.execute(sql, tuple(args)).fetchall()

    def _migrate(self) -> None:
        def apply(conn: sqlite3.Connection) -> None:
            conn.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
            row = conn.execute("SELECT version FROM schema_version").fetchone()
            current = row[0] if row else 0
            if current > SCHEMA_VERSION:
                raise StoreError(
                    f"the run store {self.path} has schema version {current}, newer than this "
                    f"rapydli understands ({SCHEMA_VERSION}); upgrade rapydli"
                )
            for script in MIGRATIONS[current:]:
                for statement in script.split(";"):
                    if statement.strip():
                        conn.execute(statement)
            if row is None:
                conn.execute("INSERT INTO schema_version VALUES (?)", (SCHEMA_VERSION,))
            else:
                conn.execute("UPDATE schema_version SET version = ?", (SCHEMA_VERSION,))

        self._write(apply)

    @property
    def schema_version(self) -> int:
        """The schema version of the open file."""
        return int(self._read("SELECT version FROM schema_version")[0][0])

    def close(self) -> None:
        """Close the connection."""
        with self._lock:
            self._conn.close()

    # -- writing --------------------------------------------------------------------
    def create_run(
        self,
        kind: str,
        name: str,
        params: Mapping[str, Any],
        *,
        parent: str | None = None,
        world_size: int = 1,
        seed: int | None = None,
    ) -> str:
        """Record a new ``running`` run and return its id.

        Parameters
        ----------
        kind
            One of ``train``, ``sweep``, ``trial``, ``scaling``, ``batch``, ``tune``.
        name
            Human-readable name (model or notebook name).
        params
            JSON-serialisable parameters, enough to repeat the run.
        parent
            Id of the enclosing run (a trial's sweep, a batch item's batch). Default: the
            ``RAPYDLI_PARENT_RUN`` environment variable, which a batch sets for its items.
        world_size, seed
            Number of ranks, and the seed.

        Also records host, pid, cwd, git commit, versions and the start time.
        """
        if kind not in KINDS:
            raise ConfigError(f"run kind must be one of {', '.join(KINDS)}; got {kind!r}")
        if parent is None:
            parent = settings().parent_run
        if parent is not None:
            validate_run_id(parent)
        params_json = to_json(dict(params))
        run_id = uuid.uuid4().hex[:12]
        now = _now()
        pid = os.getpid()
        row = (
            run_id, kind, str(name), parent, params_json, "running", None,
            None if seed is None else int(seed), int(world_size), now, None, now,
            self._host, pid, started_at(pid), os.getcwd(), git_commit(), to_json(versions()),
        )  # fmt: skip
        self._write(
            lambda conn: conn.execute(
                "INSERT INTO runs (id, kind, name, parent, params, status, error, seed, world_size, started,"
                " ended, heartbeat, host, pid, pid_started, cwd, git_commit, versions)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                row,
            )
        )
        _set_current_run(run_id)
        return run_id

    def log_metrics(self, run_id: str, rows: Iterable[tuple[int, str, float]]) -> None:
        """Append metric rows ``(step, name, value)`` and refresh the run's heartbeat."""
        validate_run_id(run_id)
        now = _now()
        data = [(run_id, int(step), str(name), _as_float(value), now) for step, name, value in rows]
        if not data:
            return

        def write(conn: sqlite3.Connection) -> None:
            conn.executemany("INSERT INTO metrics (run_id, step, name, value, time) VALUES (?, ?, ?, ?, ?)", data)
            conn.execute("UPDATE runs SET heartbeat = ? WHERE id = ?", (now, run_id))

        self._write(write)

    def heartbeat(self, run_id: str) -> None:
        """Tell the store the run's process is still alive."""
        validate_run_id(run_id)
        self._write(lambda conn: conn.execute("UPDATE runs SET heartbeat = ? WHERE id = ?", (_now(), run_id)))

    def add_artifact(self, run_id: str, path: str | os.PathLike[str], kind: str) -> None:
        """Attach a file (output notebook, figure, checkpoint, report) to a run; ``kind`` is free text."""
        validate_run_id(run_id)
        self._write(
            lambda conn: conn.execute(
                "INSERT OR REPLACE INTO artifacts (run_id, path, kind, time) VALUES (?, ?, ?, ?)",
                (run_id, str(Path(path).resolve()), str(kind), _now()),
            )
        )

    def add_record(self, run_id: str, name: str, type_: str, value: Any) -> None:
        """Store a recorded value (:func:`rapydli.record`): ``type_`` is scalar, table, figure or json."""
        validate_run_id(run_id)
        text = to_json(value)
        self._write(
            lambda conn: conn.execute(
                "INSERT OR REPLACE INTO records (run_id, name, type, value, time) VALUES (?, ?, ?, ?, ?)",
                (run_id, str(name), str(type_), text, _now()),
            )
        )

    def finish_run(self, run_id: str, status: str = "finished", error: str | None = None) -> None:
        """End a run with ``status`` finished, failed, interrupted or pruned (and the error text, if any)."""
        validate_run_id(run_id)
        if status not in STATUSES or status == "running":
            raise ConfigError(f"finish status must be finished, failed, interrupted or pruned; got {status!r}")
        now = _now()

        def write(conn: sqlite3.Connection) -> None:
            cur = conn.execute(
                "UPDATE runs SET status = ?, error = ?, ended = ?, heartbeat = ? WHERE id = ?",
                (status, error, now, now, run_id),
            )
            if cur.rowcount == 0:
                raise NotFoundError(f"no run {run_id!r} in {self.path}")

        self._write(write)

    def mark_interrupted(self, stale_after: float | None = None) -> list[str]:
        """Mark ``running`` runs whose process is gone as ``interrupted``; return their ids.

        On this host a run is gone when its pid no longer exists (or was reused). On other
        hosts it is gone when its heartbeat is older than ``stale_after`` seconds (default
        ``RAPYDLI_HEARTBEAT_TIMEOUT`` or 900).
        """
        if stale_after is None:
            stale_after = settings().heartbeat_timeout_s
        now = _now()
        gone = []
        for row in self._read("SELECT id, host, pid, pid_started, heartbeat FROM runs WHERE status = 'running'"):
            if row["host"] == self._host:
                dead = alive(row["pid"], row["pid_started"]) is None
            else:
                dead = now - row["heartbeat"] > stale_after
            if dead:
                gone.append(row["id"])
        if gone:

            def write(conn: sqlite3.Connection) -> None:
                conn.executemany(
                    "UPDATE runs SET status = 'interrupted', ended = heartbeat,"
                    " error = COALESCE(error, 'the process running it stopped without finishing it')"
                    " WHERE id = ? AND status = 'running'",
                    [(run_id,) for run_id in gone],
                )

            self._write(write)
        return gone

    # -- reading --------------------------------------------------------------------
    def list_runs(
        self,
        kind: str | None = None,
        status: str | None = None,
        limit: int | None = None,
        offset: int = 0,
        *,
        parent: str | None = None,
    ) -> tuple[list[dict[str, Any]], int]:
        """Runs newest first, as dicts (see :meth:`get_run`), and the total count matching the filters."""
        if kind is not None and kind not in KINDS:
            raise ConfigError(f"kind must be one of {', '.join(KINDS)}; got {kind!r}")
        if status is not None and status not in STATUSES:
            raise ConfigError(f"status must be one of {', '.join(STATUSES)}; got {status!r}")
        where, args = [], []
        for column, value in (("kind", kind), ("status", status), ("parent", parent)):
            if value is not None:
                where.append(f"{column} = ?")
                args.append(value)
        clause = f" WHERE {' AND '.join(where)}" if where else ""
        total = self._read(f"SELECT COUNT(*) FROM runs{clause}", args)[0][0]
        page = f" LIMIT {int(limit)} OFFSET {int(offset)}" if limit is not None else f" LIMIT -1 OFFSET {int(offset)}"
        rows = self._read(f"SELECT * FROM runs{clause} ORDER BY started DESC, rowid DESC{page}", args)
        return [_run_dict(row) for row in rows], int(total)

    def get_run(self, run_id: str) -> dict[str, Any]:
        """One run as a dict: id, kind, name, parent, params, status, error, seed, world_size,
        started/ended/heartbeat (epoch seconds), duration, host, pid, cwd, git_commit, versions.

        Raises :class:`NotFoundError` for an unknown or malformed id.
        """
        validate_run_id(run_id)
        rows = self._read("SELECT * FROM runs WHERE id = ?", (run_id,))
        if not rows:
            raise NotFoundError(f"no run {run_id!r} in {self.path}")
        return _run_dict(rows[0])

    def resolve(self, prefix: str) -> str:
        """The id of the one run whose id starts with ``prefix`` (for the command line)."""
        validate_run_id(prefix)
        if self._read("SELECT 1 FROM runs WHERE id = ?", (prefix,)):
            return prefix
        rows = self._read("SELECT id FROM runs WHERE id >= ? AND id < ? LIMIT 2", (prefix, prefix + "\U0010ffff"))
        if len(rows) == 1:
            return rows[0][0]
        if not rows:
            raise NotFoundError(f"no run {prefix!r} in {self.path}")
        raise NotFoundError(f"run id prefix {prefix!r} is ambiguous; give more characters")

    def delete_runs(self, run_ids: Iterable[str]) -> list[dict[str, Any]]:
        """Remove runs and everything recorded of them (metrics, records, artifacts' entries, tags),
        their children with them (a sweep's trials, a scaling study's points); the runs removed
        (as :meth:`get_run` gives them, with ``model_dir``: where the run kept its trained model, or None).

        Files are not touched here (``rapydli runs delete`` removes the models the runs kept).

        Raises
        ------
        ConfigError
            A run (or a child) still ``running``: it is stopped first, or marked interrupted.
        NotFoundError
            An unknown id.
        """
        found: dict[str, dict[str, Any]] = {}
        todo = [self.get_run(run_id) for run_id in run_ids]
        while todo:
            run = todo.pop()
            if run["id"] in found:
                continue
            kept = self.records(run["id"]).get("model", {}).get("value") or {}
            found[run["id"]] = {**run, "model_dir": kept.get("directory")}
            todo.extend(self.list_runs(parent=run["id"])[0])
        running = [run_id for run_id, run in found.items() if run["status"] == "running"]
        if running:
            raise ConfigError(
                f"run {', '.join(running)} is running: stop it first (a run whose process died is marked interrupted "
                "when `rapydli runs list` looks)"
            )
        ids = list(found)

        def write(conn: sqlite3.Connection) -> None:
            marks = ", ".join("?" * len(ids))
            for table in ("metrics", "records", "artifacts", "tags"):
                conn.execute(f"DELETE FROM {table} WHERE run_id IN ({marks})", ids)
            conn.execute(f"DELETE FROM runs WHERE id IN ({marks})", ids)

        if ids:
            self._write(write)
        return list(found.values())

    def metrics(self, run_id: str, since: int | None = None) -> list[dict[str, Any]]:
        """Metric rows ``{seq, step, name, value, time}`` in the order logged.

        ``since`` is a cursor: only rows with ``seq > since`` are returned, so a poller
        passes the last ``seq`` it saw.
        """
        validate_run_id(run_id)
        rows = self._read(
            "SELECT seq, step, name, value, time FROM metrics WHERE run_id = ? AND seq > ? ORDER BY seq",
            (run_id, -1 if since is None else int(since)),
        )
        return [dict(row) for row in rows]

    def artifacts(self, run_id: str) -> list[dict[str, Any]]:
        """Artifacts ``{path, kind, time}`` of a run."""
        validate_run_id(run_id)
        rows = self._read("SELECT path, kind, time FROM artifacts WHERE run_id = ? ORDER BY time", (run_id,))
        return [dict(row) for row in rows]

    def records(self, run_id: str) -> dict[str, dict[str, Any]]:
        """Recorded values by name: ``{name: {"type": ..., "value": ...}}``."""
        validate_run_id(run_id)
        rows = self._read("SELECT name, type, value FROM records WHERE run_id = ? ORDER BY time", (run_id,))
        return {row["name"]: {"type": row["type"], "value": json.loads(row["value"])} for row in rows}

    def final_metrics(self, run_id: str) -> dict[str, float]:
        """Last value of every metric, plus every scalar record."""
        validate_run_id(run_id)
        rows = self._read(
            "SELECT name, value FROM metrics WHERE seq IN (SELECT MAX(seq) FROM metrics WHERE run_id = ? GROUP BY name)",
            (run_id,),
        )
        final = {row["name"]: row["value"] for row in rows}
        for name, rec in self.records(run_id).items():
            if rec["type"] == "scalar":
                final[name] = rec["value"]
        return final


def _as_float(value: Any) -> float | None:
    number = float(value)
    return None if math.isnan(number) else number


def _run_dict(row: sqlite3.Row) -> dict[str, Any]:
    run = dict(row)
    run["params"] = json.loads(run["params"])
    run["versions"] = json.loads(run["versions"])
    run.pop("pid_started", None)
    run["duration"] = None if run["ended"] is None else run["ended"] - run["started"]
    return run


# -- process-wide access -------------------------------------------------------------
_stores: dict[tuple[int, str], RunStore] = {}
_current: dict[int, str] = {}
_open_lock = threading.Lock()


def open_store(path: str | os.PathLike[str] | None = None) -> RunStore | None:
    """This process's :class:`RunStore` at ``path`` (default ``$RAPYDLI_STORE_PATH``, else ``$RAPYDLI_HOME/runs.db``).

    Returns ``None`` when ``RAPYDLI_STORE=off``. The same object is returned on every
    call in a process (a forked child opens its own).
    """
    if not store_enabled():
        return None
    target = Path(path) if path is not None else (settings().store_path or home() / "runs.db")
    key = (os.getpid(), str(target.resolve()))
    with _open_lock:
        store = _stores.get(key)
        if store is None:
            store = _stores[key] = RunStore(target)
        return store


def require_store() -> RunStore:
    """Like :func:`open_store`, but raise StoreError when the store is disabled."""
    store = open_store()
    if store is None:
        raise StoreError("the run store is disabled (RAPYDLI_STORE=off)")
    return store


def _set_current_run(run_id: str) -> None:
    _current[os.getpid()] = run_id


def current_run_id() -> str | None:
    """The run values are recorded under: the batch item running this notebook, else the
    last run this process created, else ``None``."""
    return settings().batch_item or _current.get(os.getpid())


__all__ = [
    "KINDS", "STATUSES", "MIGRATIONS", "SCHEMA_VERSION", "RunStore",
    "open_store", "require_store", "current_run_id", "store_enabled", "validate_run_id", "to_json",
]  # fmt: skip

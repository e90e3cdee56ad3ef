"""Measured results in SQLite, keyed by (device fingerprint, problem, candidate, parameters).

A second tuning of the same problem on the same device reads every result from here
and measures nothing; :class:`CachedRunner` wraps any runner to do that, storing each
batch as soon as it is measured, so an interrupted tuning resumes where it stopped. The
``plans`` table keeps finished whole-model plans (JSON) so a warm start applies one without
tuning. The database is ``$RAPYDLI_HOME/autotune.db`` (WAL mode, so engines and the
notebook can share it).
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rapydli.autotune.runner import Measurement, Runner
from rapydli.autotune.search import Config, Problem
from rapydli.errors import StoreError
from rapydli.paths import home

_SCHEMA = """
CREATE TABLE IF NOT EXISTS measurements (
    fingerprint TEXT NOT NULL,
    problem     TEXT NOT NULL,
    candidate   TEXT NOT NULL,
    params      TEXT NOT NULL,
    status      TEXT NOT NULL,
    median      REAL,
    variance    REAL,
    times       TEXT NOT NULL,
    error       REAL,
    message     TEXT NOT NULL,
    created     REAL NOT NULL,
    passes      TEXT NOT NULL DEFAULT '{}',
    PRIMARY KEY (fingerprint, problem, candidate, params)
)
"""
_PLANS = """
CREATE TABLE IF NOT EXISTS plans (
    key     TEXT PRIMARY KEY,
    plan    TEXT NOT NULL,
    created REAL NOT NULL
)
"""
_COLUMNS = "status, median, variance, times, error, message, passes"


def default_path() -> Path:
    """``$RAPYDLI_HOME/autotune.db`` (default ``~/.rapydli/autotune.db``)."""
    return home() / "autotune.db"


class Cache:
    """The tuning cache.

    Parameters
    ----------
    path
        SQLite file; default :func:`default_path`.
    """

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        self.path = Path(path) if path is not None else default_path()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            with self._connect() as db:
                db.execute("PRAGMA journal_mode=WAL")
                db.execute(_SCHEMA)
                db.execute(_PLANS)
                if "passes" not in {row[1] for row in db.execute("PRAGMA table_info(measurements)")}:
                    # a cache from before per-pass times: its rows read as whole-run times only
                    db.execute("ALTER TABLE measurements ADD COLUMN passes TEXT NOT NULL DEFAULT '{}'")
        except sqlite3.Error as exc:
            raise StoreError(f"cannot open the autotune cache {self.path}: {exc}") from exc

    def _connect(self) -> sqlite3.Connection:
        return sqlite3.connect(self.path, timeout=30)

    def get(self, fingerprint: str, problem: str, config: Config) -> Measurement | None:
        """The stored measurement, or None."""
        with self._connect() as db:
            row = db.execute(
                f"SELECT {_COLUMNS} FROM measurements WHERE fingerprint=? AND problem=? AND candidate=? AND params=?",
                (fingerprint, problem, config.candidate, config.params_key),
            ).fetchone()
        return None if row is None else _measurement(config, row)

    def put(self, fingerprint: str, problem: str, m: Measurement) -> None:
        """Store (or replace) one measurement; ``missing`` ones, and timings still disturbed by other work
        (``m.disturbed``: a quieter run should measure them again), are not stored."""
        if m.status == "missing" or m.disturbed:
            return
        with self._connect() as db:
            db.execute(
                "INSERT OR REPLACE INTO measurements (fingerprint, problem, candidate, params, status, median, "
                "variance, times, error, message, created, passes) VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
                (
                    fingerprint,
                    problem,
                    m.config.candidate,
                    m.config.params_key,
                    m.status,
                    m.median,
                    m.variance,
                    json.dumps(m.times),
                    m.error,
                    m.message,
                    time.time(),
                    json.dumps(m.passes),
                ),
            )

    def records(self, fingerprint: str) -> list[tuple[str, Measurement]]:
        """Every ``(problem, measurement)`` stored for a device."""
        with self._connect() as db:
            rows = db.execute(
                f"SELECT problem, candidate, params, {_COLUMNS} "
                "FROM measurements WHERE fingerprint=? ORDER BY problem, candidate, params",
                (fingerprint,),
            ).fetchall()
        return [
            (problem, _measurement(Config.of(cand, json.loads(params)), row)) for problem, cand, params, *row in rows
        ]

    def get_plan(self, key: str) -> str | None:
        """The stored plan (JSON text) under ``key``, or None."""
        with self._connect() as db:
            row = db.execute("SELECT plan FROM plans WHERE key=?", (key,)).fetchone()
        return None if row is None else row[0]

    def put_plan(self, key: str, plan: str) -> None:
        """Store (or replace) a plan (JSON text) under ``key``."""
        with self._connect() as db:
            db.execute("INSERT OR REPLACE INTO plans (key, plan, created) VALUES (?,?,?)", (key, plan, time.time()))

    def clear(self, fingerprint: str | None = None) -> None:
        """Forget everything (or one device's results); stored plans go with either."""
        with self._connect() as db:
            db.execute("DELETE FROM plans")
            if fingerprint is None:
                db.execute("DELETE FROM measurements")
            else:
                db.execute("DELETE FROM measurements WHERE fingerprint=?", (fingerprint,))


def _measurement(config: Config, row: Sequence[Any]) -> Measurement:
    """A measurement from the ``_COLUMNS`` of one row."""
    status, median, variance, times, error, message, passes = row
    return Measurement(
        config, status, median, variance, json.loads(times), error, message, cached=True, passes=json.loads(passes)
    )


class CachedRunner(Runner):
    """Answer from the cache what it holds; measure the rest with ``inner`` and store it.

    ``measured`` counts configurations actually handed to ``inner`` (0 on a warm cache).

    Parameters
    ----------
    inner, cache, fingerprint
        The runner that measures, the cache, and the device fingerprint keying it.
    chunk
        Hand ``inner`` at most this many configurations at a time and store each chunk as
        soon as it is measured (None: all at once).
    deadline
        A ``time.monotonic()`` value after which no new chunk starts: the configurations not
        measured by then come back ``"missing"`` (cached ones are still answered).
    admit
        Called with each chunk before it starts: it starts only when this returns True (a
        budget that expects the chunk to end too late says no); the rest come back
        ``"missing"`` as past a ``deadline``.
    on_result
        Called with every measurement taken (not those read from the cache).
    """

    def __init__(
        self,
        inner: Runner,
        cache: Cache,
        fingerprint: str,
        chunk: int | None = None,
        deadline: float | None = None,
        on_result: Callable[[Measurement], None] | None = None,
        admit: Callable[[Sequence[Config]], bool] | None = None,
    ) -> None:
        self.inner = inner
        self.cache = cache
        self.fingerprint = fingerprint
        self.chunk = chunk
        self.deadline = deadline
        self.admit = admit
        self.on_result = on_result
        self.measured = 0

    def run(self, problem: Problem, configs: Sequence[Config]) -> list[Measurement]:
        found = {c: self.cache.get(self.fingerprint, problem.key, c) for c in configs}
        todo = [c for c in configs if found[c] is None]
        size = self.chunk or max(1, len(todo))
        for start in range(0, len(todo), size):
            part = todo[start : start + size]
            if self.deadline is not None and time.monotonic() >= self.deadline:
                break
            if self.admit is not None and not self.admit(part):
                break
            self.measured += len(part)
            for m in self.inner.run(problem, part):
                self.cache.put(self.fingerprint, problem.key, m)
                found[m.config] = m
                if self.on_result is not None:
                    self.on_result(m)
        return [
            found[c] or Measurement(c, "missing", message="not measured: the tuning budget was spent") for c in configs
        ]

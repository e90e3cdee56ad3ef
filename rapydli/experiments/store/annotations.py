"""Tags, notes and run families: the parts of :class:`~rapydli.experiments.store.runstore.RunStore`
that organise runs rather than record them.

A *family* is a top-level run (no parent, or a parent no longer in the store) with its
children: a sweep with its trials, a batch with its items, a scaling study with its points.
:meth:`RunAnnotations.families` filters and pages families in SQL, so a store of thousands
of runs answers one page at a time.

Tags are short labels (``best``, ``baseline``, ``paper-fig3``); a note is free text. Both
live in the run store (schema version 2) and are edited from the panel, the REST API and
``rapydli runs tag`` / ``rapydli runs note``.
"""

from __future__ import annotations

import re
import sqlite3
import time
from collections.abc import Callable, Iterable
from typing import Any

from rapydli.errors import ConfigError, NotFoundError

#: A tag: 1-40 letters, digits, ``_ . : + -`` (no spaces, so tags read as words in a list).
TAG_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:+-]{0,39}$")
MAX_TAGS = 20
MAX_NOTE = 10_000
#: Sort keys of :meth:`RunAnnotations.families` and the SQL each one orders by.
FAMILY_SORTS: dict[str, str] = {
    "started": "r.started",
    "name": "r.name COLLATE NOCASE",
    "duration": "COALESCE(r.ended, r.heartbeat) - r.started",
    "status": "r.status",
    "kind": "r.kind",
}


def check_tags(tags: Iterable[object]) -> list[str]:
    """Validated, de-duplicated tags in the order given; ConfigError names a bad one.

    Examples
    --------
    >>> check_tags(["best", "baseline", "best"])
    ['best', 'baseline']
    """
    out: list[str] = []
    for tag in tags:
        if not isinstance(tag, str) or not TAG_RE.match(tag):
            raise ConfigError(
                f"tag {tag!r} is invalid: 1-40 letters, digits, '_', '.', ':', '+' or '-', starting with a letter or digit"
            )
        if tag not in out:
            out.append(tag)
    if len(out) > MAX_TAGS:
        raise ConfigError(f"a run has at most {MAX_TAGS} tags; got {len(out)}")
    return out


def check_note(note: object) -> str | None:
    """A note as stored: text up to 10 000 characters; empty text (or None) clears it."""
    if note is None:
        return None
    if not isinstance(note, str):
        raise ConfigError(f"a note must be text; got {type(note).__name__}")
    if len(note) > MAX_NOTE:
        raise ConfigError(f"a note is at most {MAX_NOTE} characters; got {len(note)}")
    return note if note.strip() else None


def _like(text: str) -> str:
    return "%" + text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"


class RunAnnotations:
    """Tags, notes and families; mixed into :class:`~rapydli.experiments.store.runstore.RunStore`."""

    _read: Callable[..., list[sqlite3.Row]]
    _write: Callable[[Callable[[sqlite3.Connection], Any]], Any]
    get_run: Callable[[str], dict[str, Any]]
    final_metrics: Callable[[str], dict[str, float]]

    # -- tags and notes ---------------------------------------------------------------
    def tags(self, run_id: str) -> list[str]:
        """The run's tags, in the order they were added."""
        self.get_run(run_id)
        return [row[0] for row in self._read("SELECT tag FROM tags WHERE run_id = ? ORDER BY time, rowid", (run_id,))]

    def tags_of(self, run_ids: Iterable[str]) -> dict[str, list[str]]:
        """Tags of many runs at once: ``{run_id: [tag, ...]}`` (runs without tags absent)."""
        ids = list(run_ids)
        out: dict[str, list[str]] = {}
        for start in range(0, len(ids), 500):
            chunk = ids[start : start + 500]
            marks = ", ".join("?" * len(chunk))
            for row in self._read(
                f"SELECT run_id, tag FROM tags WHERE run_id IN ({marks}) ORDER BY time, rowid", chunk
            ):
                out.setdefault(row[0], []).append(row[1])
        return out

    def set_tags(self, run_id: str, tags: Iterable[object]) -> list[str]:
        """Replace the run's tags by ``tags``; returns them."""
        clean = check_tags(tags)
        self.get_run(run_id)
        now = time.time()

        def write(conn: sqlite3.Connection) -> None:
            conn.execute("DELETE FROM tags WHERE run_id = ?", (run_id,))
            conn.executemany("INSERT INTO tags (run_id, tag, time) VALUES (?, ?, ?)", [(run_id, t, now) for t in clean])

        self._write(write)
        return clean

    def add_tags(self, run_id: str, tags: Iterable[object]) -> list[str]:
        """Add ``tags`` (those already there stay); returns all the run's tags."""
        return self.set_tags(run_id, [*self.tags(run_id), *check_tags(tags)])

    def remove_tags(self, run_id: str, tags: Iterable[object]) -> list[str]:
        """Remove ``tags`` (absent ones are ignored); returns the run's remaining tags."""
        gone = set(check_tags(tags))
        return self.set_tags(run_id, [t for t in self.tags(run_id) if t not in gone])

    def set_note(self, run_id: str, note: object) -> str | None:
        """Set (or, with empty text or None, clear) the run's note; returns it."""
        text = check_note(note)

        def write(conn: sqlite3.Connection) -> None:
            if conn.execute("UPDATE runs SET note = ? WHERE id = ?", (text, run_id)).rowcount == 0:
                raise NotFoundError(f"no run {run_id!r} in the run store")

        self.get_run(run_id)  # validates the id
        self._write(write)
        return text

    # -- families -----------------------------------------------------------------------
    def families(
        self,
        *,
        kind: str | None = None,
        status: str | None = None,
        text: str | None = None,
        tag: str | None = None,
        sort: str = "started",
        descending: bool = True,
        limit: int = 50,
        offset: int = 0,
        max_children: int = 500,
    ) -> tuple[list[dict[str, Any]], int]:
        """One page of run families, and how many families match.

        A family matches when its top-level run or one of its children matches every
        filter given: ``kind``, ``status``, ``tag`` (exact) and ``text`` (a substring of
        the name, id, note or a tag, any case). Each family is the top-level run's dict
        (as :meth:`get_run`) with ``tags``, ``final`` (final metrics), ``n_children`` and
        ``children`` (newest first, at most ``max_children``, each with ``tags``,
        ``final`` and ``n_children``).
        """
        if sort not in FAMILY_SORTS:
            raise ConfigError(f"sort must be one of {', '.join(FAMILY_SORTS)}; got {sort!r}")
        conds: list[str] = []
        args: list[Any] = []
        for column, value in (("kind", kind), ("status", status)):
            if value is not None:
                conds.append(f"{{a}}.{column} = ?")
                args.append(value)
        if tag is not None:
            conds.append("EXISTS (SELECT 1 FROM tags t WHERE t.run_id = {a}.id AND t.tag = ?)")
            args.append(tag)
        if text:
            pattern = _like(text)
            conds.append(
                "({a}.name LIKE ? ESCAPE '\\' OR {a}.id LIKE ? ESCAPE '\\' OR {a}.note LIKE ? ESCAPE '\\'"
                " OR EXISTS (SELECT 1 FROM tags t WHERE t.run_id = {a}.id AND t.tag LIKE ? ESCAPE '\\'))"
            )
            args += [pattern] * 4
        root = "(r.parent IS NULL OR r.parent NOT IN (SELECT id FROM runs))"
        where, where_args = root, []
        if conds:
            own = " AND ".join(c.format(a="r") for c in conds)
            child = " AND ".join(c.format(a="c") for c in conds)
            where = f"{root} AND (({own}) OR EXISTS (SELECT 1 FROM runs c WHERE c.parent = r.id AND {child}))"
            where_args = args + args
        total = int(self._read(f"SELECT COUNT(*) FROM runs r WHERE {where}", where_args)[0][0])
        order = f"{FAMILY_SORTS[sort]} {'DESC' if descending else 'ASC'}, r.started DESC, r.rowid DESC"
        rows = self._read(
            f"SELECT r.id FROM runs r WHERE {where} ORDER BY {order} LIMIT ? OFFSET ?",
            [*where_args, int(limit), int(offset)],
        )
        families = []
        for row in rows:
            family = self.get_run(row[0])
            children = [
                self.get_run(r[0])
                for r in self._read(
                    "SELECT id FROM runs WHERE parent = ? ORDER BY started DESC, rowid DESC LIMIT ?",
                    (family["id"], int(max_children)),
                )
            ]
            family["children"] = children
            families.append(family)
        everyone = [f for f in families] + [c for f in families for c in f["children"]]
        tags = self.tags_of(r["id"] for r in everyone)
        counts = self._children_counts([r["id"] for r in everyone])
        for run in everyone:
            run["tags"] = tags.get(run["id"], [])
            run["final"] = self.final_metrics(run["id"])
            run["n_children"] = counts.get(run["id"], 0)
        return families, total

    def _children_counts(self, run_ids: list[str]) -> dict[str, int]:
        out: dict[str, int] = {}
        for start in range(0, len(run_ids), 500):
            chunk = run_ids[start : start + 500]
            marks = ", ".join("?" * len(chunk))
            for row in self._read(
                f"SELECT parent, COUNT(*) FROM runs WHERE parent IN ({marks}) GROUP BY parent", chunk
            ):
                out[row[0]] = int(row[1])
        return out

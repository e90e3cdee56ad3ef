"""Validation of what REST clients send: ids, query arguments and request bodies.

Pure functions with no jupyter_server import; every bad value raises
:class:`~rapydli.errors.ConfigError` naming the argument and what is allowed (the
handlers turn that into a 400 response).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, overload

from rapydli.errors import ConfigError
from rapydli.experiments.store.runstore import KINDS, STATUSES

#: Run, sweep and cluster ids: letters, digits, ``_`` and ``-`` (never ``.`` or ``/``).
ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")
RUN_KINDS = KINDS
RUN_STATUSES = STATUSES
MAX_ENGINES = 64
MAX_PAGE = 1000


def check_id(value: str, what: str = "id") -> str:
    """Return ``value`` if it is a well-formed id, else raise ConfigError.

    Examples
    --------
    >>> check_id("3f2a9c0d")
    '3f2a9c0d'
    """
    if not isinstance(value, str) or not ID_RE.match(value):
        raise ConfigError(f"{what} must be 1-64 letters, digits, '_' or '-'; got {value!r}")
    return value


@overload
def _int_arg(args: Mapping[str, str], name: str, default: int, lo: int, hi: int | None) -> int: ...


@overload
def _int_arg(args: Mapping[str, str], name: str, default: None, lo: int, hi: int | None) -> int | None: ...


def _int_arg(args: Mapping[str, str], name: str, default: int | None, lo: int, hi: int | None) -> int | None:
    text = args.get(name)
    if text is None or text == "":
        return default
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(f"query argument {name!r} must be an integer; got {text!r}") from None
    if value < lo or (hi is not None and value > hi):
        bound = f"{lo}..{hi}" if hi is not None else f">= {lo}"
        raise ConfigError(f"query argument {name!r} must be {bound}; got {value}")
    return value


def _choice_arg(args: Mapping[str, str], name: str, allowed: tuple[str, ...]) -> str | None:
    text = args.get(name)
    if text is None or text == "":
        return None
    if text not in allowed:
        raise ConfigError(f"query argument {name!r} must be one of {', '.join(allowed)}; got {text!r}")
    return text


@dataclass(frozen=True)
class RunQuery:
    """``GET runs`` arguments: filters and one page."""

    kind: str | None = None
    status: str | None = None
    limit: int = 50
    offset: int = 0


def parse_run_query(args: Mapping[str, str]) -> RunQuery:
    """Parse ``kind``, ``status``, ``limit`` (1..1000, default 50) and ``offset``.

    Examples
    --------
    >>> parse_run_query({"kind": "train", "limit": "5"})
    RunQuery(kind='train', status=None, limit=5, offset=0)
    """
    return RunQuery(
        kind=_choice_arg(args, "kind", RUN_KINDS),
        status=_choice_arg(args, "status", RUN_STATUSES),
        limit=_int_arg(args, "limit", 50, 1, MAX_PAGE),
        offset=_int_arg(args, "offset", 0, 0, None),
    )


def parse_since(args: Mapping[str, str]) -> int | None:
    """The ``since`` cursor of ``GET runs/{id}/metrics``: the last ``seq`` the client has."""
    return _int_arg(args, "since", None, -1, None)


@dataclass(frozen=True)
class ClusterRequest:
    """A validated ``POST clusters`` body."""

    n: int
    launcher: str
    options: dict[str, Any] = field(default_factory=dict)


def parse_json_body(body: bytes) -> dict[str, Any]:
    """The request body as a JSON object (an empty body is ``{}``)."""
    if not body or not body.strip():
        return {}
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"request body must be a JSON object; got {type(data).__name__}")
    return data


def parse_cluster_request(data: Mapping[str, Any]) -> ClusterRequest:
    """Check a cluster start request: ``n`` (1..64), ``launcher`` and its allow-listed ``options``.

    Launchers and their options come from :mod:`rapydli.cluster.launchers`; nothing in
    the body is ever executed or passed to a shell.

    Examples
    --------
    >>> parse_cluster_request({"n": 2, "launcher": "local"})
    ClusterRequest(n=2, launcher='local', options={})
    """
    from rapydli.cluster.launchers import DEFAULT_LAUNCHER, validate_options

    unknown = sorted(set(data) - {"n", "launcher", "options"})
    if unknown:
        raise ConfigError(f"unknown field(s) {', '.join(unknown)}: allowed are n, launcher, options")
    n = data.get("n", 2)
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_ENGINES:
        raise ConfigError(f"field 'n' (engines) must be an integer 1..{MAX_ENGINES}; got {n!r}")
    launcher = data.get("launcher", DEFAULT_LAUNCHER)
    if not isinstance(launcher, str):
        raise ConfigError(f"field 'launcher' must be a string; got {launcher!r}")
    options = data.get("options", {})
    if not isinstance(options, dict):
        raise ConfigError(f"field 'options' must be an object; got {type(options).__name__}")
    return ClusterRequest(n=n, launcher=launcher, options=validate_options(launcher, options))


@dataclass(frozen=True)
class FamilyQuery:
    """``GET families`` arguments: filters, order and one page."""

    kind: str | None = None
    status: str | None = None
    text: str | None = None
    tag: str | None = None
    sort: str = "started"
    descending: bool = True
    limit: int = 50
    offset: int = 0


def parse_family_query(args: Mapping[str, str]) -> FamilyQuery:
    """Parse ``kind``, ``status``, ``q`` (text), ``tag``, ``sort``, ``order`` (asc|desc), ``limit``, ``offset``.

    Examples
    --------
    >>> parse_family_query({"q": "resnet", "sort": "name", "order": "asc"})
    FamilyQuery(kind=None, status=None, text='resnet', tag=None, sort='name', descending=False, limit=50, offset=0)
    """
    from rapydli.experiments.store.annotations import FAMILY_SORTS, TAG_RE

    text = args.get("q") or None
    if text is not None and len(text) > 200:
        raise ConfigError(f"query argument 'q' is at most 200 characters; got {len(text)}")
    tag = args.get("tag") or None
    if tag is not None and not TAG_RE.match(tag):
        raise ConfigError(f"query argument 'tag' must be a tag (letters, digits, '_.:+-'); got {tag!r}")
    return FamilyQuery(
        kind=_choice_arg(args, "kind", RUN_KINDS),
        status=_choice_arg(args, "status", RUN_STATUSES),
        text=text,
        tag=tag,
        sort=_choice_arg(args, "sort", tuple(FAMILY_SORTS)) or "started",
        descending=(_choice_arg(args, "order", ("asc", "desc")) or "desc") == "desc",
        limit=_int_arg(args, "limit", 50, 1, 200) or 50,
        offset=_int_arg(args, "offset", 0, 0, None) or 0,
    )


def parse_compare_ids(args: Mapping[str, str]) -> list[str]:
    """The ``ids`` argument of ``GET compare``: 2-10 comma-separated, different run ids."""
    from rapydli.experiments.store.compare import MAX_COMPARE

    text = args.get("ids", "")
    ids = [check_id(part.strip(), "run id") for part in text.split(",") if part.strip()]
    if not 2 <= len(ids) <= MAX_COMPARE:
        raise ConfigError(f"query argument 'ids' must name 2..{MAX_COMPARE} runs, comma-separated; got {len(ids)}")
    if len(set(ids)) != len(ids):
        raise ConfigError("query argument 'ids' names a run twice")
    return ids


@dataclass(frozen=True)
class Annotations:
    """A validated ``PATCH runs/{id}`` body: new tags and/or note (None = unchanged)."""

    tags: list[str] | None = None
    note: str | None = None
    set_note: bool = False


def parse_annotations(data: Mapping[str, Any]) -> Annotations:
    """Check ``{"tags": [...], "note": "..."}`` (either or both; ``note`` null or "" clears it).

    Examples
    --------
    >>> parse_annotations({"tags": ["best"]})
    Annotations(tags=['best'], note=None, set_note=False)
    """
    from rapydli.experiments.store.annotations import check_note, check_tags

    unknown = sorted(set(data) - {"tags", "note"})
    if unknown:
        raise ConfigError(f"unknown field(s) {', '.join(unknown)}: allowed are tags, note")
    if not data:
        raise ConfigError("the body must set 'tags' (a list of tags) or 'note' (text), or both")
    tags = None
    if "tags" in data:
        if not isinstance(data["tags"], list):
            raise ConfigError(f"field 'tags' must be a list of tags; got {type(data['tags']).__name__}")
        tags = check_tags(data["tags"])
    note = check_note(data["note"]) if "note" in data else None
    return Annotations(tags=tags, note=note, set_note="note" in data)

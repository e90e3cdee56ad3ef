"""rapydli.server.query: ids, query arguments and cluster requests are validated before use."""

from __future__ import annotations

import pytest

from rapydli.errors import ConfigError
from rapydli.server.query import (
    ClusterRequest,
    RunQuery,
    check_id,
    parse_cluster_request,
    parse_json_body,
    parse_run_query,
    parse_since,
)


@pytest.mark.parametrize("value", ["abc123", "c0ffee_1", "A-b"])
def test_check_id_accepts_safe_ids(value: str) -> None:
    assert check_id(value) == value


@pytest.mark.parametrize("value", ["..", "../etc/passwd", "a/b", "a.b", "", "-x", "x" * 65, "a b", "a%2Fb"])
def test_check_id_rejects_traversal_and_odd_text(value: str) -> None:
    with pytest.raises(ConfigError, match="run id"):
        check_id(value, "run id")


def test_run_query_defaults_and_values() -> None:
    assert parse_run_query({}) == RunQuery()
    assert parse_run_query({"kind": "sweep", "status": "running", "limit": "3", "offset": "6"}) == RunQuery(
        "sweep", "running", 3, 6
    )


@pytest.mark.parametrize(
    ("args", "field"),
    [
        ({"kind": "bogus"}, "kind"),
        ({"status": "done"}, "status"),
        ({"limit": "0"}, "limit"),
        ({"limit": "5000"}, "limit"),
        ({"offset": "-1"}, "offset"),
        ({"limit": "ten"}, "limit"),
    ],
)
def test_run_query_rejects_bad_arguments(args: dict[str, str], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        parse_run_query(args)


def test_since_cursor() -> None:
    assert parse_since({}) is None
    assert parse_since({"since": "7"}) == 7
    with pytest.raises(ConfigError, match="since"):
        parse_since({"since": "x"})


def test_json_body() -> None:
    assert parse_json_body(b"") == {}
    assert parse_json_body(b'{"n": 2}') == {"n": 2}
    with pytest.raises(ConfigError, match="not valid JSON"):
        parse_json_body(b"{n: 2")
    with pytest.raises(ConfigError, match="JSON object"):
        parse_json_body(b"[1, 2]")


def test_cluster_request_is_checked_against_the_launcher_allow_list() -> None:
    assert parse_cluster_request({}) == ClusterRequest(2, "local", {})
    request = parse_cluster_request({"n": 3, "launcher": "local", "options": {"mpi_args": "-bind-to core"}})
    assert request.options == {"mpi_args": ["-bind-to", "core"]}
    with pytest.raises(ConfigError, match="unknown launcher 'bogus'"):
        parse_cluster_request({"launcher": "bogus"})
    with pytest.raises(ConfigError, match="no option 'command'"):
        parse_cluster_request({"options": {"command": "rm -rf /"}})
    with pytest.raises(ConfigError, match="'n'"):
        parse_cluster_request({"n": 0})
    with pytest.raises(ConfigError, match="'n'"):
        parse_cluster_request({"n": True})
    with pytest.raises(ConfigError, match="unknown field"):
        parse_cluster_request({"n": 2, "script": "echo hi"})

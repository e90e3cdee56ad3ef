"""The controller's log of a real cluster run: no iopub_welcome errors, other records kept."""

from __future__ import annotations

import logging

import pytest

import rapydli as rd
from rapydli.cluster.controller_config import CONTROLLER_LOGGER, IopubWelcomeFilter
from rapydli.paths import subdir


def test_the_filter_drops_only_the_welcome_error() -> None:
    welcome = logging.LogRecord(
        CONTROLLER_LOGGER,
        logging.ERROR,
        "hub.py",
        1,
        "Monitor message without topic: %r",
        ([b"id", b'{"msg_type": "iopub_welcome"}'],),
        None,
    )
    other = logging.LogRecord(
        CONTROLLER_LOGGER,
        logging.ERROR,
        "hub.py",
        1,
        "Monitor message without topic: %r",
        ([b"id", b'{"msg_type": "execute_result"}'],),
        None,
    )
    assert not IopubWelcomeFilter().filter(welcome)
    assert IopubWelcomeFilter().filter(other)


@pytest.mark.engines
def test_a_cluster_run_logs_no_monitor_errors() -> None:
    with rd.Cluster(n=2) as cluster:  # the controller's log is removed when it stops: read it before
        assert cluster.run(lambda: 1) == [1, 1]
        logs = list((subdir("ipython") / "log").glob(f"ipcontroller-{cluster.status()['cluster_id']}-*.log"))
        assert logs, "the controller wrote no log"
        text = "".join(path.read_text() for path in logs)
    assert "Monitor message without topic" not in text

"""The configuration file the cluster's ipyparallel controller loads from its profile directory.

ipykernel 7 greets every new IOPub subscriber with an ``iopub_welcome`` message; the
controller's monitor subscribes to each engine's IOPub, and ipyparallel 9's hub, which
does not know that message, logs ``ERROR | Monitor message without topic`` once per
engine. Nothing is wrong, so :class:`IopubWelcomeFilter` drops exactly that record in the
controller's own logger; every other controller message is kept.

The file also sets the hub's heartbeat (:data:`HEART_PERIOD_MS`, :data:`HEART_MISSES`),
which decides how soon a registered engine is ready.
"""

from __future__ import annotations

import logging
from pathlib import Path

CONFIG_FILE = "ipcontroller_config.py"  # ipyparallel's controller reads <profile_dir>/ipcontroller_config.py
CONTROLLER_LOGGER = "IPController"

#: How often the hub pings the engines' hearts (ms). ipyparallel's 3000 ms default held every
#: start for up to two periods: an engine that registered counts only once the hub's next
#: round has heard its heart (5.2 s of a 6.9 s start of 2 local engines).
HEART_PERIOD_MS = 500
#: Missed pings before the hub counts an engine dead: the 30 s that ipyparallel's defaults
#: allow (10 x 3000 ms), so a rank busy on a loaded machine is not dropped any sooner.
HEART_MISSES = 60

_CONTENT = f"""\
# Written by rapydli.cluster.controller_config at every cluster start; edits are lost.
from rapydli.cluster.controller_config import quiet_controller_log

quiet_controller_log()
c = get_config()  # noqa: F821 - traitlets defines it for configuration files
c.HeartMonitor.period = {HEART_PERIOD_MS}
c.HeartMonitor.max_heartmonitor_misses = {HEART_MISSES}
"""


class IopubWelcomeFilter(logging.Filter):
    """Drops the hub's "Monitor message without topic" error for ``iopub_welcome`` messages."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = str(record.msg)
        return not (text.startswith("Monitor message without topic") and "iopub_welcome" in record.getMessage())


def quiet_controller_log() -> None:
    """Install :class:`IopubWelcomeFilter` on the controller's logger (run inside the controller)."""
    logger = logging.getLogger(CONTROLLER_LOGGER)
    if not any(isinstance(f, IopubWelcomeFilter) for f in logger.filters):
        logger.addFilter(IopubWelcomeFilter())


def write_controller_config(profile_dir: str | Path) -> Path:
    """Write the controller's configuration file into ``profile_dir``; returns its path."""
    path = Path(profile_dir) / CONFIG_FILE
    if not path.exists() or path.read_text() != _CONTENT:
        path.write_text(_CONTENT)
    return path

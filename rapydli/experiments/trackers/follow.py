"""Live logging: the client's run feeds its trackers from a thread, never from the training's path.

:class:`RunTrackers` is what a :class:`~rapydli.experiments.job.TrainingJob` holds: made
when the run is recorded, closed when it ends. A thread per tracker wakes every
:data:`INTERVAL_S` (and at once on :meth:`~RunTrackers.close`) and pushes what the run
store gained to every tracker (:class:`~rapydli.experiments.trackers.sync.RunSync`), so
the metrics path of the run (ranks -> client -> store) does no tracker work at all, and
what is pending is bounded by the store itself, not by a queue that could grow.

A tracker that fails (not installed, unreachable, refusing a value) is dropped for the
rest of the run and reported once, as one :class:`~rapydli.errors.RapydliWarning` naming
it, the reason and how to catch up later (``rapydli runs export``); the run, its store
and the other trackers go on. :meth:`~RunTrackers.close` waits at most
:data:`CLOSE_WAIT_S` for the last push.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Iterable
from typing import TYPE_CHECKING

from rapydli.errors import RapydliWarning
from rapydli.experiments.trackers.base import Tracker, TrackerUnavailable
from rapydli.experiments.trackers.sync import RunSync
from rapydli.registry import TRACKERS

if TYPE_CHECKING:  # pragma: no cover
    from rapydli.experiments.store.runstore import RunStore

#: Seconds between two pushes of a running run to its trackers.
INTERVAL_S = 1.0
#: Seconds :meth:`RunTrackers.close` waits for the last push before it reports the tracker as too slow.
CLOSE_WAIT_S = 60.0


class RunTrackers:
    """The trackers one running RaPyDLI run is logged to, fed from the store by one thread per tracker.

    Parameters
    ----------
    store
        The run store the run is recorded in.
    run_id
        The run (new, or one a restart continues: its tracker runs are resumed).
    names
        Registered tracker names; a tracker that cannot be used is reported and left out.
    interval_s
        Seconds between pushes.
    """

    def __init__(self, store: RunStore, run_id: str, names: Iterable[str], interval_s: float = INTERVAL_S) -> None:
        self.run_id = run_id
        self.interval_s = interval_s
        self.problems: dict[str, str] = {}  # tracker name -> why it was dropped (reported once, on close)
        self.syncs: list[RunSync] = []
        for name in names:
            try:
                kind: type[Tracker] = TRACKERS.load(name)
                kind.require()
                self.syncs.append(RunSync(store, run_id, kind()))
            except TrackerUnavailable as exc:
                self.problems[name] = str(exc)
            except Exception as exc:  # a tracker that cannot even be made is reported like an unreachable one
                self.problems[name] = f"{type(exc).__name__}: {exc}"
        self._reported: set[str] = set()
        self.report()  # a missing package is said now, before the run trains
        self._wake = threading.Event()
        self._closing = False
        self._threads = [
            threading.Thread(target=self._loop, args=(sync,), name=f"rapydli-{sync.tracker.name}-{run_id}", daemon=True) for sync in self.syncs
        ]  # one per tracker: a slow one never holds the others back
        for thread in self._threads:
            thread.start()

    def _loop(self, sync: RunSync) -> None:
        final = False
        try:
            while not final:
                final = self._closing or self._wake.wait(self.interval_s)
                sync.push(final=final)
        except Exception as exc:  # never the run's problem: drop this tracker, report it once
            self.problems.setdefault(sync.tracker.name, f"{type(exc).__name__}: {exc}")
        finally:
            _close_quietly(sync.tracker)

    def close(self, wait_s: float = CLOSE_WAIT_S) -> None:
        """Push what is left (artifacts and status once the run has ended), stop the threads (at most ``wait_s``), report problems once."""
        self._closing = True
        self._wake.set()
        deadline = time.monotonic() + wait_s
        for thread, sync in zip(self._threads, self.syncs):
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                self.problems.setdefault(sync.tracker.name, f"it did not take the run's last updates within {wait_s:g} s")
        self.report()

    def report(self) -> None:
        """Warn once per tracker that was dropped (in the caller's thread, so the notebook cell shows it)."""
        for name, why in self.problems.items():
            if name not in self._reported:
                self._reported.add(name)
                warnings.warn(
                    f"run {self.run_id} is not logged to {name!r}: {why}. The run and its store are complete; "
                    f"`rapydli runs export --to {name} {self.run_id}` logs it once the tracker is back",
                    RapydliWarning,
                    stacklevel=3,
                )


def _close_quietly(tracker: Tracker) -> None:
    try:
        tracker.close()
    except Exception:  # noqa: S110 - a tracker that already failed has nothing more to say
        pass


def follow(store: RunStore | None, run_id: str | None, trackers: str | Iterable[str] = "") -> RunTrackers | None:
    """The :class:`RunTrackers` of a run starting now: ``trackers`` and ``RAPYDLI_TRACKERS`` (``None`` if neither names one).

    Without a run store (``RAPYDLI_STORE=off``) nothing is logged, and that is said once.
    """
    from rapydli.registry import tracker_names
    from rapydli.settings import settings

    names = list(dict.fromkeys([*tracker_names(trackers, "trackers"), *settings().trackers]))
    if not names:
        return None
    if store is None or run_id is None:
        warnings.warn(
            f"trackers {', '.join(names)} log runs from the run store, which is off (RAPYDLI_STORE=off): this run is not logged to them",
            RapydliWarning,
            stacklevel=3,
        )
        return None
    return RunTrackers(store, run_id, names)

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

A run whose parent (a sweep, a scaling study, a batch or its item) is followed in this
process is one family with it: a tracker the parent dropped is not tried for the child,
and a tracker the child drops is the parent's to report, so a sweep of many trials with an
unreachable server warns once. A parent calls :meth:`~RunTrackers.wait_open` before its
children start, so its tracker run exists once, before theirs.
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
#: Seconds :meth:`RunTrackers.wait_open` waits for a parent's tracker runs before its children start anyway.
OPEN_WAIT_S = 30.0

# The RunTrackers of the runs followed in this process now, by run id: a child finds its parent's here.
_followed: dict[str, RunTrackers] = {}
_followed_lock = threading.Lock()


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
        self.family = False  # runs under this one are followed too (its warnings speak for them)
        parent_id = store.get_run(run_id)["parent"]
        with _followed_lock:
            self.parent = _followed.get(parent_id) if parent_id else None
            _followed[run_id] = self
        if self.parent is not None:
            self.parent.family = True
        for name in names:
            if self.parent is not None and name in self.parent.problems:
                continue  # the parent dropped it (and reports it)
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
        self._opened = [threading.Event() for _ in self.syncs]
        self._threads = [
            threading.Thread(
                target=self._loop, args=(sync, opened), name=f"rapydli-{sync.tracker.name}-{run_id}", daemon=True
            )
            for sync, opened in zip(self.syncs, self._opened)
        ]  # one per tracker: a slow one never holds the others back
        for thread in self._threads:
            thread.start()

    def _loop(self, sync: RunSync, opened: threading.Event) -> None:
        final = False
        try:
            sync.push()  # at once: the tracker run exists before the run's children start
            opened.set()
            while not final:
                final = self._closing or self._wake.wait(self.interval_s)
                sync.push(final=final)
        except Exception as exc:  # never the run's problem: drop this tracker, report it once
            self.problems.setdefault(sync.tracker.name, f"{type(exc).__name__}: {exc}")
        finally:
            opened.set()
            _close_quietly(sync.tracker)

    def wait_open(self, wait_s: float = OPEN_WAIT_S) -> None:
        """Wait (at most ``wait_s``) until every tracker run of this run is made, or its tracker dropped.

        A parent calls it before it starts its children, so they nest under one parent run.
        """
        deadline = time.monotonic() + wait_s
        for opened in self._opened:
            opened.wait(max(0.0, deadline - time.monotonic()))

    def close(self, wait_s: float = CLOSE_WAIT_S) -> None:
        """Push what is left (artifacts and status once the run has ended), stop the threads (at most ``wait_s``), report problems once."""
        self._closing = True
        self._wake.set()
        deadline = time.monotonic() + wait_s
        for thread, sync in zip(self._threads, self.syncs):
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                self.problems.setdefault(
                    sync.tracker.name, f"it did not take the run's last updates within {wait_s:g} s"
                )
        with _followed_lock:
            if _followed.get(self.run_id) is self:
                del _followed[self.run_id]
        self.report()

    def report(self) -> None:
        """Warn once per tracker that was dropped (in the caller's thread, so the notebook cell shows it).

        A child's problems go to its parent, which warns once for the whole family.
        """
        if self.parent is not None:
            for name, why in list(self.problems.items()):
                self.parent.problems.setdefault(name, why)
            self.parent.report()
            return
        for name, why in list(self.problems.items()):
            if name not in self._reported:
                self._reported.add(name)
                which = f"run {self.run_id} and the runs under it are" if self.family else f"run {self.run_id} is"
                runs = f"RUN...` of {self.run_id} and the ids under it" if self.family else f"{self.run_id}`"
                warnings.warn(
                    f"{which} not logged to {name!r}: {why}. The store is complete; "
                    f"`rapydli runs export --to {name} {runs} logs {'them' if self.family else 'it'} once the tracker is back",
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

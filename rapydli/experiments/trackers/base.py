"""The one small interface every experiment tracker implements, and what it is handed.

A :class:`Tracker` holds one tracker run (an MLflow run, a TensorBoard log directory, a
W&B run) for one RaPyDLI run. :class:`~rapydli.experiments.trackers.sync.RunSync` drives
it from the run store, so a tracker never sees the ranks, the cluster or the training
loop: it is told the run's parameters and tags, then metric points as the store receives
them, then the artifacts and the final status. Trackers are named in
:data:`rapydli.registry.TRACKERS`; a third party adds one through the ``rapydli.trackers``
entry-point group with a subclass of :class:`Tracker`.
"""

from __future__ import annotations

import importlib.util
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from rapydli.errors import RapydliError


class TrackerUnavailable(RapydliError):
    """A tracker cannot be used here: its package is not installed (the message says what to install)."""


@dataclass(frozen=True)
class Point:
    """One metric value: ``key`` at ``step``, measured at ``time`` (epoch seconds).

    ``key`` is the tracker's name for it: a per-rank timing is ``system/rank1/step_time_s``.
    """

    step: int
    key: str
    value: float
    time: float


@dataclass(frozen=True)
class Artifact:
    """Something kept with a tracker run: a text, a plotly figure or a file, at ``name``.

    Attributes
    ----------
    name
        Where it goes in the tracker run (``source/Net.py``, ``figures/loss.html``).
    kind
        ``source`` (recorded code), ``figure``, ``checkpoint`` (a location, as text) or
        the run store's own artifact kind (``notebook``, ``report``...) for a file.
    text, figure, path
        Exactly one is set: the text, the figure, or the local file.
    """

    name: str
    kind: str
    text: str | None = None
    figure: Any = None
    path: str | None = None


#: RaPyDLI statuses as most trackers spell them (MLflow's run statuses).
STATUS_WORDS: dict[str, str] = {
    "running": "RUNNING",
    "finished": "FINISHED",
    "failed": "FAILED",
    "interrupted": "KILLED",
    "pruned": "KILLED",
}


class Tracker(ABC):
    """One tracker run for one RaPyDLI run; every method is called from one thread, in order.

    :meth:`open` comes first and once; the other calls may repeat (a later call adds or
    updates, never duplicates what the tracker already holds); :meth:`close` comes last.

    Attributes
    ----------
    name
        The registered name (``"mlflow"``).
    module, extra
        The package the tracker imports and the ``rapydli`` extra that installs it.
    """

    name: ClassVar[str]
    module: ClassVar[str]
    extra: ClassVar[str]

    @classmethod
    def require(cls) -> None:
        """Raise :class:`TrackerUnavailable` naming what to install when the tracker's package is missing."""
        if importlib.util.find_spec(cls.module) is None:
            raise TrackerUnavailable(
                f"the {cls.name!r} tracker needs the {cls.module} package, which is not installed: pip install 'rapydli[{cls.extra}]'"
            )

    @abstractmethod
    def open(
        self, run: Mapping[str, Any], link: Mapping[str, Any] | None, parent: Mapping[str, Any] | None
    ) -> dict[str, Any]:
        """Start the tracker run of ``run`` (a :meth:`RunStore.get_run` dict), or resume ``link``'s.

        ``link`` is what an earlier :meth:`open` of this run returned (recorded in the run
        store), ``parent`` the link of the run's parent (a sweep, a batch); return the link:
        a JSON dict with at least ``id``, and ``url`` where the tracker has one.
        """

    @abstractmethod
    def log_params(self, params: Mapping[str, str]) -> None:
        """Record the run's parameters (flat names, text values)."""

    @abstractmethod
    def log_metrics(self, points: Sequence[Point]) -> None:
        """Record metric points (in the order the store received them)."""

    @abstractmethod
    def set_tags(self, tags: Mapping[str, str]) -> None:
        """Set tags (a tag without a value has ``""``)."""

    @abstractmethod
    def log_artifacts(self, artifacts: Sequence[Artifact]) -> None:
        """Keep texts, figures and files with the run (the same name replaces)."""

    @abstractmethod
    def finish(self, status: str, ended: float) -> None:
        """End the tracker run with RaPyDLI's ``status`` (``finished``, ``failed``, ``interrupted``, ``pruned``) at ``ended`` (epoch s)."""

    def close(self) -> None:  # noqa: B027 - most trackers hold nothing to release
        """Release files and connections (the tracker run stays as it is)."""

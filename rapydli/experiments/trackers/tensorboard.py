"""The ``tensorboard`` tracker: one log directory of event files per RaPyDLI run.

Runs go under ``RAPYDLI_TENSORBOARD_DIR`` (default ``$RAPYDLI_HOME/tensorboard``), as
``<name>-<run id>`` (a ``/`` in the name, as in a batch item's ``<notebook>/<parameter
hash>``, is ``_``); a sweep's trials, a batch's items and a scaling study's points are
folders inside their parent's, so ``tensorboard --logdir`` shows them as one family.
Scalars are written with PyTorch's
``SummaryWriter`` at the store's step and wall time; parameters, tags, recorded sources
and the checkpoint location are text summaries; the loss figure is an HTML file beside
the events. A sync starts from the store's first row, so it rewrites the run's event
files instead of adding a second copy (a second export replaces the first).
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rapydli.experiments.trackers.base import Artifact, Point, Tracker


def tensorboard_root() -> Path:
    """Where the tracker writes: ``RAPYDLI_TENSORBOARD_DIR``, else ``$RAPYDLI_HOME/tensorboard``."""
    from rapydli.paths import home
    from rapydli.settings import settings

    return settings().tensorboard_dir or home() / "tensorboard"


def folder_name(run: Mapping[str, Any]) -> str:
    """The run's folder in its parent's (or the root): ``<name>-<run id>``, one folder deep whatever the name.

    >>> folder_name({"name": "grid/9c0d1e2f", "id": "3f2a9c81d0b4"})
    'grid_9c0d1e2f-3f2a9c81d0b4'
    """
    name = re.sub(r"[/\\]+", "_", str(run["name"])).lstrip(".")
    return f"{name}-{run['id']}"


class TensorBoardTracker(Tracker):
    """One TensorBoard run directory (see the module docstring)."""

    name = "tensorboard"
    module = "tensorboard"
    extra = "tensorboard"

    def __init__(self) -> None:
        self.writer: Any = None
        self.logdir = Path()

    def open(
        self, run: Mapping[str, Any], link: Mapping[str, Any] | None, parent: Mapping[str, Any] | None
    ) -> dict[str, Any]:
        from torch.utils.tensorboard import SummaryWriter

        if link and link.get("logdir"):
            self.logdir = Path(link["logdir"])
        else:
            base = Path(parent["logdir"]) if parent and parent.get("logdir") else tensorboard_root()
            self.logdir = base / folder_name(run)
        self.logdir.mkdir(parents=True, exist_ok=True)
        for old in self.logdir.glob("events.out.tfevents.*"):  # the store is the truth: rewrite, never add a copy
            old.unlink()
        self.writer = SummaryWriter(str(self.logdir))
        return {"id": str(run["id"]), "logdir": str(self.logdir)}

    def log_params(self, params: Mapping[str, str]) -> None:
        rows = "\n".join(f"| {k} | {v.replace('|', '/')} |" for k, v in sorted(params.items()))
        self.writer.add_text("params", "| parameter | value |\n|---|---|\n" + rows, 0)

    def log_metrics(self, points: Sequence[Point]) -> None:
        for point in points:
            self.writer.add_scalar(point.key, point.value, point.step, walltime=point.time)
        self.writer.flush()

    def set_tags(self, tags: Mapping[str, str]) -> None:
        self.writer.add_text("tags", "\n".join(f"* {k}" + (f": {v}" if v else "") for k, v in sorted(tags.items())), 0)

    def log_artifacts(self, artifacts: Sequence[Artifact]) -> None:
        for artifact in artifacts:
            if artifact.text is not None:
                self.writer.add_text(artifact.name, "```\n" + artifact.text + "\n```", 0)
            elif artifact.figure is not None:
                target = self.logdir / artifact.name
                target.parent.mkdir(parents=True, exist_ok=True)
                artifact.figure.write_html(str(target), include_plotlyjs="cdn")
            elif artifact.path is not None:
                target = self.logdir / artifact.name
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(artifact.path, target)
        self.writer.flush()

    def finish(self, status: str, ended: float) -> None:
        self.writer.add_text("status", status, 0, walltime=ended)
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()

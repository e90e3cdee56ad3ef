"""The ``wandb`` tracker: one Weights & Biases run per RaPyDLI run, with the same id.

Settings are W&B's own: ``WANDB_PROJECT`` (default ``rapydli``), ``WANDB_ENTITY``,
``WANDB_MODE`` (``offline`` writes the run under ``WANDB_DIR`` for a later ``wandb
sync``) and ``WANDB_DIR`` (default ``$RAPYDLI_HOME``). The W&B run id is the RaPyDLI run
id, so a second sync resumes the same run (``resume="allow"``) instead of making another;
a sweep's or batch's runs share a W&B group named for the parent. Every metric is logged
against its training step (``step`` as the step metric), so the other ranks' timings,
which arrive a little late, are never dropped as out of order. Online mode without a
login is refused up front (it would wait for a prompt).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping, Sequence
from itertools import groupby
from pathlib import Path
from typing import Any

from rapydli.experiments.trackers.base import Artifact, Point, Tracker, TrackerUnavailable

#: The project runs go to when ``WANDB_PROJECT`` is not set.
DEFAULT_PROJECT = "rapydli"


class WandbTracker(Tracker):
    """One W&B run (see the module docstring)."""

    name = "wandb"
    module = "wandb"
    extra = "wandb"

    def __init__(self) -> None:
        mode = os.environ.get("WANDB_MODE", "online").lower()
        if mode not in ("offline", "disabled", "dryrun"):
            from wandb.apis import InternalApi

            if not InternalApi().api_key:
                raise TrackerUnavailable(
                    "W&B is online but not logged in: run `wandb login`, or set WANDB_MODE=offline"
                )
        self.run: Any = None

    def open(
        self, run: Mapping[str, Any], link: Mapping[str, Any] | None, parent: Mapping[str, Any] | None
    ) -> dict[str, Any]:
        import wandb

        from rapydli.paths import home

        directory = Path(os.environ.get("WANDB_DIR") or home())
        directory.mkdir(parents=True, exist_ok=True)
        group = (
            str(parent["group"])
            if parent and parent.get("group")
            else str(run["id"])
            if run["kind"] in ("sweep", "batch", "scaling")
            else None
        )
        self.run = wandb.init(
            id=str(run["id"]),
            name=str(run["name"]),
            project=os.environ.get("WANDB_PROJECT") or DEFAULT_PROJECT,
            group=group,
            job_type=str(run["kind"]),
            dir=str(directory),
            resume="allow",
            reinit="create_new",
            settings=wandb.Settings(silent=True, console="off", x_disable_stats=True),
        )
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")
        url = None if self.run.settings.mode in ("offline", "disabled") else self.run.url
        return {"id": str(run["id"]), "project": self.run.project, "group": group, "dir": str(self.run.dir), "url": url}

    def log_params(self, params: Mapping[str, str]) -> None:
        self.run.config.update(dict(params), allow_val_change=True)

    def log_metrics(self, points: Sequence[Point]) -> None:
        for step, same in groupby(sorted(points, key=lambda p: p.step), key=lambda p: p.step):
            self.run.log({"step": step, **{p.key: p.value for p in same}})

    def set_tags(self, tags: Mapping[str, str]) -> None:
        self.run.tags = tuple(k for k, v in tags.items() if not v and len(k) <= 64)
        self.run.config.update({k: v for k, v in tags.items() if v}, allow_val_change=True)

    def log_artifacts(self, artifacts: Sequence[Artifact]) -> None:
        for artifact in artifacts:  # the run's files folder: W&B keeps (and uploads) what is there when the run ends
            target = Path(self.run.dir) / artifact.name
            target.parent.mkdir(parents=True, exist_ok=True)
            if artifact.text is not None:
                target.write_text(artifact.text)
            elif artifact.figure is not None:
                artifact.figure.write_html(str(target), include_plotlyjs="cdn")
            elif artifact.path is not None:
                shutil.copyfile(artifact.path, target)

    def finish(self, status: str, ended: float) -> None:
        self.run.summary["rapydli_status"] = status
        self.run.finish(exit_code=0 if status == "finished" else 1)

    def close(self) -> None:
        if self.run is not None and not getattr(self.run, "_is_finished", False):
            self.run.finish()

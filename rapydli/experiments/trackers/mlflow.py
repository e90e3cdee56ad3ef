"""The ``mlflow`` tracker: one MLflow run per RaPyDLI run, a sweep's trials nested under the sweep's.

Settings are MLflow's own: ``MLFLOW_TRACKING_URI`` (a server, or a local store) and
``MLFLOW_EXPERIMENT_NAME`` (default ``rapydli``). It talks through ``MlflowClient`` only,
so it never touches the notebook's own active MLflow run. Metrics keep the store's step
and timestamp, so sending a point twice (a second export) adds nothing: MLflow keeps one
copy of identical points.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from rapydli.experiments.trackers.base import STATUS_WORDS, Artifact, Point, Tracker

#: The experiment runs go to when ``MLFLOW_EXPERIMENT_NAME`` is not set.
DEFAULT_EXPERIMENT = "rapydli"
_CHUNK = 900  # below MLflow's 1000 metrics per log_batch


class MlflowTracker(Tracker):
    """One MLflow run (see the module docstring)."""

    name = "mlflow"
    module = "mlflow"
    extra = "mlflow"

    def __init__(self) -> None:
        from mlflow import MlflowClient

        self.client = MlflowClient()
        self.run_id = ""

    def open(
        self, run: Mapping[str, Any], link: Mapping[str, Any] | None, parent: Mapping[str, Any] | None
    ) -> dict[str, Any]:
        uri = str(self.client.tracking_uri)
        if link and link.get("tracking_uri") == uri and self._alive(str(link["id"])):
            self.run_id = str(link["id"])
            return dict(link)
        experiment_id = self._experiment()
        tags = {"mlflow.runName": str(run["name"]), "rapydli.run_id": str(run["id"])}
        if parent and parent.get("tracking_uri") == uri:
            tags["mlflow.parentRunId"] = str(parent["id"])
        created = self.client.create_run(
            experiment_id, start_time=int(run["started"] * 1000), tags=tags, run_name=str(run["name"])
        )
        self.run_id = created.info.run_id
        url = f"{uri.rstrip('/')}/#/experiments/{experiment_id}/runs/{self.run_id}" if uri.startswith("http") else None
        return {"id": self.run_id, "experiment_id": experiment_id, "tracking_uri": uri, "url": url}

    def _alive(self, run_id: str) -> bool:
        from mlflow.exceptions import MlflowException

        try:
            return bool(self.client.get_run(run_id).info.lifecycle_stage == "active")
        except MlflowException:
            return False

    def _experiment(self) -> str:
        from mlflow.exceptions import MlflowException

        name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or DEFAULT_EXPERIMENT
        found = self.client.get_experiment_by_name(name)
        if found is not None:
            return str(found.experiment_id)
        try:
            return str(self.client.create_experiment(name))
        except MlflowException:  # made meanwhile by another process
            found = self.client.get_experiment_by_name(name)
            if found is None:
                raise
            return str(found.experiment_id)

    def log_params(self, params: Mapping[str, str]) -> None:
        from mlflow.entities import Param

        items = [Param(k, v) for k, v in params.items()]
        for start in range(0, len(items), 90):  # MLflow takes 100 params per call
            self.client.log_batch(self.run_id, params=items[start : start + 90], synchronous=True)

    def log_metrics(self, points: Sequence[Point]) -> None:
        from mlflow.entities import Metric

        items = [Metric(p.key, p.value, int(p.time * 1000), p.step) for p in points]
        for start in range(0, len(items), _CHUNK):
            self.client.log_batch(self.run_id, metrics=items[start : start + _CHUNK], synchronous=True)

    def set_tags(self, tags: Mapping[str, str]) -> None:
        from mlflow.entities import RunTag

        items = [RunTag(k, v) for k, v in tags.items()]
        for start in range(0, len(items), 90):
            self.client.log_batch(self.run_id, tags=items[start : start + 90], synchronous=True)

    def log_artifacts(self, artifacts: Sequence[Artifact]) -> None:
        for artifact in artifacts:
            if artifact.text is not None:
                self.client.log_text(self.run_id, artifact.text, artifact.name)
            elif artifact.figure is not None:
                self.client.log_figure(self.run_id, artifact.figure, artifact.name)
            elif artifact.path is not None:
                self.client.log_artifact(
                    self.run_id, artifact.path, artifact_path=artifact.name.rpartition("/")[0] or None
                )

    def finish(self, status: str, ended: float) -> None:
        """End the MLflow run FINISHED, FAILED or KILLED at ``ended``.

        The store's own call under ``MlflowClient.set_terminated`` (which also prints the
        run's address on stdout), given the status as MLflow's ``RunStatus`` number: a
        SQLite or file store takes nothing else (given the word, MLflow 3's SQLite store
        warned "Could not get string corresponding to run status" and the run stayed RUNNING).
        """
        from mlflow.entities import RunStatus

        code = RunStatus.from_string(STATUS_WORDS[status])
        self.client._tracking_client.store.update_run_info(self.run_id, code, int(ended * 1000), None)

"""Re-running a recorded run with the same parameters and seed (``rapydli runs repeat``).

* ``train`` runs are repeated when their ``model_fn`` and ``data_fn`` were recorded as
  importable ``"module:qualname"`` names (``rd.train`` records them so); the recorded
  ``config`` (a dict of :class:`~rapydli.trainer.config.TrainConfig` fields, seed included)
  is used as is. So must be a ``loss_fn``, ``optimizer_fn`` or metric callable it was given;
  a run of code defined in a notebook (recorded by its source) or of an object such as
  ``nn.MSELoss()`` is refused, saying why.
* ``batch`` items run their notebook again with the recorded parameters; a whole batch
  runs all its recorded points again. Finished outputs are not reused (``force=True``).
"""

from __future__ import annotations

import sys
from typing import Any

from rapydli.errors import ConfigError
from rapydli.experiments.batch import spec as batchspec
from rapydli.experiments.store import runstore as store_mod

REPEATABLE = ("train", "batch")


def repeat_run(run_id: str, *, out: str | None = None, parallel: int | None = None, progress: bool = True) -> str:
    """Run ``run_id`` again; return the id of the new run (for a batch: the new batch or item run).

    Raises
    ------
    NotFoundError
        Unknown run id.
    ConfigError
        The run's kind cannot be repeated, or its functions/notebook cannot be found.
    """
    store = store_mod.require_store()
    run = store.get_run(store.resolve(run_id))
    params = run["params"]
    if run["kind"] == "train":
        return _repeat_train(run, params)
    if run["kind"] == "batch":
        return _repeat_batch(run, params, out=out, parallel=parallel, progress=progress)
    raise ConfigError(f"run {run['id']} is a {run['kind']} run; only {' and '.join(REPEATABLE)} runs can be repeated")


def _repeat_train(run: dict[str, Any], params: dict[str, Any]) -> str:
    refs: dict[str, str] = {}
    for key in ("model_fn", "data_fn"):
        ref = params.get(key)
        if isinstance(ref, str) and ref.count(":") == 1 and " " not in ref:
            refs[key] = ref
        else:
            raise ConfigError(
                f"train run {run['id']} cannot be repeated: its {key} was recorded as {ref!r}, not an importable "
                "'module:qualname' (define model and data functions in a module, not in the notebook)"
            )
    code = {key: params[key] for key in ("loss_fn", "optimizer_fn") if params.get(key) is not None}
    for key, ref in code.items():
        if not (isinstance(ref, str) and ref.count(":") == 1 and " " not in ref):
            raise ConfigError(
                f"train run {run['id']} cannot be repeated: its {key} was recorded as {ref!r}, not an importable "
                "'module:qualname' (code defined in a notebook is recorded by its source, shown by `rapydli runs show`, "
                "but cannot be run again from the shell: move it to a module)"
            )
    metrics = params.get("metrics")
    if metrics is not None and any(not isinstance(m, str) or " " in m or "=" in m for m in metrics):
        raise ConfigError(
            f"train run {run['id']} cannot be repeated: its metrics {metrics!r} include callables "
            "that are not importable by name"
        )
    if not isinstance(params.get("config"), dict):
        raise ConfigError(f"train run {run['id']} cannot be repeated: it has no recorded config")
    from rapydli.experiments.run import run_training
    from rapydli.experiments.store.refs import resolve_callable

    resolved: dict[str, Any] = {key: resolve_callable(ref, key) for key, ref in code.items()}
    if metrics is not None:
        resolved["metrics"] = [resolve_callable(m, "metrics") if ":" in m else m for m in metrics]
    result = run_training(refs["model_fn"], refs["data_fn"], params["config"], name=run["name"], **resolved)
    if result.run_id is None:  # pragma: no cover - the store was open a moment ago
        raise ConfigError("the run store is disabled, so the repeated run was not recorded")
    return result.run_id


def _repeat_batch(
    run: dict[str, Any], params: dict[str, Any], *, out: str | None, parallel: int | None, progress: bool
) -> str:
    from rapydli.experiments.batch.batch import batch

    notebook = params.get("notebook")
    if not isinstance(notebook, str):
        raise ConfigError(f"batch run {run['id']} cannot be repeated: it has no recorded notebook")
    if batchspec.notebook_hash(notebook) != params.get("notebook_hash"):
        print(f"note: {notebook} changed since run {run['id']}; repeating with the current notebook", file=sys.stderr)
    item = "parameters" in params
    points = [params["parameters"]] if item else params.get("points") or [{}]
    summary = batch(
        notebook,
        points=points,
        out=out or params.get("out") or "batch-results",
        parallel=parallel or int(params.get("parallel") or 1),
        kernel=params.get("kernel"),
        timeout=params.get("timeout"),
        retry=int(params.get("retry") or 0),
        force=True,
        progress=progress,
    )
    return str(summary["run_id"].iloc[0]) if item else str(summary.attrs["batch_id"])

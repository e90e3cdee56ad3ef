"""One training run from the client, headless: validate, choose the cluster, run, return the history.

The notebook's ``rd.train`` (:func:`rapydli.notebook.train`) adds the live plot around
:func:`run_training`; scripts, batches and repeats call it directly. It runs a
:class:`~rapydli.experiments.job.TrainingJob` over every engine of the cluster chosen by
:func:`rapydli.cluster.ensure_cluster` and waits for it.

Examples
--------
>>> from rapydli.experiments.run import run_training  # doctest: +SKIP
>>> result = run_training("rapydli.zoo.models:resnet_digits", "rapydli.zoo.datasets:digits",
...                       TrainConfig(epochs=2, workers=2))  # doctest: +SKIP
>>> result.history.query("kind == 'eval'").val_accuracy.iloc[-1]  # doctest: +SKIP
0.97
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rapydli.errors import ConfigError
from rapydli.experiments.refs import resolve_callable
from rapydli.trainer.config import TrainConfig
from rapydli.trainer.outputs import check_training_code

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

    from rapydli.cluster import Cluster

#: A client-side callback: called with each metrics row as it arrives: rank 0's rows
#: (``row["kind"]`` is ``"train"`` or ``"eval"``; keys in :mod:`rapydli.trainer.callbacks`)
#: and the other ranks' step timings (``"rank"``; keys in :mod:`rapydli.trainer.task`).
MetricsCallback = Callable[[dict[str, Any]], None]


@dataclass
class RunResult:
    """What ``rd.train`` returns.

    Attributes
    ----------
    run_id
        Id of the run in the store (``None`` when recording is off, ``RAPYDLI_STORE=off``).
    history
        One row per optimizer step (``kind == "train"``) and per evaluation
        (``kind == "eval"``); columns as in :mod:`rapydli.trainer.callbacks`.
    figure
        A plotly figure of training and validation loss against step.
    """

    run_id: str | None
    history: pd.DataFrame
    figure: Any

    def _repr_html_(self) -> str:  # pragma: no cover - notebook display
        final = self.history.dropna(axis=1, how="all").tail(3)
        return f"<b>RunResult</b> run_id={self.run_id}<br>{final.to_html(index=False)}"


def run_training(
    model_fn: Callable[[], Any] | str,
    data_fn: Callable[[], Any] | str,
    config: TrainConfig | dict[str, Any],
    cluster: Cluster | None = None,
    *,
    callbacks: Sequence[MetricsCallback] = (),
    progress: bool = True,
    name: str | None = None,
    loss_fn: Callable[..., Any] | None = None,
    optimizer_fn: Callable[..., Any] | None = None,
    metrics: Any = None,
) -> RunResult:
    """Train ``model_fn()`` on ``data_fn()`` data-parallel on every engine of a cluster.

    Parameters
    ----------
    model_fn
        Returns an ``nn.Module`` (the same on every rank; rank 0's weights win), or a
        ``"module:qualname"`` string naming such a function.
    data_fn
        Returns ``(train_dataset, val_dataset)`` (``val_dataset`` may be ``None``), or a
        ``"module:qualname"`` string.
    config
        A :class:`TrainConfig` (or a dict of its fields); validated before anything starts.
    cluster
        The cluster to use; ``None`` uses the one running in this kernel, else starts one
        of ``config.workers`` engines and stops it afterwards (:func:`rapydli.cluster.ensure_cluster`).
    callbacks
        Client-side callables, each called with every metrics row as it arrives.
    progress
        Show a tqdm progress bar driven by rank 0's steps.
    name
        Run name in the store (default: the model function's name).
    loss_fn
        ``loss_fn(outputs, targets) -> scalar loss`` on whatever the model returns; ``None``:
        the model's own loss (its ``forward`` takes ``targets``/``labels``, or it returns a
        loss), else cross-entropy on its logits. What a model may return:
        :mod:`rapydli.trainer.outputs`.
    optimizer_fn
        ``optimizer_fn(model)`` or ``optimizer_fn(model, config)`` returning a
        ``torch.optim.Optimizer`` (parameter groups welcome), used instead of
        ``config.optimizer``; the lr schedule scales every group from its own lr.
    metrics
        Names (``"accuracy"``, ``"mse"``, ``"mae"``) or callables ``fn(outputs, targets)``
        evaluated on the validation set as ``val_<name>``, averaged over the ranks;
        ``None``: accuracy where it means something (classification), none otherwise.

    Returns
    -------
    RunResult
        ``run_id``, ``history`` DataFrame (one row per step and per evaluation) and a
        loss ``figure``.

    Raises
    ------
    ConfigError
        Invalid config or functions (before any process starts).
    RankFailure
        A rank raised or died; names the rank(s). The run is recorded as ``failed``.
    """
    from rapydli.cluster import ensure_cluster
    from rapydli.experiments.figures import loss_figure
    from rapydli.experiments.job import TrainingJob

    cfg = config if isinstance(config, TrainConfig) else TrainConfig.from_dict(dict(config))
    model = resolve_callable(model_fn, "model_fn")
    resolve_callable(data_fn, "data_fn")
    check_training_code(loss_fn, optimizer_fn, metrics)
    for callback in callbacks:
        if not callable(callback):
            raise ConfigError(f"callbacks must be callables taking a metrics dict; got {callback!r}")
    run_name = name or getattr(model, "__name__", "model")
    with ensure_cluster(cluster, n=cfg.workers) as chosen:
        job = TrainingJob(
            chosen, model_fn, data_fn, cfg, range(chosen.n), callbacks=callbacks, name=run_name, progress=progress,
            loss_fn=loss_fn, optimizer_fn=optimizer_fn, metrics=metrics,
        ).wait()
    if job.exception is not None:
        raise job.exception
    history = job.history
    return RunResult(run_id=job.run_id, history=history, figure=loss_figure(history, title=run_name))

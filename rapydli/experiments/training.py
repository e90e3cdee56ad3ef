"""``rd.train``: data-parallel training from the notebook, recorded as a run.

The notebook side of design flow 2: validate the config, then run a
:class:`~rapydli.experiments.trainjob.TrainingJob` over every engine of the cluster (it
records the run, ships ``model_fn``/``data_fn``, runs a
:class:`~rapydli.train.trainer.Trainer` on each rank and follows the metrics as they
arrive: progress bar, client callbacks such as the live plot, the store) and wait for
it, so the history comes back as a DataFrame.

Examples
--------
>>> import rapydli as rd  # doctest: +SKIP
>>> result = rd.train("rapydli.train.models:resnet_digits", "rapydli.train.datasets:digits",
...                   rd.TrainConfig(epochs=2, workers=2))  # doctest: +SKIP
>>> result.history.query("kind == 'eval'").val_accuracy.iloc[-1]  # doctest: +SKIP
0.97
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rapydli.errors import ConfigError
from rapydli.experiments.refs import resolve_callable
from rapydli.train.config import TrainConfig

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

    from rapydli.cluster import Cluster

#: A client-side callback: called with each metrics row as it arrives: rank 0's rows
#: (``row["kind"]`` is ``"train"`` or ``"eval"``; keys in :mod:`rapydli.train.callbacks`)
#: and the other ranks' step timings (``"rank"``; keys in :mod:`rapydli.experiments.trainjob`).
MetricsCallback = Callable[[dict[str, Any]], None]


@dataclass
class RunResult:
    """What :func:`train` returns.

    Attributes
    ----------
    run_id
        Id of the run in the store (``None`` when recording is off, ``RAPYDLI_STORE=off``).
    history
        One row per optimizer step (``kind == "train"``) and per evaluation
        (``kind == "eval"``); columns as in :mod:`rapydli.train.callbacks`.
    figure
        A plotly figure of training and validation loss against step.
    timelines
        A pipelined run's latest ``timeline`` event of every rank (see :meth:`timeline`).
    """

    run_id: str | None
    history: pd.DataFrame
    figure: Any
    timelines: dict[int, dict[str, Any]] = field(default_factory=dict)

    def timeline(self, replica: int = 0) -> Any:
        """A pipelined run's last step as a Gantt chart, ideal schedule and bubble (:mod:`rapydli.parallel.timeline`)."""
        from rapydli.parallel.timeline import figure_from_events

        return figure_from_events(self.timelines, replica)

    def _repr_html_(self) -> str:  # pragma: no cover - notebook display
        final = self.history.dropna(axis=1, how="all").tail(3)
        return f"<b>RunResult</b> run_id={self.run_id}<br>{final.to_html(index=False)}"


def train(
    model_fn: Callable[[], Any] | str,
    data_fn: Callable[[], Any] | str,
    config: TrainConfig | dict[str, Any],
    cluster: Cluster | None = None,
    *,
    callbacks: Sequence[MetricsCallback] = (),
    progress: bool = True,
    live: bool | None = None,
    name: str | None = None,
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
        A started :class:`rapydli.cluster.Cluster`; ``None`` starts one of
        ``config.workers`` engines and stops it afterwards.
    callbacks
        Client-side callables, each called with every metrics row as it arrives.
    progress
        Show a tqdm progress bar driven by rank 0's steps.
    live
        Show a live plot (loss, val loss, throughput, step/comm time, per-rank comm wait)
        that updates while training runs; it ends as a static figure in the cell's output,
        so papermill keeps it. Default: when running in a Jupyter kernel.
    name
        Run name in the store (default: the model function's name).

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
    from rapydli.experiments.trainjob import TrainingJob
    from rapydli.widgets.live import LivePlot, in_kernel

    cfg = config if isinstance(config, TrainConfig) else TrainConfig.from_dict(dict(config))
    model = resolve_callable(model_fn, "model_fn")
    resolve_callable(data_fn, "data_fn")
    for callback in callbacks:
        if not callable(callback):
            raise ConfigError(f"callbacks must be callables taking a metrics dict; got {callback!r}")
    run_name = name or getattr(model, "__name__", "model")
    own_cluster = cluster is None
    if own_cluster:
        from rapydli.cluster import Cluster

        cluster = Cluster(n=cfg.workers)
    live_plot = LivePlot(title=run_name) if live or (live is None and in_kernel()) else None
    if live_plot is not None:
        live_plot.show()
        callbacks = (*callbacks, live_plot)
    try:
        if own_cluster:
            cluster.start()
        job = TrainingJob(
            cluster, model_fn, data_fn, cfg, range(cluster.n), callbacks=callbacks, name=run_name, progress=progress
        ).wait()
    finally:
        if live_plot is not None:
            live_plot.close()
        if own_cluster:
            cluster.stop()
    if job.exception is not None:
        raise job.exception
    history = job.history
    return RunResult(run_id=job.run_id, history=history, figure=loss_figure(history, title=run_name), timelines=job.timelines)


def loss_figure(history: pd.DataFrame, title: str = "") -> Any:
    """A plotly figure: training loss per step and validation loss per evaluation."""
    import plotly.graph_objects as go

    figure = go.Figure()
    if "kind" in history:
        steps = history[history["kind"] == "train"]
        evals = history[history["kind"] == "eval"]
        if len(steps):
            figure.add_scatter(x=steps["step"], y=steps["loss"], mode="lines", name="train loss")
        if len(evals):
            figure.add_scatter(x=evals["step"], y=evals["val_loss"], mode="lines+markers", name="val loss")
    figure.update_layout(title=title, xaxis_title="step", yaxis_title="cross-entropy", template="plotly_white")
    return figure

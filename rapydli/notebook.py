"""The notebook front door: ``rd.train``, ``rd.sweep``, ``rd.scaling_study``, ``rd.plan_parallel``, ``rd.record``.

The experiments (:mod:`rapydli.experiments`) run headless: they take a cluster (or let
:func:`rapydli.cluster.ensure_cluster` choose one), call callbacks and return results
with plotly figures. This module is the one place that decides what a notebook shows
while they run: inside a Jupyter kernel (also under papermill) a live plot, a live sweep
view or a live scaling plot, each left in the cell's output as a static figure when the
call ends; elsewhere nothing but the progress bar. ``rd.record`` shows a recorded value as
an output of the running cell, so the executed notebook carries it.

A saved notebook is read outside JupyterLab too (nbconvert to HTML offline, GitHub,
nbviewer), where neither widgets nor plotly's own MIME type are drawn. So in a notebook's
kernel (from ``import rapydli`` on) every plotly figure also carries its PNG
(:func:`rapydli.widgets.display.static_figures`), a live figure is a plain figure redrawn
in place that is settled with its PNG when the call ends (no widget state saved), and the
progress bar's saved text is its final state (:class:`rapydli.widgets.progress.NotebookProgress`).

Examples
--------
>>> import rapydli as rd  # doctest: +SKIP
>>> result = rd.train("rapydli.zoo.models:resnet_digits", "rapydli.zoo.datasets:digits",
...                   rd.TrainConfig(epochs=2, workers=2))  # doctest: +SKIP
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from rapydli.errors import RankFailure
from rapydli.widgets.display import CellDisplay, figure_bundle, in_kernel, static_figures

if TYPE_CHECKING:  # pragma: no cover
    from rapydli.cluster import Cluster
    from rapydli.experiments.planning.network import Network
    from rapydli.experiments.planning.perfmodel import RingModel
    from rapydli.experiments.planning.planner import ParallelPlan
    from rapydli.experiments.planning.profile import Profile
    from rapydli.experiments.run import MetricsCallback, RunResult
    from rapydli.experiments.scaling import ScalingResult
    from rapydli.experiments.spec import DataSource, LossFn, ModelSource, OptimizerFn
    from rapydli.experiments.sweep.space import Dimension
    from rapydli.experiments.sweep.sweep import SweepResult
    from rapydli.trainer.config import TrainConfig


def _live(live: bool | None) -> bool:
    return bool(live) if live is not None else in_kernel()


def _with_trackers(
    config: TrainConfig | Mapping[str, Any], trackers: Sequence[str] | str | None
) -> TrainConfig | Mapping[str, Any]:
    """``config`` that also logs to ``trackers`` (:meth:`~rapydli.trainer.config.TrainConfig.with_trackers`); unchanged without them."""
    if not trackers:
        return config
    from rapydli.trainer.config import TrainConfig

    return (config if isinstance(config, TrainConfig) else TrainConfig.from_dict(dict(config))).with_trackers(trackers)


def progress_bar(**kwargs: Any) -> Any:
    """The progress bar of ``rd.train``: in a kernel, tqdm's widget whose saved text is its
    final state; elsewhere tqdm's text bar. Arguments as for ``tqdm``."""
    if in_kernel():
        from rapydli.widgets.progress import NotebookProgress

        return NotebookProgress(**kwargs)
    from tqdm import tqdm

    return tqdm(**kwargs)


def train(
    model_fn: ModelSource,
    data_fn: DataSource,
    config: TrainConfig | dict[str, Any],
    cluster: Cluster | None = None,
    *,
    callbacks: Sequence[MetricsCallback] = (),
    progress: bool = True,
    live: bool | None = None,
    name: str | None = None,
    restarts: int | None = None,
    min_workers: int | None = None,
    loss_fn: LossFn | None = None,
    optimizer_fn: OptimizerFn | None = None,
    metrics: Any = None,
    trackers: Sequence[str] | str | None = None,
) -> RunResult:
    """Train ``model_fn()`` on ``data_fn()`` data-parallel on every engine of a cluster.

    :func:`rapydli.experiments.run.run_training` with a live plot (loss, val loss,
    throughput, step/comm time, per-rank comm wait) that updates while training runs and
    ends as a static figure in the cell's output (a restart after ranks died is a dashed
    marker); a pipelined config (``pipeline_stages > 1``) adds the live Gantt chart of the
    latest step (:class:`rapydli.widgets.timeline.LiveTimeline`). Parameters, result and
    errors as there; ``live``: show the plots (default: inside a Jupyter kernel).

    The model, its loss and its optimizer may be the researcher's own, defined in the
    notebook: the model may return logits, ``(logits, loss)``, a mapping or ``ModelOutput``
    with ``loss``/``logits``, or compute its loss from ``forward(inputs, targets)``;
    ``loss_fn(outputs, targets)`` covers anything else; ``optimizer_fn(model)`` builds the
    optimizer; ``metrics`` names what is measured on the validation set.

    ``trackers=["mlflow", "tensorboard", "wandb"]`` also logs the run to those trackers, from
    this process (never the ranks): :mod:`rapydli.experiments.trackers`.

    With ``restarts=N`` the run goes on by itself after engines die (restarted cluster,
    last checkpoint); ``min_workers=`` lets it go on with fewer engines when not all of
    them can come back (``config.on_resize`` says how the batch and learning rate follow).

    Examples
    --------
    >>> rd.train(model_fn, data_fn, cfg, restarts=2, min_workers=1)  # doctest: +SKIP
    >>> rd.train(Net, data, cfg, loss_fn=nn.MSELoss(), metrics=["mae"],
    ...          optimizer_fn=lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3))  # doctest: +SKIP

    The cluster is ``cluster``, else the one running in this kernel (``%rapydli start``),
    else a new local one of ``config.workers`` engines (default: 2, or ``pipeline_stages x
    tensor_parallel`` when more) that is stopped afterwards. The run uses every engine of its
    cluster; a ``workers`` that differs from them is refused before anything runs.
    """
    __tracebackhide__ = True  # noqa: F841 - IPython shows the user's cell, not these frames
    from rapydli.experiments.run import run_training
    from rapydli.experiments.spec import RunSpec

    static_figures()
    spec = RunSpec.of(
        model_fn, data_fn, loss_fn, optimizer_fn, metrics
    )  # resolved and checked once, before any display
    shown: list[Any] = []
    if _live(live):
        from rapydli.widgets.live import LivePlot

        shown.append(LivePlot(title=name or spec.name))
        stages = config.get("pipeline_stages", 1) if isinstance(config, Mapping) else config.pipeline_stages
        if isinstance(stages, int) and stages > 1:  # a pipelined run: its Gantt chart too, redrawn once a second
            from rapydli.widgets.timeline import LiveTimeline

            shown.append(LiveTimeline())
        for display in shown:
            display.show()
        callbacks = (*callbacks, *shown)
    try:
        bar = progress_bar if progress else False
        return run_training(
            spec,  # whole: it carries the data, the loss, the optimizer and the metrics
            None,
            config,
            cluster,
            callbacks=callbacks,
            progress=bar,
            name=name,
            restarts=restarts,
            min_workers=min_workers,
            trackers=trackers,
        )
    except RankFailure as failure:
        from rapydli.trainer.usercheck import same_mistake

        mistake = same_mistake(failure)  # the same mistake in the user's code on every rank: said once
        if mistake is None:
            raise
        raise mistake from None
    finally:
        for display in shown:
            display.close()


def load(run_id: str, model_fn: ModelSource | None = None) -> Any:
    """A recorded run with its trained model: ``rd.load(run_id).model()`` is the ``nn.Module`` its last checkpoint holds.

    Returns a :class:`~rapydli.experiments.run.RunResult` (``model()``, ``state_dict()``,
    ``history``) read from the run's ``checkpoint_dir``, whatever layout wrote it.
    ``model_fn``: what builds the model, when the run recorded none that can be imported
    (a function defined in a notebook). See :func:`rapydli.experiments.run.load_run`.

    Examples
    --------
    >>> model = rd.load("3f2a9c").model().eval()  # doctest: +SKIP
    """
    from rapydli.experiments.run import load_run

    return load_run(run_id, model_fn)


def sweep(
    model_fn: ModelSource,
    data_fn: DataSource,
    config: TrainConfig | Mapping[str, Any],
    space: Mapping[str, Dimension],
    trials: int,
    workers_per_trial: int = 1,
    parallel: int | None = None,
    pruner: str | Any = "successive_halving",
    metric: str = "val_loss",
    direction: str = "minimize",
    sampler: str | Any = "tpe",
    cluster: Cluster | None = None,
    *,
    seed: int = 0,
    enqueue: Sequence[Mapping[str, Any]] = (),
    live: bool | None = None,
    loss_fn: LossFn | None = None,
    optimizer_fn: OptimizerFn | None = None,
    metrics: Any = None,
    trackers: Sequence[str] | str | None = None,
) -> SweepResult:
    """Search ``space`` with ``trials`` training runs, each a data-parallel job on its own engines.

    :func:`rapydli.experiments.sweep.sweep.sweep` with a live table and figure of the trials
    (default: inside a Jupyter kernel), left in the output as a static figure and table.
    ``trackers=`` as in :func:`train`: the sweep is a parent run in each tracker, its trials
    nested under it. Other parameters, result and errors as there.
    """
    from rapydli.experiments.sweep import sweep as sweeps

    config = _with_trackers(config, trackers)
    static_figures()
    view = None
    if _live(live):
        from rapydli.widgets.sweepview import SweepView

        view = SweepView(metric, list(space))
        view.show()
    try:
        return sweeps.sweep(
            model_fn,
            data_fn,
            config,
            space,
            trials,
            workers_per_trial,
            parallel,
            pruner,
            metric,
            direction,
            sampler,
            cluster,
            seed=seed,
            enqueue=enqueue,
            view=view,
            loss_fn=loss_fn,
            optimizer_fn=optimizer_fn,
            metrics=metrics,
        )
    finally:
        if view is not None:
            view.close()


def scaling_study(
    model_fn: ModelSource,
    data_fn: DataSource,
    config: TrainConfig | Mapping[str, Any],
    workers: Sequence[int] = (1, 2),
    mode: str = "weak",
    steps: int = 30,
    predict: Sequence[int] | None = None,
    cluster: Cluster | None = None,
    *,
    pipeline_stages: Sequence[int] | None = None,
    network: RingModel | None = None,
    live: bool | None = None,
    loss_fn: LossFn | None = None,
    optimizer_fn: OptimizerFn | None = None,
    metrics: Any = None,
    repeats: int = 3,
    trackers: Sequence[str] | str | None = None,
) -> ScalingResult:
    """Train at each worker count (and pipeline stage count) and measure throughput, compute and communication time.

    :func:`rapydli.experiments.scaling.scaling_study` with a live scaling plot that is
    redrawn after each point (default: inside a Jupyter kernel) and left in the output as a
    figure with its PNG. ``trackers=`` as in :func:`train`: the study is a parent run in
    each tracker, its points nested under it. Other parameters, result and errors as there.

    Examples
    --------
    >>> rd.scaling_study(model_fn, data_fn, rd.TrainConfig(microbatches=4), workers=[2, 4],
    ...                  pipeline_stages=[1, 2])  # doctest: +SKIP
    """
    from rapydli.experiments.scaling import scaling_study as study

    config = _with_trackers(config, trackers)
    static_figures()
    on_point = None
    shown: CellDisplay | None = None
    if _live(live):
        import plotly.graph_objects as go

        shown = CellDisplay(go.Figure(layout={"title": "scaling study: waiting for the first point"}))
        on_point = shown.redraw

    result = study(
        model_fn,
        data_fn,
        config,
        workers,
        mode,
        steps,
        predict,
        cluster,
        pipeline_stages=pipeline_stages,
        network=network,
        on_point=on_point,
        loss_fn=loss_fn,
        optimizer_fn=optimizer_fn,
        metrics=metrics,
        repeats=repeats,
    )
    if shown is not None:
        shown.settle(result.figure)
    return result


def plan_parallel(
    model_fn: ModelSource,
    data_fn: DataSource,
    config: TrainConfig | Mapping[str, Any],
    ranks: int = 2,
    memory_per_rank: float | None = None,
    network: Network | RingModel | None = None,
    run_top: int | None = None,
    steps: int = 12,
    cluster: Cluster | None = None,
    *,
    global_batch: int | None = None,
    profile: Profile | None = None,
    run_layouts: Sequence[str] = (),
    loss_fn: LossFn | None = None,
    optimizer_fn: OptimizerFn | None = None,
    metrics: Any = None,
) -> ParallelPlan:
    """Which layout (data x pipeline x tensor parallel, micro-batches, schedule, ZeRO) to train with.

    :func:`rapydli.experiments.planning.planner.plan_parallel`: measures the model and the network
    once, predicts every layout of ``ranks`` ranks, runs the fastest ``run_top`` and returns
    the table, a figure of predicted against measured and ``best``, a ``TrainConfig`` for
    ``rd.train``. Parameters, result and errors as there; in a kernel the figure is kept
    readable in the saved notebook.

    Examples
    --------
    >>> plan = rd.plan_parallel(models.tiny_lm, datasets.synthetic_tokens, rd.TrainConfig(batch_size=16), ranks=2)  # doctest: +SKIP
    >>> rd.train(models.tiny_lm, datasets.synthetic_tokens, plan.best)  # doctest: +SKIP
    >>> rd.plan_parallel(models.tiny_lm, datasets.synthetic_tokens, cfg, ranks=64, profile=plan.profile,
    ...                  network=RingModel(alpha=5e-6, beta=1 / 12.5e9))  # doctest: +SKIP
    """
    from rapydli.experiments.planning.planner import plan_parallel as plan

    static_figures()
    return plan(
        model_fn,
        data_fn,
        config,
        ranks,
        memory_per_rank,
        network,
        run_top,
        steps,
        cluster,
        global_batch=global_batch,
        profile=profile,
        run_layouts=run_layouts,
        loss_fn=loss_fn,
        optimizer_fn=optimizer_fn,
        metrics=metrics,
    )


def record(name: str, value: Any) -> None:
    """Record a result of this notebook: a scalar, a small DataFrame or a plotly figure.

    Parameters
    ----------
    name
        The record's name (a column of the batch summary for scalars).
    value
        Number, bool, string, pandas DataFrame/Series, plotly figure, or a dict/list of
        JSON values. Recording the same name again replaces the value.

    Examples
    --------
    >>> import rapydli as rd
    >>> rd.record("accuracy", 0.94)  # doctest: +SKIP
    >>> rd.record("history", result.history)  # doctest: +SKIP
    """
    from rapydli.errors import ConfigError
    from rapydli.experiments.store.record import encode, store_record

    if not isinstance(name, str) or not name.strip():
        raise ConfigError(f"rd.record: name must be a non-empty string; got {name!r}")
    type_, encoded = encode(value)
    shown = _display(name, type_, encoded)
    where = store_record(name, type_, encoded)
    if where is None:
        kept = (
            f"{name!r} is kept in this notebook's output only" if shown else f"{name!r} is not kept (not in a notebook)"
        )
        print(
            f"rd.record: {kept}: no batch item or run is active in this process "
            "(run the notebook with `rapydli batch`, or record after rd.train)",
            file=sys.stderr,
        )


def _display(name: str, type_: str, encoded: Any) -> bool:
    """Show the record as an output of the running cell; False outside a notebook kernel.

    A terminal IPython (or a test's shell) keeps no outputs, so only a kernel counts.
    """
    if not in_kernel():
        return False
    from IPython.display import display

    from rapydli.experiments.store.record import MIMETYPE

    summary = encoded if type_ == "scalar" else f"<{type_}>"
    payload = {"name": name, "type": type_, "value": encoded}
    bundle = {"text/plain": f"recorded {name} = {summary}", MIMETYPE: payload}
    if type_ == "figure":
        bundle.update({**figure_bundle(encoded), "text/plain": bundle["text/plain"]})
    display(bundle, raw=True, metadata={"rapydli": payload})
    return True

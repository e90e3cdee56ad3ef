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

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rapydli.errors import ConfigError
from rapydli.experiments.restarts import Attempts, RestartPolicy
from rapydli.experiments.spec import RunSpec
from rapydli.trainer.config import TrainConfig

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

    from rapydli.cluster import Cluster
    from rapydli.experiments.spec import DataSource, LossFn, ModelSource, OptimizerFn

#: A client-side callback: called with each metrics row as it arrives: rank 0's rows
#: (``row["kind"]`` is ``"train"`` or ``"eval"``; keys in :mod:`rapydli.trainer.callbacks`),
#: the other ranks' step timings (``"rank"``; keys in :mod:`rapydli.trainer.task`), a
#: pipelined run's spans of each step per rank (``"timeline"``; keys in
#: :class:`rapydli.parallel.timeline.EmitTimeline`) and restarts (``"restart"``).
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
    timelines
        A pipelined run's latest ``timeline`` event of every rank (see :meth:`timeline`).
    model_dir
        Where the trained model lies as the ranks held it, each rank's pieces in a part of its
        own (``None``: the run kept none). Nothing is gathered until :meth:`model`,
        :meth:`state_dict` or :meth:`tensors` asks; the first of them assembles it once.

    Examples
    --------
    >>> result = rd.train(model_fn, data_fn, rd.TrainConfig(pipeline_stages=2, workers=4))  # doctest: +SKIP
    >>> model = result.model().eval()  # the trained nn.Module, whole, on the client  # doctest: +SKIP
    >>> model(inputs).argmax(-1)  # doctest: +SKIP
    """

    run_id: str | None
    history: pd.DataFrame
    figure: Any
    timelines: dict[int, dict[str, Any]] = field(default_factory=dict)
    model_dir: str | None = None
    model_fn: Callable[[], Any] | None = field(default=None, repr=False)
    _state: dict[str, Any] | None = field(default=None, repr=False, init=False)

    @property
    def samples_per_s(self) -> float | None:
        """The run's mean throughput of the global batch, as the run store, ``rapydli runs`` and the lab report it:
        every training step's samples over the sum of the step times (None without a timed step)."""
        from rapydli.experiments.store.compare import mean_samples_per_s

        steps = self.history[self.history["kind"] == "train"] if "kind" in self.history else self.history.iloc[0:0]
        if "step_time_s" not in steps or "samples_per_s" not in steps:
            return None
        timed = steps[["samples_per_s", "step_time_s"]].dropna()
        return mean_samples_per_s(zip(timed["samples_per_s"], timed["step_time_s"], strict=True))

    def state_dict(self) -> dict[str, Any]:
        """The trained model's full state (parameters and buffers, CPU tensors), as ``model_fn()``'s ``state_dict`` names it.

        Without a known ``model_fn``: by the names the engines gave them (a tied tensor
        under its first name only). Assembled here, on first use, from the pieces every pipeline stage, tensor slice and
        ZeRO-3 shard wrote to :attr:`model_dir` when the run ended (or from its checkpoint, for :func:`rapydli.load`).

        Raises
        ------
        ConfigError
            The run returned no model (it failed before training ended).
        """
        if self.model_fn is not None:  # every name model_fn()'s state_dict has (a tied weight under each of its names)
            return {name: tensor.detach().clone() for name, tensor in self.model().state_dict().items()}
        return {name: tensor.clone() for name, tensor in self._trained().items()}

    def tensors(self) -> Iterator[tuple[str, Any]]:
        """The trained model's parameters and buffers one ``(name, tensor)`` at a time, by the engines' names.

        Each is assembled from its pieces and handed out before the next is read
        (:func:`rapydli.trainer.checkpoint.iter_state`): a model bigger than this process's
        memory can be saved or inspected tensor by tensor.
        """
        from rapydli.trainer.checkpoint import iter_state

        if self._state is not None:
            yield from self._state.items()
            return
        yield from iter_state(self._model_directory())

    def _trained(self) -> dict[str, Any]:
        if self._state is None:
            from rapydli.trainer.checkpoint import read_state_dict

            self._state = read_state_dict(self._model_directory())[0]
        return self._state

    def _model_directory(self) -> str:
        """Where the model's pieces are, checked: a run that kept none, or whose pieces are gone, is a :class:`ConfigError`."""
        from rapydli.trainer.checkpoint import checkpoint_path

        if self.model_dir is None:
            raise ConfigError(
                f"run {self.run_id} has no trained model: it kept none (a sweep trial, a scaling point) or "
                "ended before training did"
            )
        if not checkpoint_path(self.model_dir).is_file():
            raise ConfigError(
                f"run {self.run_id} has no trained model in {self.model_dir}: it ended before training did, the "
                "directory was removed, or its ranks ran on hosts that do not share this directory with the notebook "
                "(RAPYDLI_HOME must be on a filesystem they share, as for checkpoints)"
            )
        return self.model_dir

    def model(self) -> Any:
        """The trained ``nn.Module`` on the client: ``model_fn()`` with :meth:`state_dict` loaded (a new one per call).

        Raises
        ------
        ConfigError
            The run returned no model, or ``model_fn`` is not known here (give it to
            :func:`rapydli.load`).
        """
        from rapydli.trainer.checkpoint import load_full_state

        if self.model_fn is None:
            raise ConfigError(
                f"run {self.run_id}: the function that builds its model is not known here: rd.load(run_id, model_fn=...)"
            )
        return load_full_state(self.model_fn(), self._trained())

    def timeline(self, replica: int = 0) -> Any:
        """A pipelined run's last step as a Gantt chart, ideal schedule and bubble (:mod:`rapydli.parallel.timeline`)."""
        from rapydli.parallel.timeline import figure_from_events

        return figure_from_events(self.timelines, replica)

    def _repr_html_(self) -> str:  # pragma: no cover - notebook display
        final = self.history.dropna(axis=1, how="all").tail(3)
        return f"<b>RunResult</b> run_id={self.run_id}<br>{final.to_html(index=False)}"


def run_training(
    model_fn: ModelSource | RunSpec,
    data_fn: DataSource | None,
    config: TrainConfig | dict[str, Any],
    cluster: Cluster | None = None,
    *,
    callbacks: Sequence[MetricsCallback] = (),
    progress: bool | Callable[..., Any] = True,
    name: str | None = None,
    restarts: int | None = None,
    min_workers: int | None = None,
    loss_fn: LossFn | None = None,
    optimizer_fn: OptimizerFn | None = None,
    metrics: Any = None,
    trackers: Sequence[str] | str | None = None,
) -> RunResult:
    """Train ``model_fn()`` on ``data_fn()`` data-parallel on every engine of a cluster.

    Parameters
    ----------
    model_fn
        Returns an ``nn.Module`` (the same on every rank; rank 0's weights win), or a
        ``"module:qualname"`` string naming such a function; or the front door's
        :class:`~rapydli.experiments.spec.RunSpec`, used whole (``data_fn``, ``loss_fn``,
        ``optimizer_fn`` and ``metrics`` are then its own: pass ``None``).
    data_fn
        Returns ``(train_dataset, val_dataset)`` (``val_dataset`` may be ``None``), or a
        ``"module:qualname"`` string.
    config
        A :class:`TrainConfig` (or a dict of its fields); validated before anything starts.
    cluster
        The cluster to use; ``None`` uses the one running in this kernel, else starts one
        of ``config.ranks_to_start()`` engines and stops it afterwards (:func:`rapydli.cluster.ensure_cluster`).
        The run uses every engine of the cluster: a ``config.workers`` that differs is a
        :class:`ConfigError` (:func:`check_workers`), and so is a layout its engines do not
        divide into (naming them).
    callbacks
        Client-side callables, each called with every metrics row as it arrives.
    progress
        Show a tqdm progress bar driven by rank 0's steps (a callable: makes the bar, as
        :class:`~rapydli.experiments.job.TrainingJob` takes it).
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
    restarts
        How many times to go on after ranks die (an engine killed, a host or a job gone):
        restart the cluster, resume from the last complete checkpoint, and continue the
        same run; default ``config.max_restarts``. Each restart is recorded on the run
        (``restarts`` record: time, cause, ranks, step resumed from) and reaches the
        callbacks as a ``kind="restart"`` row. An exception raised in the user's code is
        never retried. Without ``config.checkpoint_dir`` a directory under
        ``$RAPYDLI_HOME/checkpoints`` is used (removed when the run finishes).
    min_workers
        A restart may go on with this many engines (at least) when the cluster cannot bring
        all of them back (a host that no longer answers); default ``config.min_workers``
        (``None``: all of them). The run then continues on fewer ranks as
        ``config.on_resize`` says: ``"keep"`` the global batch (gradient accumulation) or
        ``"scale"`` the learning rate.
    trackers
        Experiment trackers the client also logs the run to (``["mlflow", "tensorboard",
        "wandb"]``), added to ``config.trackers`` and ``RAPYDLI_TRACKERS``
        (:mod:`rapydli.experiments.trackers`).

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
        A rank raised, or died with no restarts left; names the rank(s). The run is
        recorded as ``failed``.
    ClusterError
        A restart could not bring the engines back; the last checkpoint is kept and named,
        and the run is recorded as ``failed`` with this error (its ``restarts`` record
        holds the attempt).
    KeyboardInterrupt
        Ctrl-C, at any phase (the cluster start, shipping the task, autotuning, training):
        every rank is interrupted (blocked ones aborted) and the run is recorded as
        ``interrupted``; a cluster started for the run is stopped.
    """
    __tracebackhide__ = True  # noqa: F841 - IPython shows the user's cell, not these frames
    from rapydli.cluster import ensure_cluster

    cfg = config if isinstance(config, TrainConfig) else TrainConfig.from_dict(dict(config))
    spec = RunSpec.of(model_fn, data_fn, loss_fn, optimizer_fn, metrics)  # resolved and checked once, then passed whole
    for callback in callbacks:
        if not callable(callback):
            raise ConfigError(f"callbacks must be callables taking a metrics dict; got {callback!r}")
    policy, cfg = RestartPolicy.of(cfg.with_trackers(trackers), restarts, min_workers)
    # the run starts the cluster it owns, so that Ctrl-C during the start is recorded on it
    with ensure_cluster(cluster, n=cfg.ranks_to_start(), start=False) as chosen:
        check_workers(cfg, chosen.n)
        policy.check(chosen.n)
        attempts = policy.train(chosen, spec, cfg, callbacks=callbacks, name=name or spec.name, progress=progress)
    if attempts.job.exception is not None:
        raise attempts.job.exception
    policy.clean_up()
    return _result(attempts, spec, name or spec.name)


def _result(attempts: Attempts, spec: RunSpec, name: str) -> RunResult:
    """The :class:`RunResult` of a run that finished: its history over every attempt and its loss figure."""
    import pandas as pd

    from rapydli.experiments.figures import loss_figure

    job = attempts.job
    frame = job.history if not attempts.restarted else pd.DataFrame(attempts.history)
    return RunResult(
        run_id=job.run_id,
        history=frame,
        figure=loss_figure(frame, title=name, restarts=attempts.restarted),
        timelines=job.timelines,
        model_dir=job.model_dir,
        model_fn=spec.model_fn,
    )


def load_run(run_id: str, model_fn: ModelSource | None = None) -> RunResult:
    """A recorded run with its trained model, assembled when asked (``rd.load``).

    The model is the one the ranks wrote when the run ended (its ``model`` record), else
    its last checkpoint; its pieces are assembled in this process on the first
    :meth:`RunResult.model`, :meth:`~RunResult.state_dict` or :meth:`~RunResult.tensors`
    (:mod:`rapydli.trainer.checkpoint`). ``history`` is the store's (one row per step, a
    column per metric) and ``figure`` is ``None``.

    Parameters
    ----------
    run_id
        The run's id in the store (or a unique prefix of it).
    model_fn
        What builds its model; ``None``: the ``"module:qualname"`` the run recorded (a
        function defined in a notebook must be given again).

    Raises
    ------
    ConfigError
        The run kept no model and wrote no checkpoint (a sweep trial, a run whose config
        had no ``checkpoint_dir`` from before models were kept), or its model function is
        not importable and none was given.
    """
    from rapydli.experiments.store.refs import resolve_callable
    from rapydli.experiments.store.runview import run as recorded_run
    from rapydli.trainer.checkpoint import checkpoint_path

    record = recorded_run(run_id)
    kept = (record.records.get("model") or {}).get("directory")
    directory = (
        kept
        if kept is not None and checkpoint_path(kept).is_file()
        else record.params.get("config", {}).get("checkpoint_dir")
    )
    if directory is None or not checkpoint_path(directory).is_file():
        where = f" (its model directory {kept} holds none)" if kept is not None else ""
        raise ConfigError(
            f"run {record.info['id']} kept no trained model and wrote no checkpoint{where}: its model cannot be loaded"
        )
    recorded = record.params.get("model_fn")
    builder = None
    if model_fn is not None:
        builder = resolve_callable(model_fn, "model_fn")
    elif isinstance(recorded, str) and ":" in recorded and " " not in recorded:
        builder = resolve_callable(recorded, "model_fn")
    # the history as the store holds it (one row per step, a column per metric); no figure
    return RunResult(
        run_id=record.info["id"], history=record.history(), figure=None, model_dir=str(directory), model_fn=builder
    )


def check_workers(config: TrainConfig, engines: int) -> None:
    """Raise :class:`ConfigError` when ``config.workers`` is set and is not the ``engines`` the run would use.

    ``rd.train`` runs on every engine of the cluster it uses; ``workers`` only sizes a
    cluster it starts itself. A ``workers`` that differs from the cluster's engines is
    refused before anything runs, rather than ignored (and recorded as if it had run).
    """
    if config.workers is not None and config.workers != engines:
        raise ConfigError(
            f"TrainConfig.workers={config.workers}, but the cluster this run uses has {engines} engines: rd.train runs on every "
            f"engine of its cluster. Leave workers=None (the cluster decides), set workers={engines}, or pass cluster= one of "
            f"{config.workers} engines (stop the running one first: cluster.stop() or %rapydli stop)"
        )

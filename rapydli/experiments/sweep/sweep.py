"""``rd.sweep``: hyperparameter sweeps where every trial is a multi-rank data-parallel job.

The notebook runs Optuna's ask-and-tell loop (design flow 3): the sampler proposes a
trial's parameters, the trial trains on its own group of ``workers_per_trial`` engines
(an MPI communicator over just them), ``parallel`` groups run trials side by side, and
every intermediate metric from a trial's rank 0 is reported to the pruner before the trial
goes on (its ranks wait for the answer), and a pruned trial stops on all of its ranks
within one step of the decision (``request_stop``: they end after the same step); why (the step,
the value and the bar it missed, :mod:`rapydli.experiments.sweep.pruning`) is recorded with the
trial as its ``prune`` record. Samplers and pruners are Optuna's, looked up by name in :data:`SAMPLERS` and :data:`PRUNERS`.

A trial has one lifecycle (:mod:`rapydli.experiments.sweep.lifecycle`: Optuna's RUNNING,
COMPLETE, PRUNED, FAIL), told to Optuna and recorded once as its run's status in the store.
A sampler that declares the search done (Optuna's ``GridSampler`` once its grid is used up)
ends the sweep normally. A trial that raises is recorded as ``FAIL`` with its error and the sweep goes on (the
cluster is restarted if its engines died; trials that were running beside it are recorded
as ``FAIL`` too and run again with the same parameters, since MPI takes a job's other
ranks down when one dies); Ctrl-C stops the running trials within a
few seconds and returns what has finished.

Examples
--------
>>> result = rd.sweep(models.mlp, datasets.digits, rd.TrainConfig(max_steps=40, eval_every=10),
...                   {"lr": rd.loguniform(1e-4, 1e-1)}, trials=8, workers_per_trial=2)  # doctest: +SKIP
>>> result.best_params  # doctest: +SKIP
{'lr': 0.0123}
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, Literal

from rapydli.errors import ConfigError, RapydliError
from rapydli.experiments.job import STOP_GRACE_S, Recording, TrainingJob
from rapydli.experiments.spec import RunSpec
from rapydli.experiments.sweep.lifecycle import STORE_STATUS, optuna_state
from rapydli.experiments.sweep.pruning import explain_prune
from rapydli.experiments.sweep.space import Dimension, validate_space
from rapydli.parallel.layout import Layout
from rapydli.trainer.config import TrainConfig

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

    from rapydli.cluster import Cluster
    from rapydli.experiments.spec import DataSource, LossFn, ModelSource, OptimizerFn


def _tpe(space: Mapping[str, Dimension], seed: int) -> Any:
    import optuna

    return optuna.samplers.TPESampler(seed=seed)


def _random(space: Mapping[str, Dimension], seed: int) -> Any:
    import optuna

    return optuna.samplers.RandomSampler(seed=seed)


def _grid(space: Mapping[str, Dimension], seed: int) -> Any:
    import optuna

    return optuna.samplers.GridSampler({name: dim.grid() for name, dim in space.items()}, seed=seed)


def _successive_halving() -> Any:
    import optuna

    # min_resource=1 (not "auto", which waits for a finished trial): the first trials set the rungs' bar too
    return optuna.pruners.SuccessiveHalvingPruner(min_resource=1)


def _median() -> Any:
    import optuna

    return optuna.pruners.MedianPruner(n_startup_trials=2)


def _no_pruning() -> Any:
    import optuna

    return optuna.pruners.NopPruner()


#: Optuna samplers by name: ``f(space, seed) -> BaseSampler``.
SAMPLERS: dict[str, Callable[[Mapping[str, Dimension], int], Any]] = {"tpe": _tpe, "random": _random, "grid": _grid}
#: Optuna pruners by name (``median`` starts pruning after 2 finished trials).
PRUNERS: dict[str, Callable[[], Any]] = {
    "successive_halving": _successive_halving,
    "median": _median,
    "none": _no_pruning,
}

#: After Ctrl-C (or a failure), the running trials' stop requests get this long before the
#: jobs interrupt them (:meth:`TrainingJob.request_stop`); a plain stop gets ``STOP_GRACE_S``.
INTERRUPT_AFTER_S = 1.5
POLL_S = 0.02


@dataclass
class SweepResult:
    """What :func:`sweep` returns.

    Attributes
    ----------
    table
        One row per trial: ``trial``, ``state`` (COMPLETE, PRUNED, FAIL), the parameters,
        ``value`` (the trial's value as Optuna was told it: the metric's last report),
        ``best`` (the best ``value`` of the COMPLETE trials up to and including this one,
        so the last row's is the sweep's best value), ``steps``, ``duration_s``,
        ``ranks``, ``error``, ``run_id``.
    best_params
        Parameters of the best complete trial (``None`` if none completed).
    best_value, best_trial
        That trial's ``value`` (Optuna's ``study.best_value``) and number (``None`` if none completed).
    figure
        Plotly figure: metric per trial and a parallel-coordinates plot.
    run_id
        The ``sweep`` run in the store (``None`` when recording is off).
    study
        The Optuna study.
    """

    table: pd.DataFrame
    best_params: dict[str, Any] | None
    figure: Any
    run_id: str | None = None
    study: Any = None
    best_value: float | None = None
    best_trial: int | None = None

    def _repr_html_(self) -> str:  # pragma: no cover - notebook display
        return f"<b>SweepResult</b> best_params={self.best_params}<br>{self.table.to_html(index=False)}"


@dataclass
class _Trial:
    trial: Any
    params: dict[str, Any]
    ranks: list[int]
    job: TrainingJob | None = None
    state: str = "RUNNING"
    reports: list[tuple[int, float]] = field(default_factory=list)
    error: str = ""
    pruned: bool = False
    prune: dict[str, Any] | None = None  # why the pruner stopped it (rapydli.experiments.sweep.pruning)

    @property
    def value(self) -> float | None:
        """The trial's value: its last report (what Optuna is told for COMPLETE and PRUNED)."""
        return self.reports[-1][1] if self.reports else None


class Sweep:
    """A sweep being run; :func:`sweep` builds one and calls :meth:`run`.

    Separate from :func:`sweep` so that a widget can run it in a thread and call
    :meth:`stop`. Parameters as for :func:`sweep`; ``view`` is anything with
    ``update(table, force=False)``, called whenever a trial starts, reports or ends (the
    notebook's :class:`rapydli.widgets.sweepview.SweepView`).
    """

    def __init__(
        self,
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
        view: Any = None,
        name: str = "sweep",
        loss_fn: LossFn | None = None,
        optimizer_fn: OptimizerFn | None = None,
        metrics: Any = None,
    ) -> None:
        import optuna

        self.config = config if isinstance(config, TrainConfig) else TrainConfig.from_dict(dict(config))
        self.space = validate_space(space)
        if not isinstance(trials, int) or isinstance(trials, bool) or trials < 1:
            raise ConfigError(f"trials={trials!r} is invalid: an integer >= 1")
        if not isinstance(workers_per_trial, int) or workers_per_trial < 1:
            raise ConfigError(f"workers_per_trial={workers_per_trial!r} is invalid: an integer >= 1")
        if direction not in ("minimize", "maximize"):
            raise ConfigError(f"direction={direction!r} is invalid: 'minimize' or 'maximize'")
        if not isinstance(metric, str) or not metric:
            raise ConfigError(
                f"metric={metric!r} is invalid: a metric name such as 'val_loss', 'val_accuracy' or 'loss'"
            )
        self.sampler = _lookup(sampler, SAMPLERS, "sampler", optuna.samplers.BaseSampler, self.space, seed)
        self.pruner = _lookup(pruner, PRUNERS, "pruner", optuna.pruners.BasePruner)
        from rapydli.cluster import current

        known = cluster if cluster is not None else current()
        size = known.n if known is not None else max(self.config.ranks_to_start(), workers_per_trial * (parallel or 1))
        if workers_per_trial > size:
            raise ConfigError(f"workers_per_trial={workers_per_trial} is more than the cluster's {size} engines")
        stages, tp = self.config.pipeline_stages, self.config.tensor_parallel
        if not Layout.fits(workers_per_trial, stages, tp):
            layout = f"pipeline_stages={stages}" + (f" x tensor_parallel={tp}" if tp > 1 else "")
            parts = "stages" + (" x tensor ranks" if tp > 1 else "")
            raise ConfigError(
                f"workers_per_trial={workers_per_trial} cannot run {layout}: "
                f"a trial's ranks are its replicas x {parts}; use a multiple of {stages * tp}"
            )
        parallel = size // workers_per_trial if parallel is None else parallel
        if not isinstance(parallel, int) or parallel < 1 or parallel * workers_per_trial > size:
            raise ConfigError(
                f"parallel={parallel!r} is invalid: 1..{size // workers_per_trial} groups of {workers_per_trial} fit in {size} engines"
            )
        for params in enqueue:
            unknown = set(params) - set(self.space)
            if unknown:
                raise ConfigError(f"enqueue has parameters {sorted(unknown)} that are not in the space")
        self.spec = RunSpec.of(
            model_fn, data_fn, loss_fn, optimizer_fn, metrics
        )  # resolved and checked once; every trial trains it
        self.trials, self.workers_per_trial, self.parallel = trials, workers_per_trial, parallel
        self.metric, self.direction, self.seed, self.name = metric, direction, seed, name
        self.cluster: Cluster | None = known
        self._own_cluster, self._size = False, size
        self.view = view
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        study_direction: Literal["minimize", "maximize"] = (
            "minimize" if direction == "minimize" else "maximize"
        )  # checked above
        self.study = optuna.create_study(direction=study_direction, sampler=self.sampler, pruner=self.pruner)
        for params in enqueue:
            self.study.enqueue_trial(dict(params))
        self.records: list[_Trial] = []
        self._retried = 0  # trials ended by another trial's dead engine, run again
        self.exhausted = False  # the sampler declared the search done (a grid used up)
        self._stop = threading.Event()
        self.run_id: str | None = None

    # -- control ------------------------------------------------------------------------------
    def stop(self) -> None:
        """Stop the sweep (thread-safe): no new trials; running ones stop after their step."""
        self._stop.set()

    def run(self) -> SweepResult:
        """Run every trial (``parallel`` at a time) and return the :class:`SweepResult`."""
        from rapydli.experiments.store.runstore import open_store
        from rapydli.experiments.trackers.follow import follow

        store = open_store()
        if store is not None:
            self.run_id = store.create_run("sweep", self.name, self._params(), world_size=self._size, seed=self.seed)
        trackers = follow(store, self.run_id, self.config.trackers)  # the parent of the trials' tracker runs
        if trackers is not None:
            trackers.wait_open()  # made once, before the first trial's
        from rapydli.cluster import choose_cluster

        self.cluster, self._own_cluster = choose_cluster(
            self.cluster, n=self._size, need=self.workers_per_trial * self.parallel
        )
        status, error = "finished", None
        try:
            self._loop()
        except KeyboardInterrupt:
            status, error = "interrupted", "interrupted by the user"
            self._stop_running(interrupted=True)
        except BaseException as exc:
            status, error = "failed", f"{type(exc).__name__}: {exc}"
            self._stop_running(interrupted=True)
            raise
        finally:
            if self._own_cluster and self.cluster is not None:
                self.cluster.stop()
            result = self.result()
            if store is not None and self.run_id is not None:
                told = [
                    (r.trial.number, self.metric, v)
                    for r in self.records
                    if r.state in ("COMPLETE", "PRUNED") and (v := r.value) is not None
                ]
                store.log_metrics(self.run_id, told)
                store.add_record(self.run_id, "best_params", "json", result.best_params)
                if result.best_value is not None:  # the sweep's value (its final metric): the best trial's
                    store.add_record(self.run_id, self.metric, "scalar", result.best_value)
                    store.add_record(self.run_id, "best_trial", "scalar", result.best_trial)
                store.add_record(
                    self.run_id, "trials", "table", result.table.drop(columns=["error"]).to_dict("records")
                )
                store.finish_run(self.run_id, status, error)
            if trackers is not None:
                trackers.close()
            if self.view is not None:
                self.view.update(result.table, force=True)
        return result

    # -- the ask-and-tell loop ----------------------------------------------------------------
    def _loop(self) -> None:
        groups = [
            list(range(g * self.workers_per_trial, (g + 1) * self.workers_per_trial)) for g in range(self.parallel)
        ]
        while True:
            busy = [r.ranks for r in self.records if r.state == "RUNNING"]
            free = [g for g in groups if g not in busy] if self._cluster_healthy(busy) else []
            while free and self._started() < self.trials and not self._stop.is_set() and not self.exhausted:
                ranks = free.pop(0)
                if self._start(ranks).state != "RUNNING":
                    free.append(ranks)
            running = [r for r in self.records if r.state == "RUNNING"]
            if not running:
                if self._stop.is_set() or self._started() >= self.trials or self.exhausted:
                    return
                continue
            if self._stop.is_set():
                self._stop_running(interrupted=False)
                return
            for record in running:
                if record.state == "RUNNING":  # a restart after a failure may have ended it meanwhile
                    self._advance(record, POLL_S / len(running))
                    self._after_failure(record)
            self._refresh()

    def _started(self) -> int:
        """Trials started, not counting those ended by another trial's failure (they run again)."""
        return len(self.records) - self._retried

    def _cluster_healthy(self, busy: list[list[int]]) -> bool:
        """Whether new trials may be placed: never on a cluster with a dead engine.

        When one rank dies, MPI takes the others of the job down a moment later, so a trial
        placed on a surviving engine would die too. Running trials notice the death and
        restart the cluster (:meth:`_after_failure`); with none running, restart here.
        """
        if self.cluster is None or self.cluster.running:
            return True
        if not busy:
            self.cluster.restart()
            return True
        return False

    def _start(self, ranks: list[int]) -> _Trial:
        trial = self.study.ask()
        params = {name: dim.suggest(trial, name) for name, dim in self.space.items()}
        record = _Trial(trial, params, ranks)
        self.records.append(record)
        try:
            config = self.config.replace(**params)
            record.job = TrainingJob(
                self.cluster,  # type: ignore[arg-type]
                self.spec,
                config,
                ranks,
                callbacks=[partial(self._on_row, record)],
                await_verdict=self.metric,
                recording=Recording(
                    kind="trial",
                    name=f"{self.name}-trial-{trial.number}",
                    parent=self.run_id,
                    extra_params={"trial": trial.number, "params": params},
                    end_status=False,
                ),
            ).start()
        except RapydliError as exc:  # an invalid combination of parameters: the trial fails, the sweep goes on
            self._tell(record, "FAIL", str(exc))
        self._refresh(force=True)
        return record

    def _on_row(self, record: _Trial, row: dict[str, Any]) -> None:
        value = row.get(self.metric)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or record.pruned:
            return
        step = int(row["step"])
        if record.reports and record.reports[-1][0] == step:
            return  # one report per step (an epoch-end eval can repeat a step's metric)
        record.reports.append((step, float(value)))
        record.trial.report(float(value), step)
        if record.trial.should_prune():
            record.pruned = True
            record.prune = explain_prune(self.study, record.trial.number, self.pruner, self.metric, step, float(value))
            record.job.request_stop(status="pruned")  # type: ignore[union-attr]

    def _advance(self, record: _Trial, wait_s: float) -> None:
        job = record.job
        assert job is not None
        if job.poll(wait_s):
            self._settle(record)

    def _settle(self, record: _Trial, stopped: str = "stopped before its last step") -> None:
        """Tell how an ended trial's job ended: FAIL, PRUNED, COMPLETE (all its steps, a finite value)."""
        job = record.job
        assert job is not None
        if job.state == "failed":
            self._tell(record, "FAIL", job.error)
        elif record.pruned:
            self._tell(record, "PRUNED")
        elif job.state == "stopped":  # ended early, not by the pruner: its value is not a finished trial's
            steps = record.reports[-1][0] if record.reports else 0
            self._tell(record, "FAIL", f"{stopped} (its last report at step {steps})")
        elif record.value is None or not math.isfinite(record.value):
            self._tell(
                record,
                "FAIL",
                f"the trial reported no finite {self.metric!r} (metrics seen: {sorted(job.final_metrics())})",
            )
        else:
            self._tell(record, "COMPLETE")

    def _tell(self, record: _Trial, state: str, error: str = "") -> None:
        """Tell Optuna the trial's state and record it, once, as its run's status (with why it was pruned)."""
        record.state, record.error = state, error
        value = record.value if state == "COMPLETE" else None
        try:
            self.study.tell(record.trial, value, state=optuna_state(state))
        except (
            RuntimeError
        ) as exc:  # the sampler called study.stop() (a grid used up): Optuna has stored the state first
            if "Study.stop" not in str(exc):
                raise
            self.exhausted = True
        job = record.job
        if job is not None and job.store is not None and job.run_id is not None:
            if state == "PRUNED" and record.prune is not None:
                job.store.add_record(job.run_id, "prune", "json", record.prune)
            job.store.finish_run(job.run_id, STORE_STATUS[state], error or None)
        if job is not None:
            job.close_trackers()  # after the status: the trial's tracker run ends as the trial did

    def _after_failure(self, record: _Trial) -> None:
        """When a failed trial took its engines down, end the others and restart the cluster."""
        if record.state != "FAIL" or self.cluster is None or self.cluster.running:
            return
        self._stop_running(
            interrupted=True, reason="the cluster's engines died with another trial; run again", retry=True
        )
        self.cluster.restart()

    def _stop_running(self, interrupted: bool, reason: str = "stopped with the sweep", retry: bool = False) -> None:
        """Stop every running trial (stop request; SIGINT after a while) and record how each ended
        (pruned, complete if it had done its last step, else failed with ``reason``).

        With ``retry``, each is enqueued again with its parameters (it failed through no fault of its own).
        """
        running = [r for r in self.records if r.state == "RUNNING" and r.job is not None]
        for record in running:  # each job interrupts itself if it has not stopped after the grace
            record.job.request_stop(grace_s=INTERRUPT_AFTER_S if interrupted else STOP_GRACE_S)  # type: ignore[union-attr]
        while any(r.job.state == "running" for r in running):  # type: ignore[union-attr]
            for record in running:
                record.job.poll(POLL_S)  # type: ignore[union-attr]
        for record in running:
            if not retry:  # pruned, completed meanwhile, or stopped before its last step
                self._settle(record, stopped=reason)
                continue
            self._tell(record, "FAIL", reason)
            if retry:
                self.study.enqueue_trial(dict(record.params))
                self._retried += 1
        self._refresh(force=True)

    # -- reporting ----------------------------------------------------------------------------
    def table(self) -> pd.DataFrame:
        """One row per trial so far (see :class:`SweepResult`)."""
        import pandas as pd

        better = min if self.direction == "minimize" else max
        rows, best = [], None
        for r in sorted(self.records, key=lambda t: t.trial.number):
            if r.state == "COMPLETE" and r.value is not None:
                best = r.value if best is None else better(best, r.value)
            job = r.job
            rows.append(
                {
                    "trial": r.trial.number,
                    "state": r.state,
                    **r.params,
                    "value": r.value,
                    "best": best,
                    "steps": r.reports[-1][0] if r.reports else 0,
                    "duration_s": job.duration_s if job else 0.0,
                    "ranks": ",".join(map(str, r.ranks)),
                    "error": r.error,
                    "run_id": job.run_id if job else None,
                }
            )
        columns = ["trial", "state", *self.space, "value", "best", "steps", "duration_s", "ranks", "error", "run_id"]
        return pd.DataFrame(rows, columns=columns)

    def result(self) -> SweepResult:
        """The :class:`SweepResult` of the trials so far."""
        from rapydli.experiments.figures import sweep_figure

        table = self.table()
        complete = table[table["state"] == "COMPLETE"]
        best, best_value, best_trial = None, None, None
        if len(complete):
            index = complete["value"].idxmin() if self.direction == "minimize" else complete["value"].idxmax()
            best = {name: _plain(complete.loc[index, name]) for name in self.space}
            best_value, best_trial = float(complete.loc[index, "value"]), int(complete.loc[index, "trial"])
        figure = sweep_figure(table, self.metric, list(self.space), title=f"sweep: {self.metric} ({self.direction})")
        return SweepResult(
            table=table,
            best_params=best,
            figure=figure,
            run_id=self.run_id,
            study=self.study,
            best_value=best_value,
            best_trial=best_trial,
        )

    def _refresh(self, force: bool = False) -> None:
        if self.view is not None:
            self.view.update(self.table(), force=force)

    def _params(self) -> dict[str, Any]:
        return {
            "config": self.config.to_dict(),
            "space": {k: repr(v) for k, v in self.space.items()},
            "trials": self.trials,
            "workers_per_trial": self.workers_per_trial,
            "parallel": self.parallel,
            "metric": self.metric,
            "direction": self.direction,
            "sampler": type(self.sampler).__name__,
            "pruner": type(self.pruner).__name__,
        }


def _lookup(value: Any, registry: Mapping[str, Callable[..., Any]], argument: str, base: type, *args: Any) -> Any:
    if isinstance(value, base):
        return value
    if isinstance(value, str) and value in registry:
        return registry[value](*args)
    raise ConfigError(
        f"{argument}={value!r} is invalid: one of {', '.join(map(repr, registry))} or an Optuna {base.__name__}"
    )


def _plain(value: Any) -> Any:
    return value.item() if hasattr(value, "item") else value


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
    view: Any = None,
    loss_fn: LossFn | None = None,
    optimizer_fn: OptimizerFn | None = None,
    metrics: Any = None,
) -> SweepResult:
    """Search ``space`` with ``trials`` training runs, each a data-parallel job on its own engines.

    Parameters
    ----------
    model_fn, data_fn, config
        As for ``rd.train``; each trial trains ``config`` with the trial's parameters
        substituted. Set ``config.eval_every`` so that ``val_loss`` is reported during a
        trial (the pruner sees every report).
    space
        ``{TrainConfig field: rd.loguniform(a, b) | rd.uniform(a, b) | rd.choice([...]) | rd.intrange(a, b)}``.
    trials
        Number of trials.
    workers_per_trial
        Engines (MPI ranks) per trial.
    parallel
        Trials at once, on disjoint engine groups (default: ``cluster.n // workers_per_trial``).
    pruner
        ``"successive_halving"``, ``"median"``, ``"none"`` or an Optuna pruner.
    metric, direction
        The metric row key to optimise (``val_loss``, ``val_accuracy``, ``loss``) and
        ``"minimize"``/``"maximize"``; a trial's value is its last report (what Optuna is
        told), and the sweep's value (``SweepResult.best_value``, the store's final metric) the
        best value of its COMPLETE trials.
    sampler
        ``"tpe"``, ``"random"``, ``"grid"`` (``choice``/``intrange`` only) or an Optuna sampler.
    cluster
        The cluster; ``None``: the one running in this kernel, else a new one
        (``workers_per_trial * parallel`` engines, at least ``config.ranks_to_start()``), stopped afterwards.
    seed
        Seed of the sampler.
    enqueue
        Parameter sets to try first (e.g. a known baseline), before the sampler's.
    view
        Anything with ``update(table, force=False)``, called as trials start, report and end
        (the notebook front door passes a live :class:`~rapydli.widgets.sweepview.SweepView`).
    loss_fn, optimizer_fn, metrics
        As for ``rd.train``, the same in every trial (``optimizer_fn(model, config)`` sees
        the trial's ``config.lr``).

    Returns
    -------
    SweepResult
        ``table``, ``best_params``, ``figure`` (and ``run_id``, ``study``).

    Raises
    ------
    ConfigError
        Invalid arguments (before anything starts).
    """
    runner = Sweep(
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
    return runner.run()

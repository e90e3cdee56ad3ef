"""``rd.scaling_study``: the same training at several worker counts; speedup and efficiency vs ideal.

Each point trains ``steps`` optimizer steps on the first ``k`` engines of the cluster
(a communicator over just them) and takes the medians of the step timings after a
warm-up: step time, compute time (step time minus the time the step waited for
communication), allreduce time and waiting time. ``weak`` scaling keeps the per-rank
batch (the global batch grows with ``k``); ``strong`` keeps the global batch of the
smallest count and splits it. Speedup is the throughput ratio to the smallest count
(``samples/s``), efficiency the speedup over the ideal ``k / k0``.

Every point is measured ``repeats`` times in interleaved rounds (each round measures every
point once, so load that comes and goes hits them alike); a point's timings are the
medians of its rounds, its speedup the median of the per-round ratios to the first point
of the same round, with the range the rounds span (``speedup_low``, ``speedup_high``,
:mod:`rapydli.spread`). ``speedup_verdict`` says whether that range is above
or below 1 or spans it (then no conclusion). An efficiency above 1 (more than the ideal)
is not a result but an artefact of the load on the machine: it is left out of the table
(NaN) and ``flag`` names it with the load seen.

``pipeline_stages=[1, 2, ...]`` measures every worker count at every stage count that
divides it (``k / p`` data-parallel replicas of a ``p``-stage pipeline, ``k / (p t)`` with
``tensor_parallel=t``; the others are skipped and named in ``notes``). A replica then plays the part a rank plays above: weak
scaling keeps the batch per replica, strong splits the first point's global batch over
the replicas; speedup and efficiency are against the first point (fewest workers, fewest
stages) and the ideal ``k / k0``, so pipelined and data-parallel points on the same
workers compare directly.

``predict=[4, 8, ...]`` extrapolates with :mod:`rapydli.experiments.planning.perfmodel`: the
measured compute time per step (of the largest measured count, which includes the
contention of ranks sharing a node) plus a ring allreduce of the gradients with α, β
fitted on this cluster (or given as ``network``). At every measured count the model
(measured compute of that count plus the modelled allreduce) is checked against the
measured step time (within 20%). The model describes data parallelism: only the
one-stage points are predicted and checked.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rapydli.errors import ConfigError
from rapydli.experiments.figures import fill_scaling_figure, scaling_figure
from rapydli.experiments.job import Recording, TrainingJob
from rapydli.experiments.planning.perfmodel import RingModel, measure_ring, predict_step_time
from rapydli.experiments.spec import RunSpec
from rapydli.parallel.layout import Layout
from rapydli.spread import Spread, busy, load_text, machine_load
from rapydli.trainer.config import TrainConfig
from rapydli.trainer.task import WARMUP_STEPS

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

    from rapydli.cluster import Cluster
    from rapydli.experiments.spec import DataSource, LossFn, ModelSource, OptimizerFn

TOLERANCE = 0.20
COLUMNS = [
    "workers", "pipeline_stages", "data_parallel", "hosts", "global_batch", "samples_per_s", "speedup", "ideal_speedup", "efficiency",
    "step_time_s",
    "compute_time_s", "comm_time_s", "comm_wait_s", "comm_fraction", "predicted_step_time_s", "prediction_error",
    "repeats", "step_time_low_s", "step_time_high_s", "speedup_low", "speedup_high", "speedup_verdict", "load", "flag",
]  # fmt: skip
#: Timing fields of a point whose median over the rounds the table shows.
TIMED = ("samples_per_s", "step_time_s", "compute_time_s", "comm_time_s", "comm_wait_s", "comm_fraction")


@dataclass
class ScalingResult:
    """What :func:`scaling_study` returns.

    Attributes
    ----------
    table
        One row per measured point: ``workers``, ``pipeline_stages``, ``data_parallel``
        (``workers / (pipeline_stages x tensor_parallel)``), ``hosts`` (where its ranks ran,
        e.g. ``"node1, node2"``), ``global_batch``, ``samples_per_s``,
        ``speedup``, ``ideal_speedup``, ``efficiency``, ``step_time_s``,
        ``compute_time_s``, ``comm_time_s`` (gradient allreduce time),
        ``comm_wait_s`` (time the step waited for it), ``comm_fraction``
        (``comm_wait_s / step_time_s``), and with a model ``predicted_step_time_s`` and
        ``prediction_error`` (relative; one-stage points only); the spread: ``repeats``
        (rounds measured), ``step_time_low_s``/``step_time_high_s`` and
        ``speedup_low``/``speedup_high`` (the range of the rounds), ``speedup_verdict``
        (``above 1``, ``below 1`` or why no conclusion), ``load`` (the highest load seen
        while it was measured) and ``flag`` (an efficiency above 1: its value, the load,
        what to do; the ``efficiency`` column is then NaN).
    figure
        Speedup and efficiency against workers: measured (a line per stage count),
        ideal, and predicted (dashed).
    prediction
        Predicted rows (``workers``, ``step_time_s``, ``samples_per_s``, ``speedup``,
        ``efficiency``, ``basis``) for ``predict`` and the measured counts, or ``None``;
        ``basis`` says which rows were checked against a measurement and which are
        extrapolations, of a model validated here or not.
    model
        The :class:`RingModel` used, or ``None``.
    validated
        Whether every predicted point is within 20% of its measurement, and every measured
        point's rounds agree within 20% (``None`` without a model); why not in ``notes``.
    run_id
        The ``scaling`` run in the store.
    notes
        What the study left out and why (worker counts a stage count does not divide), and
        every measurement flag (efficiency above 1, rounds too far apart to validate).
    """

    table: pd.DataFrame
    figure: Any
    prediction: pd.DataFrame | None = None
    model: RingModel | None = None
    validated: bool | None = None
    run_id: str | None = None
    mode: str = "weak"
    notes: list[str] = field(default_factory=list)

    def _repr_html_(self) -> str:  # pragma: no cover - notebook display
        return f"<b>ScalingResult</b> ({self.mode}) validated={self.validated}<br>{self.table.to_html(index=False)}"


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
    on_point: Callable[[Any], None] | None = None,
    loss_fn: LossFn | None = None,
    optimizer_fn: OptimizerFn | None = None,
    metrics: Any = None,
    repeats: int = 3,
) -> ScalingResult:
    """Train at each worker count and measure throughput, compute and communication time.

    Parameters
    ----------
    model_fn, data_fn, config
        As for ``rd.train``.
    workers
        Worker counts to measure (each <= the cluster's engines), e.g. ``[1, 2]``.
    mode
        ``"weak"`` (per-rank batch fixed) or ``"strong"`` (global batch fixed; it must
        divide by every count).
    steps
        Optimizer steps per point (the first 2 are warm-up and not timed).
    predict
        Worker counts to extrapolate to with the α–β ring model.
    cluster
        The cluster (at least ``max(workers)`` engines); ``None``: the one running in this
        kernel, else a new one of ``max(workers)`` engines, stopped afterwards.
    pipeline_stages
        Pipeline stage counts to measure at each worker count, e.g. ``[1, 2]`` (default:
        ``config.pipeline_stages``); a count that (times ``config.tensor_parallel``) does not
        divide a worker count skips that point. The other pipeline fields (``microbatches``, schedule, split) come from
        ``config``.
    network
        A :class:`RingModel` for the target network; default: fitted from allreduces
        timed on this cluster.
    on_point
        Called with the figure (a plotly figure of what is measured so far) after each
        point and at the end; the notebook front door redraws its live plot with it.
    loss_fn, optimizer_fn, metrics
        As for ``rd.train``.
    repeats
        Interleaved rounds: every point is measured this many times (its spread).

    Returns
    -------
    ScalingResult

    Examples
    --------
    >>> rd.scaling_study(model_fn, data_fn, rd.TrainConfig(microbatches=4), workers=[2, 4],
    ...                  pipeline_stages=[1, 2]).table  # doctest: +SKIP
    """
    from rapydli.cluster import choose_cluster

    cfg = config if isinstance(config, TrainConfig) else TrainConfig.from_dict(dict(config))
    spec = RunSpec.of(model_fn, data_fn, loss_fn, optimizer_fn, metrics)  # resolved and checked once, then passed whole
    plan = ScalingPlan.of(
        cfg, workers, mode, steps, repeats, predict, pipeline_stages, network
    )  # every point checked before anything starts
    cluster, own = choose_cluster(cluster, n=plan.counts[-1], need=plan.counts[-1])
    record = _StudyRecord.open(spec, cfg, plan)
    figure = scaling_figure([], None, mode=mode, stages=plan.stage_counts)
    status, error = "failed", None
    try:
        points, gradient_bytes = _measure(cluster, spec, plan, record.run_id, figure, on_point)
        model = (
            network
            if network is not None or not plan.predict_counts
            else measure_ring(cluster, algorithm=cfg.allreduce)
        )
        table = _table(points, model, gradient_bytes, mode)
        prediction = (
            _prediction(points, model, gradient_bytes, sorted(set(plan.predict_counts) | set(plan.counts)), mode)
            if model
            else None
        )
        fill_scaling_figure(figure, table, prediction, model)
        status = "finished"
    except BaseException as exc:
        error = f"{type(exc).__name__}: {exc}"
        raise
    finally:
        if own:
            cluster.stop()
        record.finish(status, error, table if status == "finished" else None, model if status == "finished" else None)
    validated, notes = _verdict(table, prediction, model, plan.notes)
    static = scaling_figure(
        table.to_dict("records"), prediction, mode=mode, model=model, stages=plan.stage_counts, validated=validated
    )
    if on_point is not None:
        on_point(static)
    return ScalingResult(
        table=table,
        figure=static,
        prediction=prediction,
        model=model,
        validated=validated,
        run_id=record.run_id,
        mode=mode,
        notes=notes,
    )


@dataclass(frozen=True)
class ScalingPlan:
    """The points a scaling study measures, each with its layout and config, checked before anything starts.

    Attributes
    ----------
    counts, stage_counts, predict_counts
        The worker counts measured, the pipeline stage counts tried at each, the worker
        counts predicted (sorted, distinct).
    mode, steps, repeats
        As :func:`scaling_study` takes them.
    layouts
        Each measured point's :class:`Layout`, by ``(workers, pipeline_stages)``, in the
        order the points are measured within a round.
    configs
        Each point's :class:`TrainConfig` (its batch, ``steps`` steps, no evaluation or checkpoint).
    notes
        The points left out and why (a stage count that does not divide a worker count).
    """

    counts: list[int]
    stage_counts: list[int]
    predict_counts: list[int]
    mode: str
    steps: int
    repeats: int
    layouts: dict[tuple[int, int], Layout]
    configs: dict[tuple[int, int], TrainConfig]
    notes: list[str]

    @classmethod
    def of(
        cls,
        config: TrainConfig,
        workers: Sequence[int],
        mode: str,
        steps: int,
        repeats: int,
        predict: Sequence[int] | None,
        pipeline_stages: Sequence[int] | None,
        network: RingModel | None,
    ) -> ScalingPlan:
        """The plan :func:`scaling_study`'s arguments ask for; :class:`ConfigError` naming the first that is invalid."""
        counts = sorted(set(workers)) if isinstance(workers, Sequence) else []
        if not counts or any(not isinstance(k, int) or isinstance(k, bool) or k < 1 for k in counts):
            raise ConfigError(f"workers={workers!r} is invalid: a list of integers >= 1")
        if mode not in ("weak", "strong"):
            raise ConfigError(f"mode={mode!r} is invalid: 'weak' or 'strong'")
        if not isinstance(steps, int) or steps <= WARMUP_STEPS:
            raise ConfigError(
                f"steps={steps!r} is invalid: an integer > {WARMUP_STEPS} (the first {WARMUP_STEPS} are warm-up)"
            )
        if not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 1:
            raise ConfigError(f"repeats={repeats!r} is invalid: an integer >= 1 (interleaved rounds of every point)")
        predict_counts = sorted(set(predict or ()))
        if any(not isinstance(k, int) or k < 1 for k in predict_counts):
            raise ConfigError(f"predict={predict!r} is invalid: a list of integers >= 1")
        stage_counts = _stage_counts(pipeline_stages, config)
        tp = config.tensor_parallel  # a replica's ranks: its stages x tensor_parallel
        of_tp = f" of {tp} tensor-parallel ranks each" if tp > 1 else ""
        # each point's layout (its replicas: the arithmetic is the Layout's)
        layouts = {(k, p): Layout(k, p, tp, config.zero) for k in counts for p in stage_counts if Layout.fits(k, p, tp)}
        plan = list(layouts)
        notes = [
            f"pipeline_stages={p} skipped at workers={k}: {k} ranks do not divide into {p}-stage pipelines{of_tp}"
            for k in counts
            for p in stage_counts
            if (k, p) not in layouts
        ]
        unused = [p for p in stage_counts if all(q != p for _, q in plan)]
        if unused:
            multiple = f"{tp} x it" if tp > 1 else "it"
            raise ConfigError(
                f"pipeline_stages={unused} divide none of workers={counts}: each needs a worker count that is a multiple of {multiple}"
            )
        if (predict_counts or network is not None) and 1 not in stage_counts:
            raise ConfigError(
                "predict and network model data parallelism: add 1 to pipeline_stages (those points are predicted and checked)"
            )
        global_batch = config.batch_size * layouts[plan[0]].data_parallel
        if mode == "strong" and any(global_batch % layout.data_parallel for layout in layouts.values()):
            first = (
                f"batch_size x {layouts[plan[0]].data_parallel} replicas"
                if plan[0][1] * tp > 1
                else f"batch_size x {counts[0]}"
            )
            replicas = sorted({layout.data_parallel for layout in layouts.values()})
            raise ConfigError(
                f"mode='strong' splits the global batch {global_batch} ({first}); it must divide by every count in {replicas}"
            )
        # every point's config, validated now (a batch too small for microbatches, ...)
        configs = {}
        for k, p in plan:
            batch = config.batch_size if mode == "weak" else global_batch // layouts[(k, p)].data_parallel
            configs[(k, p)] = config.replace(
                batch_size=batch,
                max_steps=steps,
                epochs=max(config.epochs, steps),
                eval_every=0,
                checkpoint_dir=None,
                resume=False,
                workers=k,
                pipeline_stages=p,
            )
        return cls(counts, stage_counts, predict_counts, mode, steps, repeats, layouts, configs, notes)

    def params(self, config: TrainConfig) -> dict[str, Any]:
        """The study's parameters as the store records them."""
        return {
            "config": config.to_dict(),
            "workers": self.counts,
            "pipeline_stages": self.stage_counts,
            "mode": self.mode,
            "steps": self.steps,
            "predict": self.predict_counts,
            "repeats": self.repeats,
        }


@dataclass
class _StudyRecord:
    """The study's ``scaling`` run in the store (``run_id`` None when recording is off) and the trackers following it."""

    store: Any
    run_id: str | None
    trackers: Any

    @classmethod
    def open(cls, spec: RunSpec, config: TrainConfig, plan: ScalingPlan) -> _StudyRecord:
        """Create the run (the parent of the points' runs) and its tracker runs, before the first point's."""
        from rapydli.experiments.store.runstore import open_store
        from rapydli.experiments.trackers.follow import follow

        store = open_store()
        run_id = None
        if store is not None:
            run_id = store.create_run(
                "scaling",
                spec.model_ref or spec.name,
                plan.params(config),
                world_size=plan.counts[-1],
                seed=config.seed,
            )
        trackers = follow(store, run_id, config.trackers)
        if trackers is not None:
            trackers.wait_open()  # made once, before the first point's
        return cls(store, run_id, trackers)

    def finish(self, status: str, error: str | None, table: pd.DataFrame | None, model: RingModel | None) -> None:
        """End the run as ``status``: a finished study's metrics (by worker count), table and network model first; then its trackers."""
        if self.store is not None and self.run_id is not None:
            if table is not None:
                names = ("samples_per_s", "speedup", "efficiency", "comm_fraction")
                rows = table.to_dict("records")  # by worker count; a pipelined point's as e.g. speedup@stages2
                self.store.log_metrics(
                    self.run_id,
                    [
                        (int(r["workers"]), _metric_name(name, r), r[name])
                        for r in rows
                        for name in names
                        if r[name] == r[name]
                    ],
                )
                self.store.add_record(self.run_id, "table", "table", rows)
                if model is not None:
                    self.store.add_record(
                        self.run_id, "model", "json", {"alpha": model.alpha, "beta": model.beta, "source": model.source}
                    )
            self.store.finish_run(self.run_id, status, error)
        if self.trackers is not None:  # after the status: the study's tracker run ends as it did
            self.trackers.close()


def _measure(
    cluster: Cluster,
    spec: RunSpec,
    plan: ScalingPlan,
    parent: str | None,
    figure: Any,
    on_point: Callable[[Any], None] | None,
) -> tuple[list[dict[str, Any]], float]:
    """Train every point of ``plan`` once per round, interleaved; the points summarised over their rounds and the gradient bytes.

    Each point is a run of its own (child of ``parent``) on the cluster's first ranks; the
    live ``figure`` is filled after each and handed to ``on_point``. A point that fails
    ends the study (:class:`ConfigError` naming it).
    """
    rounds: dict[tuple[int, int], list[dict[str, Any]]] = {}
    points: list[dict[str, Any]] = []
    gradient_bytes = 0.0
    for repeat in range(plan.repeats):  # interleaved: every point once per round
        for (k, p), point_cfg in plan.configs.items():
            label = f"{k}-worker" + (f", {p}-stage" if p > 1 else "")
            job = (
                TrainingJob(
                    cluster,
                    spec,
                    point_cfg,
                    list(range(k)),
                    recording=Recording(
                        name=f"scaling-{k}" + (f"-stages{p}" if p > 1 else ""),
                        parent=parent,
                        extra_params={"scaling_workers": k, "scaling_pipeline_stages": p, "repeat": repeat},
                    ),
                )
                .start()
                .wait()
            )
            if job.state != "finished":
                raise ConfigError(f"the {label} point failed: {job.error}")
            if p == 1:
                gradient_bytes = job.results[0]["gradient_bytes"]
            where = cluster.status()["rank_hosts"]
            hosts = ", ".join(sorted({where[r] for r in range(k) if r in where}))
            point = {
                **_point(k, p, plan.layouts[(k, p)].data_parallel, point_cfg.batch_size, job.results),
                "hosts": hosts,
                "load": machine_load(),
            }
            rounds.setdefault((k, p), []).append(point)
            points = summarise(rounds)
            fill_scaling_figure(figure, _table(points, None, gradient_bytes), None)
            if on_point is not None:
                on_point(figure)
    return points, gradient_bytes


def _verdict(
    table: pd.DataFrame, prediction: pd.DataFrame | None, model: RingModel | None, notes: list[str]
) -> tuple[bool | None, list[str]]:
    """Whether the model is validated here (None without one) and every note: the plan's, each point's flag, rounds too far apart.

    Marks each predicted row's ``basis``: checked against a measurement, or extrapolated
    from a model validated here or not.
    """
    records = table.to_dict("records")
    notes = notes + [
        f"workers={r['workers']}"
        + (f", pipeline_stages={r['pipeline_stages']}" if r["pipeline_stages"] > 1 else "")
        + f": {r['flag']}"
        for r in records
        if r["flag"]
    ]
    validated = None
    if model is not None:
        noisy = [r for r in records if r["pipeline_stages"] == 1 and _step_spread(r).relative_width > TOLERANCE]
        validated = bool((table["prediction_error"].dropna().abs() <= TOLERANCE).all()) and not noisy
        notes += [
            f"not validated: the step time of workers={r['workers']} varied {_step_spread(r).relative_width:.0%} between rounds "
            f"({r['load']}), more than the {TOLERANCE:.0%} a prediction is checked to; repeat on a quieter machine or with more steps"
            for r in noisy
        ]
    if prediction is not None:
        measured = set(table["workers"])
        basis = "extrapolated, model validated here" if validated else "extrapolated, model NOT validated here"
        prediction["basis"] = ["measured count (checked)" if n in measured else basis for n in prediction["workers"]]
    return validated, notes


def _stage_counts(pipeline_stages: Sequence[int] | None, config: TrainConfig) -> list[int]:
    """The sorted stage counts a study measures (``config.pipeline_stages`` when not given)."""
    if pipeline_stages is None:
        return [config.pipeline_stages]
    counts = (
        sorted(set(pipeline_stages))
        if isinstance(pipeline_stages, Sequence) and not isinstance(pipeline_stages, str)
        else []
    )
    if not counts or any(not isinstance(p, int) or isinstance(p, bool) or p < 1 for p in counts):
        raise ConfigError(f"pipeline_stages={pipeline_stages!r} is invalid: a list of integers >= 1, e.g. [1, 2]")
    return counts


def _metric_name(name: str, row: dict[str, Any]) -> str:
    return name if row["pipeline_stages"] == 1 else f"{name}@stages{row['pipeline_stages']}"


def _point(k: int, stages: int, replicas: int, batch_size: int, results: list[dict[str, Any]]) -> dict[str, Any]:
    timings = [r["timing"] for r in results if r.get("timing")]
    rank0 = timings[0]

    def mean(key: str) -> float:
        return sum(t[key] for t in timings) / len(timings)

    step = rank0["step_time_s"]
    global_batch = batch_size * replicas
    return {
        "workers": k,
        "pipeline_stages": stages,
        "data_parallel": replicas,
        "global_batch": global_batch,
        "samples_per_s": global_batch / step,
        "step_time_s": step,
        "compute_time_s": mean("step_time_s") - mean("comm_wait_s"),
        "comm_time_s": mean("comm_time_s"),
        "comm_wait_s": mean("comm_wait_s"),
        "comm_fraction": mean("comm_wait_s") / mean("step_time_s"),
    }


def summarise(rounds: Mapping[tuple[int, int], list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One point per ``(workers, stages)`` from its rounds (in measuring order; the first is the
    base): the median of every timing, the step time's range, and the speedup as the median of
    each round's throughput ratio to the base's in the same round, with its range
    (``speedup_rounds``: those ratios; rounds the base has not measured yet are left out)."""
    if not rounds:
        return []
    base = next(iter(rounds.values()))
    points = []
    for measured in rounds.values():
        first = measured[0]
        step = Spread.of([m["step_time_s"] for m in measured])
        ratios = [m["samples_per_s"] / b["samples_per_s"] for m, b in zip(measured, base)]
        loads = [m["load"] for m in measured if "load" in m]
        point = {key: first[key] for key in first if key not in TIMED and key != "load"}
        point.update({key: Spread.of([m[key] for m in measured]).median for key in TIMED})
        point.update(
            {
                "repeats": len(measured),
                "step_time_low_s": step.low,
                "step_time_high_s": step.high,
                "speedup_rounds": ratios,
                "load": load_text(max(loads, key=lambda x: x["load_1m"])) if loads else "",
                "busy": any(busy(x) for x in loads),
            }
        )
        points.append(point)
    return points


def _step_spread(row: Mapping[str, Any]) -> Spread:
    return Spread(row["step_time_s"], row["step_time_low_s"], row["step_time_high_s"], int(row["repeats"]))


def _flag(efficiency: float, ideal: float, load: str) -> str:
    """Why an efficiency above 1 is not a result (``""`` when it is not above 1)."""
    if ideal <= 1 or not efficiency > 1.0:
        return ""
    where = f" ({load})" if load else ""
    return (
        f"efficiency {efficiency:.2f} > 1 is a measurement artefact, not a result: the base point was slowed by other work "
        f"on the machine{where}; repeat on a quieter machine, with more steps or more repeats"
    )


def _table(
    points: list[dict[str, Any]], model: RingModel | None, gradient_bytes: float, mode: str = "weak"
) -> pd.DataFrame:
    import pandas as pd

    rows = []
    for p in points:
        base = points[0]
        ideal = p["workers"] / base["workers"]
        rounds = Spread.of(p.get("speedup_rounds") or [p["samples_per_s"] / base["samples_per_s"]])
        speedup = rounds.median
        flag = _flag(speedup / ideal, ideal, p.get("load", ""))
        row = {
            **{k: v for k, v in p.items() if k not in ("speedup_rounds", "busy")}, "speedup": speedup, "ideal_speedup": ideal,
            "efficiency": float("nan") if flag else speedup / ideal, "predicted_step_time_s": None, "prediction_error": None,
            "speedup_low": rounds.low, "speedup_high": rounds.high, "flag": flag,
            "speedup_verdict": "" if p is base else rounds.verdict() if rounds.n > 1 else "one measurement: no conclusion (repeats=1)",
        }  # fmt: skip
        if model is not None and p["pipeline_stages"] == 1:  # the ring model is of data parallelism
            predicted = predict_step_time(model, p["workers"], _compute(points, p["workers"], mode), gradient_bytes)
            row["predicted_step_time_s"] = predicted
            row["prediction_error"] = (predicted - p["step_time_s"]) / p["step_time_s"]
        rows.append(row)
    return pd.DataFrame(rows, columns=COLUMNS)


def _compute(points: list[dict[str, Any]], n: int, mode: str) -> float:
    """Compute time per step at ``n`` ranks: measured where ``n`` was measured, else from the largest
    measured count (weak: the same per rank; strong: the batch, and so the compute, splits).
    Only the data-parallel (one-stage) points count."""
    points = [p for p in points if p["pipeline_stages"] == 1]
    for p in points:
        if p["workers"] == n:
            return p["compute_time_s"]
    last = points[-1]
    return last["compute_time_s"] if mode == "weak" else last["compute_time_s"] * last["workers"] / n


def _prediction(
    points: list[dict[str, Any]], model: RingModel, gradient_bytes: float, counts: list[int], mode: str
) -> pd.DataFrame:
    import pandas as pd

    points = [p for p in points if p["pipeline_stages"] == 1]  # the ring model is of data parallelism
    base = points[0]
    per_rank = base["global_batch"] / base["workers"]
    rows = []
    for n in counts:
        step = predict_step_time(model, n, _compute(points, n, mode), gradient_bytes)
        batch = per_rank * n if mode == "weak" else base["global_batch"]
        speedup = (batch / step) / base["samples_per_s"]
        rows.append(
            {
                "workers": n,
                "step_time_s": step,
                "samples_per_s": batch / step,
                "speedup": speedup,
                "efficiency": speedup / (n / base["workers"]),
            }
        )
    return pd.DataFrame(rows)

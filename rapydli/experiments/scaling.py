"""``rd.scaling_study``: the same training at several worker counts; speedup and efficiency vs ideal.

Each point trains ``steps`` optimizer steps on the first ``k`` engines of the cluster
(a communicator over just them) and takes the medians of the step timings after a
warm-up: step time, compute time (step time minus the time the step waited for
communication), allreduce time and waiting time. ``weak`` scaling keeps the per-rank
batch (the global batch grows with ``k``); ``strong`` keeps the global batch of the
smallest count and splits it. Speedup is the throughput ratio to the smallest count
(``samples/s``), efficiency the speedup over the ideal ``k / k0``.

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
from rapydli.experiments.job import TrainingJob
from rapydli.experiments.planning.perfmodel import RingModel, measure_ring, predict_step_time
from rapydli.experiments.spec import RunSpec
from rapydli.parallel.layout import Layout
from rapydli.trainer.config import TrainConfig
from rapydli.trainer.task import WARMUP_STEPS

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

    from rapydli.cluster import Cluster

TOLERANCE = 0.20
COLUMNS = [
    "workers", "pipeline_stages", "replicas", "hosts", "global_batch", "samples_per_s", "speedup", "ideal_speedup", "efficiency",
    "step_time_s",
    "compute_time_s", "comm_time_s", "comm_wait_s", "comm_fraction", "predicted_step_time_s", "prediction_error",
]  # fmt: skip


@dataclass
class ScalingResult:
    """What :func:`scaling_study` returns.

    Attributes
    ----------
    table
        One row per measured point: ``workers``, ``pipeline_stages``, ``replicas``
        (``workers / (pipeline_stages x tensor_parallel)``), ``hosts`` (where its ranks ran,
        e.g. ``"node1, node2"``), ``global_batch``, ``samples_per_s``,
        ``speedup``, ``ideal_speedup``, ``efficiency``, ``step_time_s``,
        ``compute_time_s``, ``comm_time_s`` (gradient allreduce time),
        ``comm_wait_s`` (time the step waited for it), ``comm_fraction``
        (``comm_wait_s / step_time_s``), and with a model ``predicted_step_time_s`` and
        ``prediction_error`` (relative; one-stage points only).
    figure
        Speedup and efficiency against workers: measured (a line per stage count),
        ideal, and predicted (dashed).
    prediction
        Predicted rows (``workers``, ``step_time_s``, ``samples_per_s``, ``speedup``,
        ``efficiency``) for ``predict`` and the measured counts, or ``None``.
    model
        The :class:`RingModel` used, or ``None``.
    validated
        Whether every predicted point is within 20% of its measurement (``None`` without a model).
    run_id
        The ``scaling`` run in the store.
    notes
        What the study left out and why (worker counts a stage count does not divide).
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
    model_fn: Callable[[], Any] | str,
    data_fn: Callable[[], Any] | str,
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
    loss_fn: Callable[..., Any] | None = None,
    optimizer_fn: Callable[..., Any] | None = None,
    metrics: Any = None,
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

    Returns
    -------
    ScalingResult

    Examples
    --------
    >>> rd.scaling_study(model_fn, data_fn, rd.TrainConfig(microbatches=4), workers=[2, 4],
    ...                  pipeline_stages=[1, 2]).table  # doctest: +SKIP
    """
    cfg = config if isinstance(config, TrainConfig) else TrainConfig.from_dict(dict(config))
    spec = RunSpec.of(model_fn, data_fn, loss_fn, optimizer_fn, metrics)  # resolved and checked once, then passed whole
    counts = sorted(set(workers)) if isinstance(workers, Sequence) else []
    if not counts or any(not isinstance(k, int) or isinstance(k, bool) or k < 1 for k in counts):
        raise ConfigError(f"workers={workers!r} is invalid: a list of integers >= 1")
    if mode not in ("weak", "strong"):
        raise ConfigError(f"mode={mode!r} is invalid: 'weak' or 'strong'")
    if not isinstance(steps, int) or steps <= WARMUP_STEPS:
        raise ConfigError(f"steps={steps!r} is invalid: an integer > {WARMUP_STEPS} (the first {WARMUP_STEPS} are warm-up)")
    predict_counts = sorted(set(predict or ()))
    if any(not isinstance(k, int) or k < 1 for k in predict_counts):
        raise ConfigError(f"predict={predict!r} is invalid: a list of integers >= 1")
    stage_counts = _stage_counts(pipeline_stages, cfg)
    tp = cfg.tensor_parallel  # a replica's ranks: its stages x tensor_parallel
    of_tp = f" of {tp} tensor-parallel ranks each" if tp > 1 else ""
    # each point's layout (its replicas: the arithmetic is the Layout's)
    layouts = {(k, p): Layout(k, p, tp, cfg.zero) for k in counts for p in stage_counts if Layout.fits(k, p, tp)}
    plan = list(layouts)
    notes = [f"pipeline_stages={p} skipped at workers={k}: {k} ranks do not divide into {p}-stage pipelines{of_tp}"
             for k in counts for p in stage_counts if (k, p) not in layouts]  # fmt: skip
    unused = [p for p in stage_counts if all(q != p for _, q in plan)]
    if unused:
        multiple = f"{tp} x it" if tp > 1 else "it"
        raise ConfigError(f"pipeline_stages={unused} divide none of workers={counts}: each needs a worker count that is a multiple of {multiple}")
    if (predict_counts or network is not None) and 1 not in stage_counts:
        raise ConfigError("predict and network model data parallelism: add 1 to pipeline_stages (those points are predicted and checked)")
    global_batch = cfg.batch_size * layouts[plan[0]].replicas
    if mode == "strong" and any(global_batch % layout.replicas for layout in layouts.values()):
        first = f"batch_size x {layouts[plan[0]].replicas} replicas" if plan[0][1] * tp > 1 else f"batch_size x {counts[0]}"
        replicas = sorted({layout.replicas for layout in layouts.values()})
        raise ConfigError(f"mode='strong' splits the global batch {global_batch} ({first}); it must divide by every count in {replicas}")
    # every point's config, validated before anything starts (a batch too small for microbatches, ...)
    point_configs = {}
    for k, p in plan:
        batch = cfg.batch_size if mode == "weak" else global_batch // layouts[(k, p)].replicas
        point_configs[(k, p)] = cfg.replace(
            batch_size=batch, max_steps=steps, epochs=max(cfg.epochs, steps), eval_every=0, checkpoint_dir=None, resume=False,
            workers=k, pipeline_stages=p,
        )  # fmt: skip

    from rapydli.cluster import choose_cluster
    from rapydli.experiments.store.runstore import open_store

    cluster, own = choose_cluster(cluster, n=counts[-1], need=counts[-1])

    store = open_store()
    run_id = None
    if store is not None:
        params = {"config": cfg.to_dict(), "workers": counts, "pipeline_stages": stage_counts, "mode": mode, "steps": steps, "predict": predict_counts}
        run_id = store.create_run("scaling", spec.model_ref or spec.name, params, world_size=counts[-1], seed=cfg.seed)
    figure = scaling_figure([], None, mode=mode, stages=stage_counts)
    points: list[dict[str, Any]] = []
    status, error = "failed", None
    model: RingModel | None = network
    try:
        gradient_bytes = 0.0
        for (k, p), point_cfg in point_configs.items():
            label = f"{k}-worker" + (f", {p}-stage" if p > 1 else "")
            job = TrainingJob(
                cluster, spec, point_cfg, list(range(k)), name=f"scaling-{k}" + (f"-stages{p}" if p > 1 else ""),
                parent=run_id, extra_params={"scaling_workers": k, "scaling_pipeline_stages": p},
            ).wait()  # fmt: skip
            if job.state != "finished":
                raise ConfigError(f"the {label} point failed: {job.error}")
            if p == 1:
                gradient_bytes = job.results[0]["gradient_bytes"]
            where = cluster.status()["rank_hosts"]
            hosts = ", ".join(sorted({where[r] for r in range(k) if r in where}))
            points.append({**_point(k, p, layouts[(k, p)].replicas, point_cfg.batch_size, job.results), "hosts": hosts})
            fill_scaling_figure(figure, _table(points, None, gradient_bytes), None)
            if on_point is not None:
                on_point(figure)
        if predict_counts or network is not None:
            if model is None:
                model = measure_ring(cluster, algorithm=cfg.allreduce)
        table = _table(points, model, gradient_bytes, mode)
        prediction = _prediction(points, model, gradient_bytes, sorted(set(predict_counts) | set(counts)), mode) if model else None
        fill_scaling_figure(figure, table, prediction, model)
        status = "finished"
    except BaseException as exc:
        error = f"{type(exc).__name__}: {exc}"
        raise
    finally:
        if own:
            cluster.stop()
        if store is not None and run_id is not None:
            if status == "finished":
                names = ("samples_per_s", "speedup", "efficiency", "comm_fraction")
                rows = table.to_dict("records")  # by worker count; a pipelined point's as e.g. speedup@stages2
                store.log_metrics(run_id, [(int(r["workers"]), _metric_name(name, r), r[name]) for r in rows for name in names])
                store.add_record(run_id, "table", "table", table.to_dict("records"))
                if model is not None:
                    store.add_record(run_id, "model", "json", {"alpha": model.alpha, "beta": model.beta, "source": model.source})
            store.finish_run(run_id, status, error)
    validated = None
    if model is not None:
        validated = bool((table["prediction_error"].dropna().abs() <= TOLERANCE).all())
    static = scaling_figure(table.to_dict("records"), prediction, mode=mode, model=model, stages=stage_counts)
    if on_point is not None:
        on_point(static)
    return ScalingResult(
        table=table, figure=static, prediction=prediction, model=model, validated=validated, run_id=run_id, mode=mode, notes=notes
    )


def _stage_counts(pipeline_stages: Sequence[int] | None, config: TrainConfig) -> list[int]:
    """The sorted stage counts a study measures (``config.pipeline_stages`` when not given)."""
    if pipeline_stages is None:
        return [config.pipeline_stages]
    counts = sorted(set(pipeline_stages)) if isinstance(pipeline_stages, Sequence) and not isinstance(pipeline_stages, str) else []
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
        "workers": k, "pipeline_stages": stages, "replicas": replicas, "global_batch": global_batch,
        "samples_per_s": global_batch / step, "step_time_s": step,
        "compute_time_s": mean("step_time_s") - mean("comm_wait_s"), "comm_time_s": mean("comm_time_s"),
        "comm_wait_s": mean("comm_wait_s"), "comm_fraction": mean("comm_wait_s") / mean("step_time_s"),
    }  # fmt: skip


def _table(points: list[dict[str, Any]], model: RingModel | None, gradient_bytes: float, mode: str = "weak") -> pd.DataFrame:
    import pandas as pd

    rows = []
    for p in points:
        base = points[0]
        speedup = p["samples_per_s"] / base["samples_per_s"]
        ideal = p["workers"] / base["workers"]
        row = {**p, "speedup": speedup, "ideal_speedup": ideal, "efficiency": speedup / ideal, "predicted_step_time_s": None, "prediction_error": None}
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


def _prediction(points: list[dict[str, Any]], model: RingModel, gradient_bytes: float, counts: list[int], mode: str) -> pd.DataFrame:
    import pandas as pd

    points = [p for p in points if p["pipeline_stages"] == 1]  # the ring model is of data parallelism
    base = points[0]
    per_rank = base["global_batch"] / base["workers"]
    rows = []
    for n in counts:
        step = predict_step_time(model, n, _compute(points, n, mode), gradient_bytes)
        batch = per_rank * n if mode == "weak" else base["global_batch"]
        speedup = (batch / step) / base["samples_per_s"]
        rows.append({"workers": n, "step_time_s": step, "samples_per_s": batch / step, "speedup": speedup, "efficiency": speedup / (n / base["workers"])})
    return pd.DataFrame(rows)


"""``rd.plan_parallel``: which layout of data, pipeline and tensor parallelism and ZeRO to train with.

For ``ranks`` ranks and one global batch, the planner

1. **measures once**: the model's blocks (forward and backward time, activation and
   parameter bytes, tensor-parallel allreduces) at the micro-batch sizes and
   tensor-parallel degrees the layouts use, on every engine that would train
   (:mod:`rapydli.experiments.planning.profiling`), and the network: gradient allreduce,
   reduce-scatter/allgather and point-to-point α–β models (:mod:`rapydli.experiments.planning.network`);
2. **enumerates** every layout (:func:`rapydli.experiments.planning.layouts.enumerate_layouts`:
   ZeRO 0 to 3, each with and without activation checkpointing),
   **predicts** its step time and peak memory per rank (:mod:`rapydli.experiments.planning.stepmodel`)
   and marks those over ``memory_per_rank`` (or that ``rd.train`` would refuse for it:
   :mod:`rapydli.experiments.planning.fit`) as not fitting, listed last;
3. **runs** the ``run_top`` fastest predicted layouts that fit for ``steps`` steps on the cluster and
   puts the measured step time (median after the warm-up) beside the prediction.

A given ``network`` describes a machine one does not have: nothing is run by default
(``run_top=0``), and without a cluster in use the model is measured in this process, or
``profile=`` reuses an earlier plan's measurement (``plan.profile``), so ``ranks=64`` is
predicted without starting anything. Every layout predicted can be run: the pick is a
``TrainConfig`` (``workers``, ``pipeline_stages``, ``tensor_parallel``, ``zero``, ...) that
the Trainer runs on its data x pipeline x tensor grid.

Examples
--------
>>> plan = plan_parallel(models.tiny_lm, datasets.synthetic_tokens, TrainConfig(batch_size=16), ranks=2)  # doctest: +SKIP
>>> plan.table.head(3)  # doctest: +SKIP
>>> rd.train(models.tiny_lm, datasets.synthetic_tokens, plan.best)  # doctest: +SKIP
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rapydli.errors import ConfigError
from rapydli.experiments.figures import plan_figure
from rapydli.experiments.planning.layouts import (
    CHECKPOINTING,
    MAX_TENSOR_PARALLEL,
    ZERO_STAGES,
    Candidate,
    candidate_sizes,
    divisors,
    enumerate_layouts,
    optimizer_factor,
    smallest_states,
    spread,
)
from rapydli.experiments.planning.network import Network
from rapydli.experiments.planning.perfmodel import RingModel
from rapydli.experiments.planning.profile import Profile
from rapydli.experiments.planning.stepmodel import Prediction, predict
from rapydli.experiments.spec import RunSpec
from rapydli.spread import Spread, busy, load_text, machine_load
from rapydli.trainer.config import TrainConfig, byte_size
from rapydli.trainer.task import WARMUP_STEPS

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

    from rapydli.cluster import Cluster
    from rapydli.experiments.spec import DataSource, LossFn, ModelSource, OptimizerFn

#: A layout run is "within the model" when its measured step time is within 20 % of the prediction.
TOLERANCE = 0.20
#: Layouts run when the network is measured here and ``run_top`` is not given.
RUN_TOP = 3
#: Largest batch measured; larger ones are extrapolated (compute grows linearly with the batch there).
MEASURED_SIZES = 64
MIB = float(1 << 20)
COLUMNS = [
    "layout", "data_parallel", "pipeline_stages", "tensor_parallel", "microbatches", "schedule", "zero", "checkpointing",
    "fits", "predicted_step_s", "measured_step_s", "measured_low_s", "measured_high_s", "error",
    "samples_per_s", "bubble", "gradient_s", "optimizer_s", "params_mib", "grads_mib", "optimizer_mib", "activations_mib", "buffers_mib",
    "peak_mib", "split",
]  # fmt: skip


@dataclass
class ParallelPlan:
    """What :func:`plan_parallel` returns.

    Attributes
    ----------
    table
        One row per layout, the fastest predicted first (those over ``memory_per_rank``
        last): ``layout``, ``dp``, ``pp``, ``tp``, ``microbatches``, ``schedule``, ``zero``,
        ``checkpointing`` (the ``activation_checkpointing`` it trains with), ``fits`` (memory), the
        ``predicted_step_s`` and, for the layouts run, ``measured_step_s`` (the median step),
        ``measured_low_s``/``measured_high_s`` (the interquartile range of its steps) and ``error``
        (relative), ``samples_per_s`` (predicted), the prediction's parts (``bubble``,
        ``gradient_s``, ``optimizer_s``), the peak per rank in MiB by kind (``params_mib``,
        ``grads_mib``, ``optimizer_mib``, ``activations_mib``, ``buffers_mib``, ``peak_mib``)
        and the pipeline ``split``.
    figure
        Predicted step time of the fastest layouts with the measured ones beside them, and
        predicted against measured.
    best
        The ``TrainConfig`` of the pick (pass it to ``rd.train``): the fastest measured
        layout, else the fastest predicted one that fits.
    best_layout
        Its label.
    best_reason
        What the pick rests on: the fastest measured layout whose steps' middle half lies
        below every other layout's run; the fastest by median when the runs overlap (then
        it says that the machine could not tell them apart, with their ranges); or the
        fastest prediction when nothing ran.
    predictions
        The :class:`~rapydli.experiments.planning.stepmodel.Prediction` of every layout, in table order.
    profile, network
        What the predictions used (``profile`` can be passed to another plan).
    validated
        Whether every layout run is within 20 % of its prediction and measured steadily
        enough to tell (its steps' interquartile range within 20 % of their median); False
        with the reason in ``notes`` when too noisy, or when a prediction missed on a busy
        machine (more runnable processes than cores: the miss may be the load's) (``None``
        when none ran).
    notes
        What was left out and why (layouts that failed to run, degrees not measured, a
        measurement too noisy to validate, with the load seen).
    """

    table: pd.DataFrame
    figure: Any
    best: TrainConfig
    best_layout: str
    predictions: list[Prediction]
    profile: Profile
    network: Network
    ranks: int
    global_batch: int
    validated: bool | None = None
    notes: list[str] = field(default_factory=list)
    best_reason: str = ""

    def _repr_html_(self) -> str:  # pragma: no cover - notebook display
        shown = self.table.head(12).drop(
            columns=[
                "data_parallel",
                "pipeline_stages",
                "tensor_parallel",
                "microbatches",
                "schedule",
                "zero",
                "checkpointing",
            ]
        )
        return f"<b>ParallelPlan</b> {self.ranks} ranks, best: {self.best_layout}, validated={self.validated}<br>{shown.to_html(index=False)}"


def _positive_int(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"{name}={value!r} is invalid: an integer >= {low}")
    return value


def _network(network: Network | RingModel | None) -> Network | None:
    if network is None or isinstance(network, Network):
        return network
    if isinstance(network, RingModel):
        return Network.from_ring(network)
    raise ConfigError(
        f"network={network!r} is invalid: a RingModel(alpha, beta), a Network, or None (measured on the cluster)"
    )


def _model_states(model_fn: Callable[[], Any]) -> tuple[float, int] | None:
    """Parameter bytes and the pipeline blocks that hold parameters (the most stages it splits into) of the
    model, built on the meta device (no memory); None if it cannot be."""
    import torch

    from rapydli.parallel.split import holds_parameters

    try:
        with torch.device("meta"):
            model = model_fn()
        parameters = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    except Exception:  # noqa: BLE001 - a model that cannot be built on the meta device is checked once measured
        return None
    try:
        blocks = max(1, sum(holds_parameters(model)))
    except ConfigError:
        blocks = 1
    return float(parameters), blocks


def _check_memory(
    model_fn: Callable[[], Any], ranks: int, global_batch: int, config: TrainConfig, limit: float
) -> None:
    """Refuse, before anything starts, a limit below what the model's states need in any layout."""
    states = _model_states(model_fn)
    if states is None:
        return
    parameters, blocks = states
    degrees = [t for t in divisors(ranks) if t <= MAX_TENSOR_PARALLEL]
    need, grid = smallest_states(
        ranks, global_batch, blocks, parameters, optimizer_factor(config), ZERO_STAGES, degrees
    )
    if need > limit:
        raise ConfigError(
            f"memory_per_rank={limit:.4g} bytes is too small for every layout of ranks={ranks}: the smallest needs at least "
            f"{need / MIB:.3g} MiB per rank ({grid}: parameters, gradients and optimizer state, before activations)"
        )


def plan_parallel(
    model_fn: ModelSource,
    data_fn: DataSource,
    config: TrainConfig | Mapping[str, Any],
    ranks: int = 2,
    memory_per_rank: float | str | None = None,
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
    """Predict every layout of ``ranks`` ranks, run the fastest, and pick one.

    Parameters
    ----------
    model_fn, data_fn
        As for ``rd.train``.
    config
        The run's ``TrainConfig``; its optimizer, allreduce, bucket size and overlap are
        what the layouts use.
    ranks
        Ranks to plan for (``dp * pp * tp``).
    memory_per_rank
        Bytes a rank may hold (a number, or text with a unit: ``"200MB"``, ``"1.5GiB"``); layouts
        predicted above it are put last with ``fits`` False, and the pick is one that fits
        (``None``: ``config.memory_per_rank``, which is ``None`` for no limit). A layout fits
        when its predicted peak is within it and ``rd.train`` would let its config through
        (:func:`~rapydli.experiments.planning.fit.check_fits`); ``plan.best`` carries the limit.
        Every layout is predicted with and without activation checkpointing, and with ZeRO 0 to 3.
    network
        A ``RingModel`` or :class:`~rapydli.experiments.planning.network.Network` of the target
        machine; ``None``: measured on the cluster.
    run_top
        Layouts to run (the fastest predicted that fit); ``None``: 3 when
        the network is measured here, 0 when it is given.
    steps
        Steps per layout run (the first 2 are warm-up and not timed).
    cluster
        The cluster (at least ``ranks`` engines) when one is needed (measuring the network,
        or running layouts); ``None``: as ``rd.train`` chooses (the running one, else a new
        local one that is stopped afterwards).
    global_batch
        Samples per step in every layout; default ``config.batch_size * config.grad_accum * ranks``.
    profile
        A measurement to reuse (``plan.profile`` of an earlier plan of the same model and
        config); ``None``: measured on the cluster if one is used, else in this process.
    run_layouts
        Labels of layouts to run besides the ``run_top`` fastest (as the table writes them,
        ``"dp1 pp2 tp1 m4 gpipe zero0"``); an unknown label is a ``ConfigError`` naming the
        layouts there are.
    loss_fn, optimizer_fn, metrics
        As for ``rd.train``: the profile scores the model with the run's loss (its
        :class:`~rapydli.objective.Objective`), and the layouts run train what ``rd.train`` would.

    Returns
    -------
    ParallelPlan

    Raises
    ------
    ConfigError
        A bad argument (before anything starts), or ``memory_per_rank`` below what every
        layout needs (naming the smallest need).
    """
    cfg = config if isinstance(config, TrainConfig) else TrainConfig.from_dict(dict(config))
    _positive_int("ranks", ranks, 1)
    _positive_int("steps", steps, WARMUP_STEPS + 1)
    if run_top is not None:
        _positive_int("run_top", run_top, 0)
    cfg, limit = _with_memory_limit(
        cfg, memory_per_rank
    )  # the pick, and every layout run, carry the limit rd.train enforces
    if profile is not None and not isinstance(profile, Profile):
        raise ConfigError(f"profile={profile!r} is invalid: a Profile (plan.profile of an earlier plan) or None")
    net = _network(network)
    batch = _positive_int("global_batch", global_batch, 1) if global_batch is not None else cfg.global_batch(ranks)
    spec = RunSpec.of(model_fn, data_fn, loss_fn, optimizer_fn, metrics)  # resolved and checked once, then passed whole
    top = run_top if run_top is not None else (RUN_TOP if net is None else 0)
    if isinstance(run_layouts, str) or not all(isinstance(label, str) for label in run_layouts):
        raise ConfigError(
            f"run_layouts={run_layouts!r} is invalid: a list of layout labels such as 'dp2 pp1 tp1 m1 zero0'"
        )
    if limit is not None:
        _check_memory(spec.model_fn, ranks, batch, cfg, limit)

    from rapydli.cluster import choose_cluster

    needed = top > 0 or bool(run_layouts) or (net is None and ranks > 1)
    chosen, own = choose_cluster(cluster, n=ranks, need=ranks) if needed else (None, False)
    targets = list(range(ranks))
    try:
        if profile is None:
            profile = _measure(chosen, targets, spec, cfg, ranks, batch)
        if net is None:
            net = _measure_network(chosen, targets, cfg)
        predictions, fits, notes = _ranked(spec, profile, net, cfg, ranks, batch, limit)
        picks = _picks(predictions, fits, top, run_layouts, ranks)
        measured, spreads, run_notes = _run_picks(chosen, targets, spec, picks, cfg, batch, steps)
        notes += run_notes
    finally:
        if own and chosen is not None:
            chosen.stop()
    table = _table(predictions, fits, measured, batch, spreads)
    validated, said = verdict(
        [e for e in table["error"] if not math.isnan(e)],
        {layout.label: s for layout, s in spreads.items()},
        machine_load(),
    )
    notes += said
    best, reason = _best(predictions, measured, spreads)
    return ParallelPlan(
        table=table,
        figure=plan_figure(table, ranks, TOLERANCE),
        best=best.layout.config(cfg, batch, best.split),
        best_layout=best.layout.label,
        predictions=predictions,
        profile=profile,
        network=net,
        ranks=ranks,
        global_batch=batch,
        validated=validated,
        notes=notes,
        best_reason=reason,
    )


def _with_memory_limit(config: TrainConfig, memory_per_rank: float | str | None) -> tuple[TrainConfig, float | None]:
    """The config carrying the memory limit per rank (``memory_per_rank``, else the config's) and that limit in bytes."""
    limit: float | None
    if memory_per_rank is None:
        limit = config.memory_per_rank
    elif isinstance(memory_per_rank, str) or (
        isinstance(memory_per_rank, int | float) and not isinstance(memory_per_rank, bool)
    ):
        limit = byte_size(memory_per_rank)
    else:
        raise ConfigError(
            f"memory_per_rank={memory_per_rank!r} is invalid: bytes per rank > 0 ('200MB' or a number), or None (no limit)"
        )
    return config.replace(memory_per_rank=limit), limit


def _ranked(
    spec: RunSpec, profile: Profile, net: Network, config: TrainConfig, ranks: int, batch: int, limit: float | None
) -> tuple[list[Prediction], list[bool], list[str]]:
    """Every layout of ``ranks`` predicted and ranked: those that fit ``limit`` first, each group fastest first; whether each
    fits, and the notes on the layouts left out (a tensor degree the model does not support, tied weights across stages).

    Raises :class:`ConfigError` when no layout fits.
    """
    degrees = [t for t in divisors(ranks) if t <= MAX_TENSOR_PARALLEL and profile.supports(t)]
    offload = (
        (False, True) if profile.device != "cpu" else (False,)
    )  # on CPU ranks the optimizer is in host memory already
    layouts = enumerate_layouts(
        ranks, batch, profile.stage_blocks, degrees, checkpointing=CHECKPOINTING, offload=offload
    )
    predictions = sorted((predict(layout, profile, net, batch, config) for layout in layouts), key=lambda p: p.step_s)
    predictions, refused = _honoured(
        spec.model_fn, predictions, config
    )  # tied weights across stages: no zero=2 (rapydli.parallel.shared)
    fits = [limit is None or p.memory.peak <= limit for p in predictions]
    if (
        limit is not None
    ):  # and the front door's prediction (rd.train checks it): a layout it would refuse does not fit either
        fits = [
            ok and not over
            for ok, over in zip(fits, _refused_at_the_door(spec.model_fn, predictions, config, batch, limit))
        ]
    if not any(fits):
        smallest = min(predictions, key=lambda p: p.memory.peak)
        raise ConfigError(
            f"memory_per_rank={float(limit or 0):.4g} bytes is too small for every layout of ranks={ranks}: the smallest "
            f"peak is {smallest.memory.peak / MIB:.3g} MiB per rank ({smallest.layout.label})"
        )
    predictions = [p for _, p in sorted(zip(fits, predictions), key=lambda pair: (not pair[0], pair[1].step_s))]
    notes = [
        f"unsupported tensor_parallel={t}: {why}" for t, why in profile.unsupported.items() if ranks % t == 0
    ] + refused
    return predictions, sorted(fits, reverse=True), notes


def _picks(
    predictions: list[Prediction], fits: list[bool], top: int, run_layouts: Sequence[str], ranks: int
) -> list[Prediction]:
    """The layouts to run: the ``top`` fastest predicted of those that fit, then those ``run_layouts`` names (by label)."""
    picks = [p for p, ok in zip(predictions, fits) if ok][:top]
    by_label = {p.layout.label: p for p in predictions}
    unknown = [label for label in run_layouts if label not in by_label]
    if unknown:
        labels = ", ".join(by_label)
        raise ConfigError(
            f"run_layouts names {', '.join(map(repr, unknown))}, not a layout of ranks={ranks}; they are: {labels}"
        )
    return picks + [by_label[label] for label in run_layouts if by_label[label] not in picks]


def _run_picks(
    cluster: Cluster | None,
    targets: list[int],
    spec: RunSpec,
    picks: list[Prediction],
    config: TrainConfig,
    batch: int,
    steps: int,
) -> tuple[dict[Candidate, float], dict[Candidate, Spread], list[str]]:
    """Train each picked layout ``steps`` steps; the median step times and spreads of those that ran, and notes on those that did not."""
    measured: dict[Candidate, float] = {}
    spreads: dict[Candidate, Spread] = {}
    notes: list[str] = []
    for prediction in picks:
        assert cluster is not None
        step, note, spread = _run(cluster, targets, spec, prediction, config, batch, steps)
        if step is not None:
            measured[prediction.layout] = step
            spreads[prediction.layout] = spread
        if note:
            notes.append(note)
    return measured, spreads, notes


def _measure(
    cluster: Cluster | None, targets: list[int], spec: RunSpec, config: TrainConfig, ranks: int, batch: int
) -> Profile:
    from rapydli.experiments.planning.profiling import local_profile, measure_profile

    micro, data_sizes = (
        spread({min(size, MEASURED_SIZES) for size in sizes}) for sizes in candidate_sizes(ranks, batch)
    )
    degrees = [t for t in divisors(ranks) if t <= MAX_TENSOR_PARALLEL]
    if cluster is not None:
        return measure_profile(cluster, targets, spec, config, micro, degrees, data_sizes)
    return local_profile(spec, None, config, micro, degrees, data_sizes)


def _measure_network(cluster: Cluster | None, targets: list[int], config: TrainConfig) -> Network:
    from rapydli.experiments.planning.network import measure_network

    if cluster is None or len(targets) < 2:
        return Network.from_ring(RingModel(alpha=0.0, beta=0.0, source="one rank: no communication"))
    return measure_network(cluster, targets, algorithm=config.allreduce)


def _run(
    cluster: Cluster,
    targets: list[int],
    spec: RunSpec,
    prediction: Prediction,
    config: TrainConfig,
    batch: int,
    steps: int,
) -> tuple[float | None, str, Spread]:
    """Train ``steps`` steps in the layout; its median step time after the warm-up (None and a note if it failed)
    and the median and interquartile range of those steps' times."""
    from rapydli.experiments.job import Recording, TrainingJob

    layout = prediction.layout
    run_config = layout.config(config, batch, prediction.split).replace(
        max_steps=steps,
        epochs=max(config.epochs, steps),
        eval_every=0,
        checkpoint_dir=None,
        checkpoint_every=0,
        resume=False,
    )
    job = (
        TrainingJob(
            cluster,
            spec,
            run_config,
            targets,
            recording=Recording(
                name=f"plan {layout.label}",
                extra_params={"plan_layout": layout.label, "predicted_step_time_s": prediction.step_s},
            ),
        )
        .start()
        .wait()
    )
    if job.state != "finished" or not job.results or not job.results[0].get("timing"):
        return None, f"{layout.label} did not run: {job.error or job.state}", Spread.of([])
    times = [r["step_time_s"] for r in job.results[0].get("history", []) if r.get("kind") == "train"][WARMUP_STEPS:]
    return float(job.results[0]["timing"]["step_time_s"]), "", Spread.quartiles(times)


def verdict(
    errors: Sequence[float], spreads: Mapping[str, Spread], load: dict[str, float]
) -> tuple[bool | None, list[str]]:
    """Whether the layouts run validate the predictions (``errors``: relative, per layout run), and the notes why not.

    None when nothing ran. A layout whose steps varied more than :data:`TOLERANCE`
    (``spreads``, by label) earns no verdict either way; nor does a miss while the machine
    was ``load``-ed beyond its cores (the runs competed with other work).
    """
    validated = all(abs(e) <= TOLERANCE for e in errors) if errors else None
    noisy = {label: spread for label, spread in spreads.items() if spread.relative_width > TOLERANCE}
    if noisy:  # the measurement is too unsteady to check a prediction to TOLERANCE: no verdict either way is earned
        return False, [
            f"not validated: {label}'s step times varied {spread.relative_width:.0%} (interquartile, {spread.n} steps; "
            f"{load_text(load)}), more than the {TOLERANCE:.0%} a prediction is checked to; run more steps or on a "
            "quieter machine"
            for label, spread in noisy.items()
        ]
    if validated is False and busy(load):  # steady steps, but shared with other work
        return False, [
            f"not validated: the machine was busy ({load_text(load)}): the runs competed with other work, which "
            "the model's measurements may have met otherwise; a prediction missed here does not show the model "
            "wrong: repeat on a quieter machine"
        ]
    return validated, []


def _table(
    predictions: list[Prediction],
    fits: list[bool],
    measured: dict[Candidate, float],
    batch: int,
    spreads: dict[Candidate, Spread] | None = None,
) -> pd.DataFrame:
    import pandas as pd

    rows = []
    for prediction, ok in zip(predictions, fits):
        layout, memory = prediction.layout, prediction.memory
        step = measured.get(layout, math.nan)
        spread = (spreads or {}).get(layout, Spread.of([]))
        rows.append(
            {
                "layout": layout.label,
                "data_parallel": layout.data_parallel,
                "pipeline_stages": layout.pipeline_stages,
                "tensor_parallel": layout.tensor_parallel,
                "microbatches": layout.microbatches,
                "schedule": layout.schedule,
                "zero": layout.zero,
                "checkpointing": layout.checkpointing,
                "fits": ok,
                "predicted_step_s": prediction.step_s,
                "measured_step_s": step,
                "measured_low_s": spread.low,
                "measured_high_s": spread.high,
                "error": (prediction.step_s - step) / step,
                "samples_per_s": batch / prediction.step_s,
                "bubble": prediction.bubble,
                "gradient_s": prediction.gradient_s,
                "optimizer_s": prediction.optimizer_s,
                "params_mib": memory.parameters / MIB,
                "grads_mib": memory.gradients / MIB,
                "optimizer_mib": memory.optimizer / MIB,
                "activations_mib": memory.activations / MIB,
                "buffers_mib": memory.buffers / MIB,
                "peak_mib": memory.peak / MIB,
                "split": ",".join(prediction.split),
            }
        )
    return pd.DataFrame(rows, columns=COLUMNS)


def _refused_at_the_door(
    model_fn: Callable[[], Any], predictions: list[Prediction], config: TrainConfig, batch: int, limit: float
) -> list[bool]:
    """Whether ``rd.train`` would refuse each layout's config for ``limit`` (:func:`rapydli.experiments.planning.fit.check_fits`).

    The profile's blocks and the model's differ a little (the root ZeRO-3 keeps gathered,
    ``pipeline_split="auto"`` balanced by time here and by bytes there), so a layout the
    profile fits can be over the front door's count of its model states.
    """
    from rapydli.experiments.planning.fit import StatesPredictor

    predictor = StatesPredictor.of(model_fn)
    if predictor is None:
        return [False] * len(predictions)
    refused = []
    for prediction in predictions:
        try:
            states = predictor(prediction.layout.config(config, batch, prediction.split), prediction.layout.ranks)
        except ConfigError:  # a profile of other block names (given): the profile's prediction stands
            refused.append(False)
            continue
        refused.append(states.peak > limit)
    return refused


def _honoured(
    model_fn: Callable[[], Any], predictions: list[Prediction], config: TrainConfig
) -> tuple[list[Prediction], list[str]]:
    """The predictions whose layout keeps every parameter shared across its stages one parameter, and a note per refused kind.

    The model is built on the meta device (:func:`rapydli.parallel.preflight.meta_model`);
    one that cannot be keeps every prediction (its ranks refuse what they cannot run).
    """
    from rapydli.parallel import split
    from rapydli.parallel.preflight import meta_model
    from rapydli.parallel.shared import check_honoured, find_shared

    model = meta_model(model_fn)
    if model is None:
        return predictions, []
    kept: list[Prediction] = []
    notes: dict[str, str] = {}
    for prediction in predictions:
        layout = prediction.layout
        try:
            bounds = (
                split.boundaries(model, list(prediction.split), layout.pipeline_stages)
                if layout.pipeline_stages > 1
                else None
            )
        except ConfigError:  # a profile of other block names (given): nothing to check here
            bounds = None
        try:
            if bounds is not None:
                check_honoured(find_shared(model, bounds), model, layout.zero, None)
        except ConfigError as exc:
            notes.setdefault(
                f"zero={layout.zero}", f"layouts with pipeline stages and zero={layout.zero} left out: {exc}"
            )
            continue
        kept.append(prediction)
    return kept, list(notes.values())


def _best(
    predictions: list[Prediction], measured: dict[Candidate, float], spreads: dict[Candidate, Spread]
) -> tuple[Prediction, str]:
    """The fastest layout measured, else the fastest predicted (``predictions`` put those that fit first), and why
    (:attr:`ParallelPlan.best_reason`)."""
    if not measured:
        return predictions[0], "the fastest prediction (no layout was run)"
    fastest = min(measured, key=lambda layout: measured[layout])
    pick = next(p for p in predictions if p.layout == fastest)
    if len(measured) == 1:
        return pick, "the only layout run"
    overlapping = [other for other in measured if other != fastest and spreads[other].low <= spreads[fastest].high]
    if not overlapping:
        return pick, "the fastest layout run: its steps' middle half lies below every other run's"
    ms = lambda layout: f"{layout.label} {1e3 * spreads[layout].low:.1f}-{1e3 * spreads[layout].high:.1f} ms"  # noqa: E731
    return pick, (
        f"the lowest median step, but the machine could not tell it from {', '.join(o.label for o in overlapping)}: "
        f"the steps' middle halves overlap ({'; '.join(ms(layout) for layout in [fastest, *overlapping])}); any of them will do"
    )

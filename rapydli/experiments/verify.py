"""``rd.verify_layout``: does a layout train the model one process trains? Per parameter, in one call.

Every rank of the cluster trains ``steps`` steps under the config's layout (data x
pipeline x tensor parallelism, ZeRO), then the same steps in one process on the global
batch (the replicas' batches together), from the same seed, in float64 where the model
allows (``dtype``). Each rank compares what it holds with its part of the one-process
parameters (:mod:`rapydli.parallel.verify`); the client keeps, per parameter, the largest
difference over the ranks and gives a verdict against a tolerance relative to the
parameter's size. A tensor plan or a pipeline split written for a new model is known to
train the same model, or the parameter it does not, in seconds.

Examples
--------
>>> check = rd.verify_layout(gpt2, tokens, rd.TrainConfig(pipeline_stages=2, tensor_parallel=2, workers=4), loss_fn=lm_loss)  # doctest: +SKIP
>>> check.passed, check.verdict  # doctest: +SKIP
>>> check.table.head()  # doctest: +SKIP
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch.utils.data import Dataset

from rapydli.errors import ConfigError
from rapydli.experiments.store.refs import resolve_callable
from rapydli.parallel.layout import ONE_PROCESS, Layout
from rapydli.trainer.config import TrainConfig

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

    from rapydli.cluster import Cluster
    from rapydli.experiments.spec import DataSource, LossFn, ModelSource

#: Largest difference allowed, relative to ``max(1, largest |value|)`` of the parameter, by dtype.
TOLERANCES = {"float64": 1e-9, "float32": 1e-4}


@dataclass
class LayoutCheck:
    """What :func:`verify_layout` returns.

    Attributes
    ----------
    table
        One row per parameter of the one-process model: ``parameter``,
        ``max_abs_difference`` (largest over the ranks that hold it), ``max_abs_value``,
        ``relative`` (difference over ``max(1, value)``) and ``ok``; the worst first.
    passed
        Every parameter within ``tolerance``.
    verdict
        One sentence: the layout trains the same model, or the parameters that differ.
    worst
        The largest relative difference.
    tolerance, dtype, steps, layout
        What the check used: the tolerance, the dtype the models trained in, the steps,
        and the layout (:meth:`~rapydli.parallel.layout.Layout.describe`).
    built
        How the ranks made the model, as ``rd.train``'s would: ``"whole"``, ``"deferred"``
        (recorded on the meta device, each rank making its part) or ``"whole: <why>"``.
    """

    table: pd.DataFrame
    passed: bool
    verdict: str
    worst: float
    tolerance: float
    dtype: str
    steps: int
    layout: str
    built: tuple[str, ...] = ()


def verify_task(
    model_fn: Callable[[], Any],
    data_fn: Callable[[], Any],
    config: dict[str, Any],
    dtype: str,
    loss_fn: Any = None,
    layout: Layout | None = None,
) -> dict[str, Any]:
    """Engine half: train the layout (``layout``: the one :func:`verify_layout` built), then one process on the global batch;
    this rank's differences."""
    from rapydli.cluster import engine

    ctx = engine.context()
    cfg = TrainConfig.from_dict(config)
    return {"rank": ctx.rank, **compare_layout(model_fn, data_fn, cfg, dtype, ctx.comm, ctx.device, loss_fn, layout)}


#: The entry of :func:`compare_layout`'s differences that compares the two models' validation loss.
VALIDATION_LOSS = "(validation loss)"


def compare_layout(
    model_fn: Callable[[], Any],
    data_fn: Callable[[], Any],
    cfg: TrainConfig,
    dtype: str,
    comm: Any,
    device: Any,
    loss_fn: Any = None,
    layout: Layout | None = None,
) -> dict[str, Any]:
    """On every rank of ``comm``: train ``cfg``'s layout as ``rd.train`` does, then one process; what this rank holds against it.

    The model is made by :func:`rapydli.trainer.task.build_model`, the construction of
    ``rd.train``'s ranks (recorded on the meta device where the layout splits it, built
    whole where the recording cannot replay it), then converted to ``dtype`` as part of
    ``model_fn``, so what is checked is what a run would train. Returns ``differences``
    (parameters and buffers this rank holds: :func:`rapydli.parallel.verify.differences`,
    and, where ``data_fn`` gives validation data, :data:`VALIDATION_LOSS`: the loss each
    model's own evaluation computes, through the layout's stages and slices),
    ``untied`` (parameters tied in the one-process model that this rank holds apart) and
    ``built`` (how the model was made).
    """
    import torch
    from mpi4py import MPI

    from rapydli.parallel.verify import differences, untied
    from rapydli.trainer.loop import Trainer
    from rapydli.trainer.task import build_model

    wanted = getattr(torch, dtype)
    before = torch.get_default_dtype()
    torch.set_default_dtype(wanted)  # tensors the forward makes (positions, masks) in the same precision

    def converted() -> Any:
        return model_fn().to(dtype=wanted)

    try:
        train, val = data_fn()
        train, val = _Cast(train, wanted), _Cast(val, wanted) if val is not None else None
        torch.manual_seed(cfg.seed)
        layout = layout if layout is not None else Layout.of(cfg, comm.Get_size())
        model, built = build_model(converted, cfg, layout, device)
        trainer = Trainer(model, None, train, val, cfg, comm=comm, loss_fn=loss_fn, layout=layout)
        try:
            trainer.fit()
            evaluated = trainer.evaluate().get("val_loss")  # the layout's own evaluation (pipelined, split, gathered)
            unshard = getattr(trainer.optimizer, "unshard", None)
            if unshard is not None:  # ZeRO-3: the parameters this rank holds, whole again, to compare
                unshard()
        finally:
            trainer.close()
        replicas = trainer.data_size
        single = cfg.replace(
            batch_size=cfg.batch_size * replicas,
            **ONE_PROCESS,
            microbatches=1,
            workers=1,
            pipeline_split="auto",
            activation_checkpointing=None,
        )
        torch.manual_seed(cfg.seed)
        reference = Trainer(converted().to(device), None, train, val, single, comm=MPI.COMM_SELF, loss_fn=loss_fn)
        try:
            reference.fit()
            expected = reference.evaluate().get("val_loss")
        finally:
            reference.close()
        tensor_rank = trainer.grid.tensor_rank if trainer.grid is not None else 0
        found = differences(model, trainer.model, reference.model, tensor_rank)
        if expected is not None and evaluated is not None:
            found[VALIDATION_LOSS] = (abs(evaluated - expected), abs(expected))
        return {"differences": found, "untied": untied(model, trainer.model, reference.model), "built": built}
    finally:
        torch.set_default_dtype(before)


class _Cast(Dataset):
    """A dataset whose floating tensors come in ``dtype`` (the inputs of a float64 check)."""

    def __init__(self, dataset: Any, dtype: Any) -> None:
        self.dataset, self.dtype = dataset, dtype

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        import torch

        item = self.dataset[index]
        cast = lambda t: t.to(self.dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t  # noqa: E731
        return tuple(cast(t) for t in item) if isinstance(item, tuple | list) else cast(item)


def verify_layout(
    model_fn: ModelSource,
    data_fn: DataSource,
    config: TrainConfig | Mapping[str, Any],
    steps: int = 3,
    cluster: Cluster | None = None,
    *,
    loss_fn: LossFn | None = None,
    dtype: str = "float64",
    tolerance: float | None = None,
) -> LayoutCheck:
    """Train ``steps`` steps under ``config``'s layout and in one process; compare every parameter.

    Parameters
    ----------
    model_fn, data_fn, config, loss_fn
        As for ``rd.train`` (``config.workers`` ranks, its layout fields; evaluation,
        checkpoints and resuming are off here).
    steps
        Optimizer steps of both trainings.
    cluster
        As for ``rd.train``: the running one, else one started (and stopped) here.
    dtype
        ``"float64"`` (differences are rounding: the tolerance is 1e-9) or ``"float32"``
        for a model that cannot run in float64 (1e-4).
    tolerance
        The largest difference allowed, relative to ``max(1, largest |value|)`` of each
        parameter; ``None``: by ``dtype``.

    Returns
    -------
    LayoutCheck

    Raises
    ------
    ConfigError
        A bad argument or a layout the model cannot run (before anything starts).
    RankFailure
        A rank raised while training.
    """
    import pandas as pd

    from rapydli.cluster import ensure_cluster
    from rapydli.experiments.run import check_workers
    from rapydli.parallel.preflight import check_layout
    from rapydli.trainer.outputs import check_training_code

    cfg = config if isinstance(config, TrainConfig) else TrainConfig.from_dict(dict(config))
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ConfigError(f"steps={steps!r} is invalid: an integer >= 1")
    if dtype not in TOLERANCES:
        raise ConfigError(f"dtype={dtype!r} is invalid: one of {', '.join(TOLERANCES)}")
    tol = TOLERANCES[dtype] if tolerance is None else float(tolerance)
    model, data = resolve_callable(model_fn, "model_fn"), resolve_callable(data_fn, "data_fn")
    check_training_code(loss_fn)
    check_layout(model, cfg, loss_fn)
    cfg = cfg.replace(
        max_steps=steps, eval_every=0, checkpoint_dir=None, checkpoint_every=0, resume=False, autotune=False
    )
    with ensure_cluster(cluster, n=cfg.ranks_to_start(), start=False) as chosen:
        check_workers(
            cfg, chosen.n
        )  # the cluster's engines are the ranks; a layout they do not divide is refused naming them
        layout = Layout.of(cfg, chosen.n, where="the cluster")
        cfg = cfg.replace(workers=chosen.n)
        results = chosen.run(
            verify_task, model, data, cfg.to_dict(), dtype, loss_fn=loss_fn, layout=layout, targets=range(chosen.n)
        )
    merged: dict[str, tuple[float, float]] = {}
    untied = sorted({name for result in results for name in result["untied"]})
    for result in results:
        for name, (difference, value) in result["differences"].items():
            old = merged.get(name, (0.0, 0.0))
            merged[name] = (max(old[0], difference), max(old[1], value))
    rows = [
        {"parameter": n, "max_abs_difference": d, "max_abs_value": v, "relative": d / max(1.0, v)}
        for n, (d, v) in merged.items()
    ]
    table = pd.DataFrame(rows, columns=["parameter", "max_abs_difference", "max_abs_value", "relative"])
    table["ok"] = table["relative"] <= tol
    table = table.sort_values("relative", ascending=False, ignore_index=True)
    worst = float(table["relative"].max()) if len(table) else math.nan
    bad = table[~table["ok"]]["parameter"].tolist()
    described = layout.describe()
    if untied:
        verdict = f"{described} does NOT train the one-process model: tied parameters were trained apart ({', '.join(untied)})"
    elif bad:
        verdict = f"{described} does NOT train the one-process model: {len(bad)} parameter(s) differ by more than {tol:g}, worst {bad[0]} ({worst:.3g})"
    else:
        compared = int((table["parameter"] != VALIDATION_LOSS).sum())
        also = "; its validation loss agrees too" if compared < len(table) else ""
        verdict = (
            f"{described} trains the one-process model: all {compared} parameters within {tol:g} (worst {worst:.3g}) "
            f"after {steps} steps in {dtype}{also}"
        )
    built = tuple(sorted({result["built"] for result in results}))
    return LayoutCheck(
        table=table,
        passed=not bad and not untied,
        verdict=verdict,
        worst=worst,
        tolerance=tol,
        dtype=dtype,
        steps=steps,
        layout=described,
        built=built,
    )

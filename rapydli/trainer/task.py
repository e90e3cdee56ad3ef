"""The engine half of a run: what every rank of a cluster group executes for one training run.

:func:`engine_task` is shipped by the client half (:class:`rapydli.experiments.job.TrainingJob`)
to every engine of the group. It is the one bridge between the cluster and the Trainer:
it reads the engine's context (rank, the group's mpi4py communicator, device), builds model
and data, and hands the :class:`~rapydli.trainer.loop.Trainer` the mpi4py communicator
(the Trainer builds the run's :class:`~rapydli.comm.Communicator` from it) and two
callables, ``should_stop`` (the notebook asked the task to stop) and the metrics callbacks
that ``emit`` rows to the notebook. The Trainer itself knows nothing of clusters.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from rapydli.parallel.layout import Layout
from rapydli.trainer.config import TrainConfig

WARMUP_STEPS = 2  # steps left out of per-rank timing summaries (first-touch, allocator warm-up)
TIMING_KEYS = ("step_time_s", "data_time_s", "comm_time_s", "comm_wait_s")
#: The set-up phase of building the Trainer: its layout and groups, the allreduce choice
#: (``auto`` measures the algorithms unless cached), native compilation and autotune.
TRAINER_SETUP = "trainer (layout, allreduce choice, compilation, autotune)"

#: ``emit(kind, payload, flush=False)``: sends one event to the notebook (a no-op outside a task).
Emit = Callable[..., None]


def engine_task(
    model_fn: Callable[[], Any],
    data_fn: Callable[[], Any],
    config: dict[str, Any],
    loss_fn: Callable[..., Any] | None = None,
    optimizer_fn: Callable[..., Any] | None = None,
    metrics: Any = None,
    await_verdict: str | None = None,
    layout: Layout | None = None,
    model_dir: str | None = None,
) -> dict[str, Any]:
    """Run one training run on this rank of the group (every rank of it calls this).

    ``loss_fn``, ``optimizer_fn`` and ``metrics`` go to the
    :class:`~rapydli.trainer.loop.Trainer` as they are, and so does ``layout``, the run's
    :class:`~rapydli.parallel.layout.Layout` built where the run was planned (``None``: made
    here from ``config`` and the group's ranks, for a caller that has none). With ``await_verdict`` (a metric
    name, e.g. a sweep's ``val_loss``), rank 0 waits after each row carrying that metric
    until the notebook answers it (go on, or stop: :func:`rapydli.cluster.engine.await_verdict`),
    so a decision on a report (a pruner's) stops every rank within one step of it. With
    ``model_dir``, the ranks write the trained model there as it lies on them, each its
    pieces (:meth:`~rapydli.trainer.loop.Trainer.save_model`): nothing is gathered, and the
    notebook assembles it only when asked (``result.model()``).

    Builds model and data, then the ranks agree that every one of them succeeded before
    any collective (so a rank whose ``model_fn``/``data_fn`` raised is the only one named,
    and nobody is left blocked); runs the :class:`~rapydli.trainer.loop.Trainer`; rank 0
    emits its rows as events. Returns each rank's timing medians, whether the run was
    stopped early, and rank 0's full history.
    """
    import torch

    from rapydli.cluster import engine
    from rapydli.cluster.events import emit
    from rapydli.trainer.loop import Trainer
    from rapydli.trainer.usercheck import check_data, name_of

    ctx = engine.context()
    cfg = TrainConfig.from_dict(config)
    layout = layout if layout is not None else Layout.of(cfg, ctx.world_size)  # the run's, built where it was planned
    error: BaseException | None = None
    began = time.perf_counter()
    try:
        torch.manual_seed(cfg.seed)
        model, built = build_model(model_fn, cfg, layout, ctx.device)
        train_data, val_data = check_data(data_fn(), name_of(data_fn))  # a wrong return named, not unpacked
    except Exception as exc:  # noqa: BLE001 - re-raised below, after the agreement
        error = exc
    failed = ctx.comm.allgather(error is not None)
    if error is not None:
        raise error
    if any(failed):
        return {"rank": ctx.rank, "history": [], "stopped_early": False, "timing": {}}
    made = time.perf_counter()
    trainer = Trainer(
        model,
        None,
        train_data,
        val_data,
        cfg,
        comm=ctx.comm,
        callbacks=[EmitMetrics(ctx.rank, emit, await_verdict), EmitRankTimings(ctx.rank, emit)],
        should_stop=lambda: engine.should_stop(ctx.comm),
        loss_fn=loss_fn,
        optimizer_fn=optimizer_fn,
        metrics=metrics,
        layout=layout,
    )
    if trainer.pipeline is not None:  # every rank's spans of each step, for result.timeline()
        trainer.callbacks += (trainer.pipeline.timeline_callback(emit),)
    # rank 0's set-up before its first step, by phase (the client adds the engines' and the shipping's)
    setup_s = {"model and data": made - began, TRAINER_SETUP: time.perf_counter() - made}
    try:
        if ctx.rank == 0:
            emit(
                "start",
                {
                    "total_steps": trainer.total_steps,
                    "start_step": trainer.step,
                    "world_size": ctx.world_size,
                    "history": trainer.resumed_history,
                    "setup_s": setup_s,
                    "model_built": built,
                },
                flush=True,
            )
        history = trainer.fit()
        if (
            model_dir is not None
        ):  # the trained model stays sharded: each rank writes its pieces, result.model() assembles them
            trainer.save_model(model_dir)
    finally:
        trainer.close()
    return {
        "rank": ctx.rank,
        "history": history if ctx.rank == 0 else [],
        "stopped_early": trainer.stopped_early,
        "timing": timing_summary(history),
        "parameters": sum(p.numel() for p in model.parameters()),
        "gradient_bytes": sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad),
    }


def build_model(model_fn: Callable[[], Any], config: TrainConfig, layout: Layout | int, device: Any) -> tuple[Any, str]:
    """``model_fn()``'s model on this rank, and how it was made: ``"whole"``, ``"deferred"``, or why not deferred.

    ``layout`` is the run's :class:`~rapydli.parallel.layout.Layout` (a run passes the one it
    planned), or, for a script under ``mpiexec``, the number of ranks it runs on (the layout
    is then made from ``config``). When the layout splits the model
    (:meth:`~rapydli.parallel.layout.Layout.builds_deferred`) it is recorded on the meta
    device, and the layout makes only this rank's part (:mod:`rapydli.parallel.deferred`); a
    ``model_fn`` the recording cannot replay is built whole, and the reason returned.
    """
    from rapydli.parallel.deferred import Unrecordable, record

    if isinstance(layout, int):
        layout = Layout.of(config, layout)
    if not layout.builds_deferred(config):
        return model_fn().to(device), "whole"
    try:
        return record(model_fn, device)[0], "deferred"
    except Unrecordable as exc:
        model = model_fn().to(device)
        held = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
        return model, f"whole: {exc} (each rank holds the whole model, {held / 2**20:.1f} MiB, until it keeps its part)"


class EmitMetrics:
    """Send rank 0's rows to the notebook as events (the engine task installs it).

    Emits ``("metrics", row)`` for every train and eval row and ``("epoch", row)`` at
    each epoch end. Evaluation rows are sent at once (a pruner decides on them); step rows
    may be coalesced. Other ranks emit nothing. With ``await_verdict`` (a metric name), a
    row carrying that metric is sent at once and rank 0 waits for the notebook's answer
    (:func:`rapydli.cluster.engine.await_verdict`) before the run goes on.
    """

    def __init__(self, rank: int, emit: Emit, await_verdict: str | None = None) -> None:
        self.rank, self.emit, self.await_verdict = rank, emit, await_verdict

    def _emit(self, kind: str, row: dict[str, Any], flush: bool = False) -> None:
        if self.rank != 0:
            return
        if kind != "metrics" or self.await_verdict is None or not isinstance(row.get(self.await_verdict), (int, float)):
            self.emit(kind, row, flush=flush)
            return
        from rapydli.cluster import engine

        engine.expect_verdict()  # before sending: an answer that comes back at once is this row's
        self.emit(kind, row, flush=True)
        # a stop is seen by every rank at the step's stop check; a lost answer is asked for again
        # the reminder carries the row, so a client that never received the report can still decide on it
        engine.await_verdict(remind=lambda: self.emit("awaiting", {"step": row.get("step"), "row": row}, flush=True))

    def on_step_end(self, metrics: dict[str, Any]) -> None:
        self._emit("metrics", metrics)

    def on_eval_end(self, metrics: dict[str, Any]) -> None:
        self._emit("metrics", metrics, flush=True)

    def on_epoch_end(self, metrics: dict[str, Any]) -> None:
        self._emit("epoch", metrics)


class EmitRankTimings:
    """On ranks other than 0: send each step's timings and own loss (``rank_loss``: its share of the
    batch; they differ per rank) as ``rank_timings`` events."""

    def __init__(self, rank: int, emit: Emit) -> None:
        self.rank, self.emit = rank, emit

    def on_step_end(self, row: dict[str, Any]) -> None:
        if self.rank != 0:
            self.emit(
                "rank_timings",
                {
                    "kind": "rank",
                    "rank": self.rank,
                    **{k: row[k] for k in ("step", *TIMING_KEYS, "rank_loss") if k in row},
                },
            )


def timing_summary(history: Sequence[dict[str, Any]], warmup: int = WARMUP_STEPS) -> dict[str, float]:
    """Medians of the step timings over the train rows after ``warmup`` steps (all rows if too few)."""
    rows = [r for r in history if r.get("kind") == "train"]
    kept = rows[warmup:] if len(rows) > warmup else rows
    if not kept:
        return {}
    summary = {key: statistics.median(r[key] for r in kept) for key in TIMING_KEYS}
    summary["steps"] = len(kept)
    return summary

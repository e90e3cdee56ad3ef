"""``rapydli bench live`` (also the live part of ``rapydli bench trainer``): what watching training costs it.

Starts a local cluster of ``n`` engines and runs the task that ``rd.train``, the widgets and
sweeps run (:func:`rapydli.trainer.task.engine_task`) twice per round, interleaved:
with its step rows streamed to a :class:`~rapydli.widgets.live.LivePlot` in this process
(events on, as in a notebook) and with streaming off (``emit`` returns at once). The
``mlp_pipelined`` model trains in 2 pipeline stages (``microbatches=4``); its live variant
also streams every rank's spans of each step to a
:class:`~rapydli.widgets.timeline.LiveTimeline` that redraws the Gantt chart as
``rd.train`` does. The cost is the median over rounds of the ratio of their median step
times (slowest rank) minus one; the issue's target is <= 2% of the step. Both variants poll ``should_stop`` once per step, as every
cluster task does, so it is timed separately, with ``emit`` and one publish, on the ranks;
then the ranks emit a row every 10 ms and the client times how late each one arrives
(target: within 1 s).

With ``--trackers tensorboard`` (the default; ``''`` for none) each round also runs a third,
``tracked`` variant: the live displays as above, plus the rows written to a run store in a
scratch home as ``rd.train`` writes them, followed by those experiment trackers
(:class:`~rapydli.experiments.trackers.follow.RunTrackers`, its thread pushing every
second). The tracker cost is the median over rounds of tracked / live step - 1 (so it also
holds the store's writes), with its range over rounds; the target is the live metrics' 2%.
"""

from __future__ import annotations

import contextlib
import functools
import statistics
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import click

from rapydli.spread import paired, rounds_text, target
from rapydli.trainer.config import TrainConfig
from rapydli.trainer.task import WARMUP_STEPS
from rapydli.zoo import datasets, models

MAX_LIVE_COST = 0.02
MAX_LAG_S = 1.0
MICRO_CALLS = 2000
LATENCY_EVENTS, STEP_S = 150, 0.01

#: Models by name: the model function and what its runs change in the ``TrainConfig``.
LIVE_MODELS: dict[str, tuple[Any, dict[str, Any]]] = {
    "resnet_mini": (functools.partial(models.resnet_mini, in_channels=3), {}),
    "mlp": (functools.partial(models.mlp, in_features=3 * 32 * 32, hidden=512, depth=2), {}),
    "mlp_pipelined": (
        functools.partial(models.mlp, in_features=3 * 32 * 32, hidden=512, depth=4),
        {"pipeline_stages": 2, "microbatches": 4},
    ),
}


def per_call_costs(calls: int) -> dict[str, float]:
    """Engine side: microseconds per ``emit`` (coalesced), per publish, per ``should_stop``."""
    from rapydli.cluster import events
    from rapydli.cluster.engine import context, should_stop
    from rapydli.trainer.callbacks import STEP_KEYS

    comm = context().comm
    row = dict.fromkeys(STEP_KEYS, 0.0)
    comm.Barrier()
    started = time.perf_counter()
    for _ in range(calls):
        events.emit("bench", row)
    emit_s = (time.perf_counter() - started) / calls
    publishes = []
    for _ in range(20):
        started = time.perf_counter()
        events.emit("bench", row, flush=True)
        publishes.append(time.perf_counter() - started)
    comm.Barrier()
    started = time.perf_counter()
    for _ in range(calls):
        should_stop(comm)
    stop_s = (time.perf_counter() - started) / calls
    for _ in range(LATENCY_EVENTS):  # a step row every STEP_S: the client times their arrival
        events.emit("latency", time.time())
        time.sleep(STEP_S)
    return {"emit_us": 1e6 * emit_s, "publish_us": 1e6 * statistics.median(publishes), "should_stop_us": 1e6 * stop_s}


def measure(
    n: int, names: list[str], steps: int, rounds: int, allreduce: str, bucket_mb: float, trackers: tuple[str, ...] = ()
) -> list[dict[str, Any]]:
    """Rows ``{model, variant: live|quiet|tracked, step_ms, ...}`` and one ``per_call`` row per rank (``tracked`` with ``trackers``)."""
    from rapydli.cluster import Cluster
    from rapydli.trainer.task import engine_task
    from rapydli.widgets.live import LivePlot
    from rapydli.widgets.timeline import LiveTimeline

    rows: list[dict[str, Any]] = []
    with Cluster(n, threads=1) as cluster:
        for name in names:
            model_fn, changes = LIVE_MODELS[name]
            config = TrainConfig(
                batch_size=32,
                lr=0.01,
                optimizer="sgd",
                allreduce=allreduce,
                bucket_mb=bucket_mb,
                max_steps=steps,
                workers=n,
                **changes,
            )
            data = functools.partial(
                datasets.synthetic_images, config.batch_size * n * steps + 64, size=32, val_fraction=0.01
            )
            times: dict[str, list[float]] = {"live": [], "quiet": [], **({"tracked": []} if trackers else {})}
            received = timelines = redraws = 0
            for round_ in range(rounds):
                for variant in list(times)[:: 1 if round_ % 2 == 0 else -1]:  # alternate who goes first
                    displays: list[Any] = []
                    if variant != "quiet":  # what rd.train shows in a notebook
                        displays = [LivePlot(live=False)] + (
                            [LiveTimeline(live=False)] if config.pipeline_stages > 1 else []
                        )
                    on_event = functools.partial(_to_displays, displays) if displays else None
                    if variant == "tracked":
                        with _tracked(on_event, trackers, name) as tracked_event:
                            results = cluster.submit(
                                engine_task, model_fn, data, config.to_dict(), on_event=tracked_event
                            ).wait()
                    else:
                        results = cluster.submit(
                            engine_task, model_fn, data, config.to_dict(), on_event=on_event
                        ).wait()
                    times[variant].append(max(r["timing"]["step_time_s"] for r in results))
                    for display in displays:
                        display.close()
                    if variant == "live":
                        received += sum(1 for r in displays[0].rows if r.get("kind") == "train")
                        timelines += sum(display.received for display in displays[1:])
                        redraws += sum(display.redraws for display in displays[1:])
            for variant, per_round in times.items():
                live = variant == "live"
                rows.append(
                    {
                        "model": name,
                        "variant": variant,
                        "ranks": n,
                        "pipeline_stages": config.pipeline_stages,
                        "steps": steps,
                        "step_ms": 1000 * statistics.median(per_round),
                        "step_ms_min": 1000 * min(per_round),
                        "step_ms_max": 1000 * max(per_round),
                        "round_ms": [1000 * t for t in per_round],
                        "rows_received": received if live else 0,
                        "timeline_rows_received": timelines if live else 0,
                        "timeline_redraws": redraws if live else 0,
                    }
                )
        lags: dict[int, list[float]] = {rank: [] for rank in range(n)}
        costs = cluster.submit(per_call_costs, MICRO_CALLS, on_event=functools.partial(_lag, lags)).wait()
    rows += [
        {
            "model": None,
            "variant": "per_call",
            "rank": rank,
            **cost,
            "lag_ms_median": 1000 * statistics.median(lags[rank]),
            "lag_ms_max": 1000 * max(lags[rank]),
        }
        for rank, cost in enumerate(costs)
    ]
    return rows


@contextlib.contextmanager
def _tracked(on_event: Any, trackers: tuple[str, ...], name: str) -> Iterator[Any]:
    """``on_event`` that also writes the rows to a scratch run store followed by ``trackers``, as ``rd.train`` does."""
    from rapydli.experiments.store.runstore import RunStore
    from rapydli.experiments.trackers.follow import RunTrackers
    from rapydli.settings import home_at

    with (
        tempfile.TemporaryDirectory(prefix="rapydli-bench-") as scratch,
        home_at(scratch),
    ):  # the trackers' files go there too
        store = RunStore(f"{scratch}/runs.db")
        run_id = store.create_run("train", f"bench-live-{name}", {"model": name})
        followed = RunTrackers(store, run_id, trackers)

        def stored(rank: int, kind: str, payload: Any) -> None:
            if kind in ("metrics", "rank_timings"):
                suffix = f"@rank{payload['rank']}" if kind == "rank_timings" else ""
                store.log_metrics(
                    run_id,
                    [
                        (payload["step"], f"{key}{suffix}", value)
                        for key, value in payload.items()
                        if key not in _NOT_METRICS and isinstance(value, (int, float)) and not isinstance(value, bool)
                    ],
                )
            on_event(rank, kind, payload)

        try:
            yield stored
        finally:
            store.finish_run(run_id)
            followed.close()
            store.close()


_NOT_METRICS = {"kind", "step", "rank", "world_size", "epoch", "time_s"}


def _to_displays(displays: list[Any], rank: int, kind: str, payload: Any) -> None:
    """What :class:`~rapydli.experiments.job.TrainingJob` hands its callbacks."""
    row = (
        {"kind": "timeline", **payload}
        if kind == "timeline"
        else payload
        if kind in ("metrics", "rank_timings")
        else None
    )
    if row is not None:
        for display in displays:
            display(row)


def _lag(lags: dict[int, list[float]], rank: int, kind: str, payload: Any) -> None:
    if kind == "latency":  # engines and client share this host's clock
        lags[rank].append(time.time() - payload)


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The live-metrics cost per model and the per-call costs as a share of the step."""
    summary: dict[str, Any] = {}
    per_call = [row for row in rows if row["variant"] == "per_call"]
    keys = ("emit_us", "publish_us", "should_stop_us", "lag_ms_median", "lag_ms_max")
    slowest = {key: max(row[key] for row in per_call) for key in keys} if per_call else {}
    for model in dict.fromkeys(row["model"] for row in rows if row["model"] is not None):
        step = {row["variant"]: row["step_ms"] for row in rows if row["model"] == model}
        rounds = {row["variant"]: row["round_ms"] for row in rows if row["model"] == model}
        # paired by round (the two ran back to back), so slow drifts of a shared machine cancel
        cost = paired(rounds["live"], rounds["quiet"])
        summary[f"{model}: live metrics cost (median over rounds of streamed / quiet step - 1)"] = cost.median - 1.0
        summary[f"{model}: live metrics cost range over rounds"] = rounds_text(cost.minus(1.0), percent=True)
        summary[f"{model}: target live cost <= {MAX_LIVE_COST:.0%}"] = target(
            cost.minus(1.0), MAX_LIVE_COST, percent=True
        )
        if "tracked" in rounds:  # paired with the live run of the same round: what the store and the trackers add
            tracked = paired(rounds["tracked"], rounds["live"])
            summary[f"{model}: tracker cost (median over rounds of tracked / live step - 1)"] = tracked.median - 1.0
            summary[f"{model}: tracker cost range over rounds"] = rounds_text(tracked.minus(1.0), percent=True)
            summary[f"{model}: target tracker cost <= {MAX_LIVE_COST:.0%}"] = target(
                tracked.minus(1.0), MAX_LIVE_COST, percent=True
            )
        live = next(row for row in rows if row["model"] == model and row["variant"] == "live")
        if live.get("timeline_rows_received"):
            summary[f"{model}: live timeline rows received, redraws"] = (
                f"{live['timeline_rows_received']}, {live['timeline_redraws']}"
            )
        if slowest:
            step_us = 1000 * step["quiet"]
            summary[f"{model}: emit + should_stop per step, share of step"] = (
                slowest["emit_us"] + slowest["should_stop_us"]
            ) / step_us
    for key, value in slowest.items():
        summary[f"per call on the slowest rank: {key}"] = value
    if slowest:
        summary[f"target: a row reaches the notebook within {MAX_LAG_S:g} s"] = (
            "met" if slowest["lag_ms_max"] <= 1000 * MAX_LAG_S else "not met"
        )
    return summary


@click.command("live")
@click.option("-n", "n", type=click.IntRange(min=1), default=2, show_default=True, help="Engines of the local cluster.")
@click.option(
    "--json", "json_path", type=click.Path(dir_okay=False), default=None, help="Write the rows and summary here."
)
@click.option(
    "--models", default="mlp,mlp_pipelined", show_default=True, help=f"Comma-separated, from: {', '.join(LIVE_MODELS)}."
)
@click.option(
    "--steps", type=click.IntRange(min=1), default=60, show_default=True, help="Measured steps per live/quiet run."
)
@click.option("--rounds", type=click.IntRange(min=1), default=5, show_default=True, help="Live/quiet pairs per model.")
@click.option("--allreduce", default="auto", show_default=True, help="TrainConfig.allreduce of the runs.")
@click.option("--bucket-mb", type=float, default=25.0, show_default=True, help="TrainConfig.bucket_mb of the runs.")
@click.option(
    "--trackers",
    default="tensorboard",
    show_default=True,
    help="Experiment trackers of the 'tracked' variant, comma-separated ('' for none; see the README's Trackers).",
)
def command(
    n: int, json_path: str | None, models: str, steps: int, rounds: int, allreduce: str, bucket_mb: float, trackers: str
) -> None:
    """What streaming the live plot (and a pipelined run's live timeline) costs a training step; row latency."""
    from rapydli.bench.report import emit

    names = [name.strip() for name in models.split(",") if name.strip()]
    unknown = sorted(set(names) - set(LIVE_MODELS))
    if unknown:
        raise click.BadParameter(
            f"unknown model(s) {', '.join(unknown)}; allowed: {', '.join(LIVE_MODELS)}", param_hint="--models"
        )
    chosen = TrainConfig(
        allreduce=allreduce, bucket_mb=bucket_mb, trackers=trackers
    ).trackers  # a bad value is refused before the cluster starts
    rows = measure(n, names, steps + WARMUP_STEPS, rounds, allreduce, bucket_mb, tuple(filter(None, chosen.split(","))))
    emit("live", rows, summarize(rows), json_path)

"""``rd.train``: data-parallel training from the notebook, recorded as a run.

The notebook side of design flow 2: validate the config, record a ``train`` run in the
store, ship ``model_fn``/``data_fn`` to every engine of the cluster, run a
:class:`~rapydli.train.trainer.Trainer` on each rank, and follow rank 0's metrics as
they arrive (progress bar, client callbacks such as a live plot, the store) until the
history comes back as a DataFrame.

Examples
--------
>>> import rapydli as rd  # doctest: +SKIP
>>> result = rd.train("rapydli.train.models:resnet_digits", "rapydli.train.datasets:digits",
...                   rd.TrainConfig(epochs=2, workers=2))  # doctest: +SKIP
>>> result.history.query("kind == 'eval'").val_accuracy.iloc[-1]  # doctest: +SKIP
0.97
"""

from __future__ import annotations

import threading
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import import_module
from typing import TYPE_CHECKING, Any

from rapydli.errors import ConfigError, RankFailure
from rapydli.train.config import TrainConfig

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

    from rapydli.cluster import Cluster

#: A client-side callback: called with each metrics row (``row["kind"]`` is ``"train"`` or
#: ``"eval"``; keys in :mod:`rapydli.train.callbacks`) as it arrives from rank 0.
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
    """

    run_id: str | None
    history: pd.DataFrame
    figure: Any

    def _repr_html_(self) -> str:  # pragma: no cover - notebook display
        final = self.history.dropna(axis=1, how="all").tail(3)
        return f"<b>RunResult</b> run_id={self.run_id}<br>{final.to_html(index=False)}"


def callable_ref(fn: Any) -> str | None:
    """``"module:qualname"`` if ``fn`` can be imported back by that name, else ``None``."""
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if not module or not qualname or "<" in qualname or module == "__main__":
        return None
    try:
        target: Any = import_module(module)
        for part in qualname.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError):
        return None
    return f"{module}:{qualname}" if target is fn else None


def resolve_callable(ref: Callable[..., Any] | str, argument: str) -> Callable[..., Any]:
    """``ref`` itself if callable, or the object a ``"module:qualname"`` string names."""
    if callable(ref):
        return ref
    if isinstance(ref, str) and ref.count(":") == 1:
        module, qualname = ref.split(":")
        try:
            target: Any = import_module(module)
            for part in qualname.split("."):
                target = getattr(target, part)
        except (ImportError, AttributeError) as exc:
            raise ConfigError(f"{argument}={ref!r} cannot be imported: {exc}") from None
        if callable(target):
            return target
    raise ConfigError(f"{argument}={ref!r} is invalid: must be a callable or a 'module:qualname' string naming one")


def train_on_rank(model_fn: Callable[[], Any], data_fn: Callable[[], Any], config: dict[str, Any]) -> dict[str, Any]:
    """The engine half of :func:`train`: build model and data, run the Trainer.

    Runs inside :meth:`Cluster.run` on every rank; rank 0 emits its rows as events and
    returns ``{"history": rows, "stopped_early": bool, "step": int}`` (other ranks: ``{}``).
    """
    import torch

    from rapydli.cluster.engine import context
    from rapydli.cluster.events import emit
    from rapydli.comm import Communicator
    from rapydli.train.callbacks import EmitMetrics
    from rapydli.train.trainer import Trainer

    ctx = context()
    cfg = TrainConfig.from_dict(config)
    # user code first; then agree that every rank succeeded, so that a rank whose
    # model_fn/data_fn raised does not leave the others blocked in a collective
    error: BaseException | None = None
    try:
        torch.manual_seed(cfg.seed)
        model = model_fn().to(ctx.device)
        train_data, val_data = data_fn()
    except Exception as exc:  # noqa: BLE001 - re-raised below, after the agreement
        error = exc
    failed = ctx.comm.allgather(error is not None)
    if error is not None:
        raise error
    if any(failed):
        return {}  # the failing rank raises and is named in the RankFailure
    comm = Communicator(ctx.comm, algorithm=cfg.allreduce)
    try:
        trainer = Trainer(model, None, train_data, val_data, cfg, comm=comm, callbacks=[EmitMetrics(ctx.rank)])
        if ctx.rank == 0:
            emit("start", {"total_steps": trainer.total_steps, "start_step": trainer.step, "world_size": ctx.world_size})
        history = trainer.fit()
    finally:
        comm.close()
    if ctx.rank != 0:
        return {}
    return {"history": history, "stopped_early": trainer.stopped_early, "step": trainer.step}


class _Follower:
    """Client-side handler of rank 0's events: progress bar, callbacks, store rows."""

    def __init__(self, callbacks: Sequence[MetricsCallback], store: Any, run_id: str | None, progress: bool) -> None:
        self.callbacks = tuple(callbacks)
        self.store, self.run_id = store, run_id
        self.rows: list[dict[str, Any]] = []
        self.bar: Any = None
        self.progress = progress
        self.lock = threading.Lock()

    def __call__(self, rank: int, kind: str, payload: dict[str, Any]) -> None:
        with self.lock:
            if kind == "start" and self.progress:
                from tqdm.auto import tqdm

                self.bar = tqdm(total=payload["total_steps"], initial=payload["start_step"], desc="train", unit="step")
            elif kind == "metrics":
                self.rows.append(payload)
                if payload.get("kind") == "train" and self.bar is not None:
                    self.bar.update(payload["step"] - self.bar.n)
                    self.bar.set_postfix(loss=f"{payload['loss']:.4g}", refresh=False)
                if self.store is not None and self.run_id is not None:
                    self.store.log_metrics(self.run_id, _metric_rows(payload))
                for callback in self.callbacks:
                    callback(dict(payload))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


_NUMERIC_SKIP = {"kind", "step", "rank", "world_size"}


def _metric_rows(row: dict[str, Any]) -> list[tuple[int, str, float]]:
    return [
        (row["step"], name, value)
        for name, value in row.items()
        if name not in _NUMERIC_SKIP and isinstance(value, (int, float)) and not isinstance(value, bool)
    ]


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
        Client-side callables, each called with every metrics row as it arrives from
        rank 0 (a live plot hooks in here).
    progress
        Show a tqdm progress bar driven by rank 0's steps.
    live
        Show a live plot (loss, val loss, throughput, step/comm time) that rank 0's rows
        update while training runs; it ends as a static figure in the cell's output, so
        it is kept by papermill. Default: when running in a Jupyter kernel.
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
    import pandas as pd

    cfg = config if isinstance(config, TrainConfig) else TrainConfig.from_dict(dict(config))
    model = resolve_callable(model_fn, "model_fn")
    data = resolve_callable(data_fn, "data_fn")
    for callback in callbacks:
        if not callable(callback):
            raise ConfigError(f"callbacks must be callables taking a metrics dict; got {callback!r}")

    from rapydli.experiments.store import open_store

    store = open_store()
    own_cluster = cluster is None
    if own_cluster:
        from rapydli.cluster import Cluster

        cluster = Cluster(n=cfg.workers)
    params = {
        "model_fn": model_fn if isinstance(model_fn, str) else callable_ref(model) or repr(model),
        "data_fn": data_fn if isinstance(data_fn, str) else callable_ref(data) or repr(data),
        "config": cfg.to_dict(),
    }
    run_name = name or getattr(model, "__name__", "model")
    run_id = store.create_run("train", run_name, params, world_size=cluster.n, seed=cfg.seed) if store else None
    from rapydli.widgets.live import LivePlot, in_kernel

    live_plot = None
    if live or (live is None and in_kernel()):
        live_plot = LivePlot(title=run_name)
        live_plot.show()
        callbacks = (*callbacks, live_plot)
    follower = _Follower(callbacks, store, run_id, progress)
    status, error = "failed", None
    try:
        if own_cluster:
            cluster.start()
        outcome = cluster.run(train_on_rank, model, data, cfg.to_dict(), on_event=follower)[0]
        status = "finished"
        if outcome["stopped_early"]:
            status, error = "interrupted", f"stopped from the notebook after step {outcome['step']}"
    except KeyboardInterrupt:
        status, error = "interrupted", "interrupted by the user"
        raise
    except RankFailure as exc:
        error = str(exc)
        raise
    except BaseException:
        error = traceback.format_exc(limit=5)
        raise
    finally:
        follower.close()
        if live_plot is not None:
            live_plot.close()
        if own_cluster:
            cluster.stop()
        if store is not None and run_id is not None:
            store.finish_run(run_id, status, error)
    history = pd.DataFrame(outcome["history"])
    return RunResult(run_id=run_id, history=history, figure=loss_figure(history, title=run_name))


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

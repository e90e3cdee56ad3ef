"""A training run that does not block: submitted to a group of engines, polled by its owner.

``rd.train`` blocks until the run ends. Widgets (Stop must stay clickable), sweeps
(several trials side by side on disjoint engine groups) and scaling studies need the
same run as a :class:`TrainingJob`: :meth:`~TrainingJob.poll` advances it from one
thread, metric rows reach the callbacks as they arrive, :meth:`~TrainingJob.request_stop`
ends it cooperatively on every rank after the same step, and the run is recorded in the
store like ``rd.train``'s.

Examples
--------
>>> job = TrainingJob(cluster, RunSpec.of(models.mlp, datasets.digits), TrainConfig(max_steps=20), targets=[0, 1]).start()  # doctest: +SKIP
>>> while not job.poll(0.05):  # doctest: +SKIP
...     pass
>>> job.state, job.final_metrics()["val_loss"]  # doctest: +SKIP
('finished', 0.41)
"""

from __future__ import annotations

import math
import time
import traceback
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rapydli.errors import ConfigError, RankFailure
from rapydli.experiments.stragglers import StragglerWatch
from rapydli.experiments.trackers.follow import RunTrackers, follow
from rapydli.parallel.layout import Layout
from rapydli.trainer.config import TrainConfig
from rapydli.trainer.task import engine_task
from rapydli.trainer.usercheck import same_mistake

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

    from rapydli.cluster import Cluster
    from rapydli.experiments.spec import RunSpec

#: A run asked to stop (``request_stop``) that has not ended this many seconds later is
#: interrupted by :meth:`TrainingJob.poll` (SIGINT; ranks blocked in a collective are aborted),
#: unless the request gave a grace of its own.
STOP_GRACE_S = 10.0
#: The set-up phase from submitting the task to its start on rank 0: shipping the code, and on a
#: cluster started just now the engines' import of torch and the trainer (:func:`rapydli.cluster.engine.warm_up`).
TASK_STARTED = "code shipped, torch imported, task started"


@dataclass(frozen=True)
class Recording:
    """How a :class:`TrainingJob`'s run is recorded in the store.

    ``kind`` ``train`` or ``trial``; ``name`` (default: the spec's); ``parent`` (a sweep's or a
    scaling study's id); ``extra_params`` added to the run's parameters; ``store`` False: nothing
    is recorded (nor tracked); ``end_status`` False when the owner records how the run ended
    (a sweep records its trial's state, :mod:`rapydli.experiments.sweep.lifecycle`).
    """

    kind: str = "train"
    name: str | None = None
    parent: str | None = None
    extra_params: Mapping[str, Any] = field(default_factory=dict)
    store: bool = True
    end_status: bool = True


@dataclass(frozen=True)
class Continuation:
    """The earlier attempt a restarted :class:`TrainingJob` goes on from (:mod:`rapydli.experiments.restarts`).

    ``run_id``: the run it continues (metrics go there, no new run); ``delivered``: ``(kind,
    step)`` of the rows the earlier attempts delivered (the checkpoint's rows not among them,
    rows a dying engine never sent, are recorded and passed to the callbacks when the job
    starts: :attr:`TrainingJob.recovered_rows`); ``bar``: the earlier attempt's progress bar,
    which this job goes on with.
    """

    run_id: str | None
    delivered: Collection[tuple[Any, int]] = ()
    bar: Any = None


class TrainingJob:
    """One training run on ``targets`` of a cluster: checked when made, begun by :meth:`start`, advanced by :meth:`poll`.

    Parameters
    ----------
    cluster
        A :class:`rapydli.cluster.Cluster`; made usable by :meth:`start`, as part of the run
        (:func:`rapydli.cluster.ensure.ready`: started, waited for, or restarted if its engines died).
    spec
        What to train (:class:`~rapydli.experiments.spec.RunSpec`: the model, the data, the
        loss, the optimizer and the metrics, resolved and checked by the caller).
    config
        The run's :class:`TrainConfig` (already validated). Its layout must fit the
        targets (refused here, naming the ranks, before anything starts); the run is
        recorded and runs with ``workers`` set to the number of targets.
    targets
        Ranks of the cluster that run it (a communicator over exactly them).
    callbacks
        Called with every metric row from rank 0, every ``kind="rank"`` timing row of the
        other ranks and, in a pipelined run, every rank's ``kind="timeline"`` row of each
        step (:class:`~rapydli.parallel.timeline.EmitTimeline`), as they arrive (in the
        polling thread); and with a ``kind="straggler"`` row (``rank``, ``host``, ``text``,
        ...) when a rank is found persistently slower, a ``kind="hang"`` row (``step``,
        ``diagnosis``, ``action``) when no rank progressed for the hang timeout.
    progress
        Show a progress bar driven by rank 0's steps: ``True`` for ``tqdm.auto``'s, or a
        callable called like ``tqdm(total=, initial=, desc=, unit=)`` that returns the bar
        (the notebook front door passes one whose saved output is its final state).
    recording
        How the run is recorded in the store (:class:`Recording`).
    continues
        The earlier attempt this job goes on from after ranks died (:class:`Continuation`):
        its metrics go to that run instead of a new one.
    await_verdict
        A metric name (a sweep's): after each row carrying it, rank 0 waits until the
        callbacks have seen the row; then the job answers "go on" unless a callback asked to
        stop (:meth:`request_stop`), so every rank stops within one step of that decision.
    keep_open
        When the job fails because its ranks died, leave its run ``running`` in the store
        (the caller restarts it with ``continues=``) instead of recording it failed; its
        progress bar is left open too, for the restart to go on with (:attr:`progress_bar`).
    keep_model
        Keep the trained model: the ranks write it as it lies on them, each its pieces, to
        a directory (this one, or with ``True`` one of the run's own under
        ``$RAPYDLI_HOME/models``, named on the run as its ``model`` record), assembled only
        when asked (``result.model()``, ``rd.load``). False (sweep trials, scaling points,
        the planner's runs): nothing of the model is gathered or written.

    Attributes
    ----------
    state
        ``created`` until :meth:`start`, ``running``, then ``finished``, ``stopped`` (ended early on request) or ``failed``.
    rows
        Rank 0's metric rows received so far.
    rank_rows
        The other ranks' per-step timings (``kind="rank"``: ``rank``, ``step``, ``step_time_s``,
        ``data_time_s``, ``comm_time_s``, ``comm_wait_s``), also passed to the callbacks.
    error
        The failure text of a failed run.
    exception
        The :class:`RankFailure` of a failed run (None otherwise).
    results
        Per-rank dicts returned by :func:`~rapydli.trainer.task.engine_task` once finished.
    timelines
        A pipelined run's latest ``timeline`` row of every rank, by rank.
    start_step
        The step rank 0 started from (above 0 when it resumed from a checkpoint), once known.
    recovered_rows
        Rows of the steps before ``start_step`` that the earlier attempts never delivered,
        read from the checkpoint this job resumed from.
    progress_bar
        The progress bar (``None`` before the run starts or without ``progress``).
    stragglers
        The :class:`~rapydli.experiments.stragglers.StragglerWatch` of a data-parallel run
        (``None`` with pipeline stages or tensor slices): ``stragglers.found`` lists the ranks
        found persistently slower, also the run's ``stragglers`` record.
    model_dir
        Where the ranks write the trained model (``None`` without ``keep_model``).
    setup_s
        Seconds before the first step, by phase in the order they ran (engines ready, code
        shipped and task started, model and data, the Trainer's set-up); complete once the
        run started; also the run's ``setup_s`` record (``[phase, seconds]`` pairs) and, with
        ``progress``, a line above the bar.
    """

    def __init__(
        self,
        cluster: Cluster,
        spec: RunSpec,
        config: TrainConfig,
        targets: Sequence[int],
        *,
        callbacks: Sequence[Callable[[dict[str, Any]], None]] = (),
        progress: bool | Callable[..., Any] = False,
        recording: Recording | None = None,
        continues: Continuation | None = None,
        keep_open: bool = False,
        await_verdict: str | None = None,
        keep_model: str | bool = False,
    ) -> None:
        from rapydli.experiments.store.runstore import open_store

        # refused before anything starts: ranks = replicas x stages x tensor
        where = "the cluster" if len(targets) == cluster.n else "this run's engine group"
        self.layout = Layout.of(config, len(targets), where=where)
        config = config.replace(workers=len(targets))  # what really runs is what is recorded
        self.spec = spec
        if (
            self.layout.uses_pipeline or self.layout.uses_tensor_parallel
        ):  # the layout against the model (built shape-only): own loss, split, ties, plan
            from rapydli.parallel.preflight import check_layout

            check_layout(spec.model_fn, config, spec.loss_fn, layout=self.layout)
        if config.memory_per_rank is not None:  # the model states each rank would hold, predicted on the meta device
            from rapydli.experiments.planning.fit import check_fits

            check_fits(spec.model_fn, config, len(targets))
        self.config = config
        self.targets = list(targets)
        self.callbacks = tuple(callbacks)
        # a rank slower than the others, by its step timings (data-parallel ranks only: stages and slices differ by design)
        same_work = not (self.layout.uses_pipeline or self.layout.uses_tensor_parallel)
        self.stragglers = StragglerWatch(len(self.targets), {}) if same_work else None
        self._place(cluster)  # refused now (shm across hosts) where the cluster already knows its hosts
        self.cluster = cluster
        self.rows: list[dict[str, Any]] = []
        self.rank_rows: list[dict[str, Any]] = []
        self.results: list[dict[str, Any]] = []
        self.timelines: dict[int, dict[str, Any]] = {}
        self.state = "created"
        self.error = ""
        self.exception: RankFailure | None = None
        self.progress = progress
        self._bar: Any = continues.bar if continues is not None else None
        self._delivered = set(continues.delivered) if continues is not None else set()
        self.recovered_rows: list[dict[str, Any]] = []
        self.stop_requested_at: float | None = None
        self._interrupt_at: float | None = None  # when an unanswered stop request escalates
        self._escalated = False
        self._stop_status: str | None = None
        self.started: float | None = None
        self.ended: float | None = None
        self.recording = recording = recording or Recording()
        self.store = open_store() if recording.store else None
        self.run_id: str | None = continues.run_id if continues is not None else None
        self.continues = self.run_id
        self.keep_open = keep_open
        self.await_verdict, self.end_status = await_verdict, recording.end_status
        self._verdict_step: Any = None  # the step of the last row rank 0 was told to go on past
        self.start_step: int | None = None
        self.setup_s: dict[str, float] = {}
        self._submitted = time.monotonic()
        self.trackers: RunTrackers | None = None
        self.record = recording.store
        self.job: Any = None
        self._keep_model = keep_model
        self.model_dir: str | None = None

    def start(self) -> TrainingJob:
        """Record the run, make the cluster usable and submit the task to the ranks; returns the job.

        Nothing starts before this (the constructor only checks and holds what it was given):
        the run is created in the store, its trackers follow it, the cluster is started, waited
        for or restarted (:func:`rapydli.cluster.ensure.ready`) and the engine task is sent.
        Ctrl-C meanwhile records the run as interrupted; a failure records it as failed.
        """
        from rapydli.cluster.ensure import ready

        if self.state != "created":
            raise RuntimeError(f"this TrainingJob was already started (state {self.state!r})")
        cluster, config, spec, continues = self.cluster, self.config, self.spec, self.continues
        self.state, self.started = "running", time.monotonic()
        hosts, rank_hosts = self._place(cluster)  # known now unless the cluster starts as part of the run
        if self.store is not None and continues is None:
            described = spec.params()
            params = {
                "model_fn": described.pop("model_fn"),
                "data_fn": described.pop("data_fn"),
                "config": config.to_dict(),
                "targets": self.targets,
                **described,
                **self.recording.extra_params,
            }
            run_name = self.recording.name or spec.name
            self.run_id = self.store.create_run(
                self.recording.kind,
                run_name,
                params,
                parent=self.recording.parent,
                world_size=len(self.targets),
                seed=config.seed,
            )
            self.store.add_record(self.run_id, "hosts", "json", hosts)  # where this run's ranks run
            self.store.add_record(
                self.run_id, "rank_hosts", "json", [rank_hosts.get(t) for t in self.targets]
            )  # by job rank
        self.trackers = (
            follow(self.store, self.run_id, config.trackers) if self.record else None
        )  # the client logs to MLflow & co. from the store
        self.model_dir = self._model_directory()
        try:
            began = time.monotonic()
            ready(cluster)  # started, waited for or restarted as part of the run (rd.train's own cluster too)
            self.setup_s["engines ready"] = time.monotonic() - began
            if any(t not in rank_hosts for t in self.targets):  # engines that came up just now: where they run
                hosts, rank_hosts = self._place(cluster)
                if self.store is not None and self.run_id is not None and continues is None:
                    self.store.add_record(self.run_id, "hosts", "json", hosts)
                    self.store.add_record(self.run_id, "rank_hosts", "json", [rank_hosts.get(t) for t in self.targets])
            if self.progress:  # the ranks now build model and Trainer: say so before the bar appears
                from tqdm.auto import tqdm

                importing = "importing torch, then " if getattr(cluster, "warming", False) else ""
                tqdm.write(
                    f"set-up: engines ready ({self.setup_s['engines ready']:.1f} s); "
                    f"{importing}building the model and the Trainer on {len(self.targets)} ranks ..."
                )
            self._submitted = time.monotonic()
            self.job = cluster.submit(
                engine_task,
                spec.model_fn,
                spec.data_fn,
                {**config.to_dict(), "trackers": ""},
                targets=self.targets,
                on_event=self._on_event,
                hang_timeout_s=config.hang_timeout_s,
                on_hang=config.on_hang,
                await_verdict=self.await_verdict,
                layout=self.layout,
                model_dir=self.model_dir,
                **spec.code,
            )
        except KeyboardInterrupt:
            __tracebackhide__ = True  # noqa: F841 - IPython shows the user's cell, not ipyparallel's frames
            self._finish("stopped", "interrupted by the user while the run was being set up")
            raise KeyboardInterrupt(
                f"Ctrl-C while the run was being set up; run {self.run_id} recorded as interrupted"
            ) from None
        except BaseException as exc:
            self._finish("failed", f"{type(exc).__name__}: {exc}")
            raise
        return self

    def _model_directory(self) -> str | None:
        """Where the ranks write the trained model (``keep_model``), recorded on the run; ``None``: nowhere."""
        if not self._keep_model:
            return None
        if isinstance(self._keep_model, str):
            directory = self._keep_model
        else:
            import uuid

            from rapydli.paths import subdir

            directory = str(subdir("models") / (self.run_id or uuid.uuid4().hex[:12]))
        if self.store is not None and self.run_id is not None and self.continues is None:
            self.store.add_record(self.run_id, "model", "json", {"directory": directory})
        return directory

    def _place(self, cluster: Any) -> tuple[list[str], dict[int, str]]:
        """Where the run's ranks run, as far as the cluster knows now: the sorted hosts and rank -> host.

        Refuses ``allreduce="shm"`` over more than one host, and names each rank's host in the
        straggler report. A cluster that starts as part of the run knows its hosts only once
        its engines are ready, so this runs again then.
        """
        rank_hosts = cluster.status()["rank_hosts"]
        hosts = sorted({host for rank, host in rank_hosts.items() if rank in self.targets})
        if self.config.allreduce == "shm" and len(hosts) > 1:
            raise ConfigError(
                f"TrainConfig.allreduce='shm' needs every rank on one node; these ranks run on {', '.join(hosts)}: "
                "use 'auto', 'mpi' or 'ring'"
            )
        if self.stragglers is not None:
            self.stragglers.hosts = {i: rank_hosts.get(t, "?") for i, t in enumerate(self.targets)}
        return hosts, rank_hosts

    def _on_event(self, rank: int, kind: str, payload: Any) -> None:
        if kind == "hang":  # the Job printed the diagnosis; the store keeps it with the run, the live plot shows it
            if self.store is not None and self.run_id is not None:
                self.store.add_record(self.run_id, "hang", "json", payload)
            steps = [row["step"] for row in self.rows if row.get("kind") == "train"]
            for callback in self.callbacks:
                callback({"kind": "hang", "step": steps[-1] if steps else 0, **payload})
            return
        if kind == "awaiting":  # rank 0 still waits on the row it reported: the answer, or the report itself, was lost
            if self.stop_requested_at is None:
                row = payload.get("row")
                if row is not None and not self._received(row):
                    self._on_event(
                        rank, "metrics", row
                    )  # the report never arrived (rank 0 sent it first): decide on it now
                else:
                    self.job.go_on(self.targets[:1])
            return
        if kind == "start":
            self.start_step = payload["start_step"]
            self._recover(payload.get("history", []))
            self._set_up(payload.get("setup_s", {}))
            self._model_built(payload.get("model_built"))
        if kind == "start" and self._bar is not None:  # a restart goes on with the bar of the attempt that died
            self._bar.reset(total=payload["total_steps"])
            self._bar.update(payload["start_step"])
            self._bar.set_description(f"train (restarted at step {payload['start_step']})")
            return
        if kind == "start" and self.progress:
            from tqdm.auto import tqdm

            make = self.progress if callable(self.progress) else tqdm
            self._bar = make(total=payload["total_steps"], initial=payload["start_step"], desc="train", unit="step")
            return
        if kind == "rank_timings":  # other ranks' step timings: to the callbacks and the store, not the history
            self.rank_rows.append(payload)
            self._watch_stragglers(payload)
            if self.store is not None and self.run_id is not None:  # stored as e.g. step_time_s@rank1
                self.store.log_metrics(
                    self.run_id, [(s, f"{n}@rank{payload['rank']}", v) for s, n, v in _metric_rows(payload)]
                )
            for callback in self.callbacks:
                callback(dict(payload))
            return
        if kind == "timeline":  # a pipelined run: a step's spans on this rank (to the callbacks: the live timeline)
            self.timelines[rank] = payload
            for callback in self.callbacks:
                callback({"kind": "timeline", **payload})
            return
        if kind != "metrics":
            return
        self.rows.append(payload)
        self._watch_stragglers(payload)
        if payload.get("kind") == "train" and self._bar is not None:
            self._bar.update(payload["step"] - self._bar.n)
            self._bar.set_postfix(loss=f"{payload['loss']:.4g}", refresh=False)
        self._store_row(payload)
        for callback in self.callbacks:
            callback(dict(payload))
        value = payload.get(self.await_verdict) if self.await_verdict is not None else None
        if isinstance(value, (int, float)) and self.stop_requested_at is None:  # rank 0 waits for this answer
            self._verdict_step = payload.get("step")
            self.job.go_on(self.targets[:1])

    def _deliver_late(self, history: list[dict[str, Any]]) -> None:
        """Store and pass on the rows of rank 0's final ``history`` that no event delivered.

        The rows stream as events and the result comes back apart from them; on a loaded
        machine the result can arrive while the last events are still on their way (the
        job waits for them only briefly), and the store, the callbacks and the history
        would then tell different stories.
        """
        seen = {(r.get("kind"), r.get("step")) for r in [*self.rows, *self.recovered_rows]} | self._delivered
        for row in history:
            if row.get("kind") in ("train", "eval") and (row.get("kind"), row.get("step")) not in seen:
                self.rows.append(row)
                self._store_row(row)
                for callback in self.callbacks:
                    callback(dict(row))

    def _received(self, row: dict[str, Any]) -> bool:
        """Whether a row of ``row``'s kind and step already came in."""
        return any(r.get("kind") == row.get("kind") and r.get("step") == row.get("step") for r in self.rows)

    def _watch_stragglers(self, row: dict[str, Any]) -> None:
        """Feed a timing row to the straggler watch; a rank found slower is recorded and, with ``progress``, said once."""
        found = self.stragglers.add(row) if self.stragglers is not None else None
        if found is None:
            return
        if self.store is not None and self.run_id is not None:
            self.store.add_record(self.run_id, "stragglers", "json", [s.as_dict() for s in self.stragglers.found])  # type: ignore[union-attr]
        for callback in self.callbacks:  # the live plot marks the rank
            callback({"kind": "straggler", **found.as_dict()})
        if self.progress:
            from tqdm.auto import tqdm

            tqdm.write(found.text())

    def _set_up(self, on_rank0: dict[str, float]) -> None:
        """Record where the time before the first step went, and print it above the bar (the bar's rate is training's alone)."""
        shipped = time.monotonic() - self._submitted - sum(on_rank0.values())
        self.setup_s.update({TASK_STARTED: max(0.0, shipped), **on_rank0})
        if self.store is not None and self.run_id is not None:
            self.store.add_record(
                self.run_id, "setup_s", "json", list(self.setup_s.items())
            )  # pairs: the store sorts a mapping's keys
        if self.progress:
            from tqdm.auto import tqdm

            from rapydli.experiments.store.runview import setup_text

            tqdm.write(setup_text(self.setup_s))

    def _model_built(self, built: str | None) -> None:
        """Record how the ranks made the model (``"whole"``, ``"deferred"``, or ``"whole: <why it could not be recorded>"``); say the last."""
        if built is None:
            return
        if self.store is not None and self.run_id is not None:
            self.store.add_record(self.run_id, "model_built", "json", built)
        if built.startswith("whole: "):
            from tqdm.auto import tqdm

            tqdm.write(f"the layout splits the model, but every rank built it whole: {built.removeprefix('whole: ')}")

    def _recover(self, history: list[dict[str, Any]]) -> None:
        """Record and pass on the checkpoint's rows the earlier attempts never delivered (only when continuing a run)."""
        if self.continues is None:
            return
        self.recovered_rows = [row for row in history if (row.get("kind"), row.get("step")) not in self._delivered]
        for row in self.recovered_rows:
            self._store_row(row)
            for callback in self.callbacks:
                callback(dict(row))

    def _store_row(self, row: dict[str, Any]) -> None:
        if self.store is not None and self.run_id is not None:  # a rank's own loss is a per-rank series even on rank 0
            rank = row.get("rank", 0)
            self.store.log_metrics(
                self.run_id, [(s, f"{n}@rank{rank}" if n in _RANK_OWN else n, v) for s, n, v in _metric_rows(row)]
            )

    @property
    def progress_bar(self) -> Any:
        return self._bar

    # -- driving ----------------------------------------------------------------------------
    def poll(self, wait_s: float = 0.0) -> bool:
        """Advance the job (stream its rows); True once it has ended.

        A stop request that has not ended the run within its grace (:meth:`request_stop`)
        escalates, once, to :meth:`interrupt`; a run ended so is ``stopped``, not ``failed``.
        """
        if self.state == "created":
            raise RuntimeError("poll() before start(): this TrainingJob has not started")
        if self.state != "running":
            return True
        if self._interrupt_at is not None and not self._escalated and time.monotonic() > self._interrupt_at:
            self._escalated = True
            self.interrupt()
        try:
            done = self.job.poll(wait_s)
        except Exception:
            self._finish("failed", traceback.format_exc(limit=3))
            raise
        if done:
            try:
                self.results = self.job.result()
            except RankFailure as exc:
                if self._escalated and all(
                    r.status in ("ok", "interrupted", "aborted") for r in self.job.ranks.values()
                ):
                    self._finish(
                        "stopped",
                        f"did not stop when asked; interrupted: {self.job.interrupt_summary().removeprefix('Ctrl-C: ')}",
                    )
                else:
                    self.exception = exc  # the same mistake in the user's code on every rank is recorded once
                    self._finish("failed", str(same_mistake(exc) or exc))
            else:
                self._deliver_late(self.results[0].get("history") or [] if self.results else [])
                stopped = any(r.get("stopped_early") for r in self.results)
                self._finish("stopped" if stopped else "finished")
        return self.state != "running"

    def wait(self, poll_s: float = 0.05, until: Callable[[TrainingJob], bool] | None = None) -> TrainingJob:
        """Poll until the run ends (or, with ``until``, until ``until(self)`` is True); returns ``self``.

        Ctrl-C interrupts every rank (blocked ones are aborted), records the run as
        interrupted, and re-raises ``KeyboardInterrupt``.
        """
        __tracebackhide__ = True  # noqa: F841 - IPython shows the user's cell, not these frames
        try:
            while not self.poll(poll_s):
                if until is not None and until(self):
                    break
        except KeyboardInterrupt:
            self.job.cancel()
            self._finish("stopped", "interrupted by the user")
            raise KeyboardInterrupt(
                f"{self.job.interrupt_summary()}; run {self.run_id} recorded as interrupted"
            ) from None
        return self

    def request_stop(self, status: str | None = None, grace_s: float = STOP_GRACE_S) -> None:
        """Ask every rank to stop after its current step (cooperative, see ``Job.request_stop``).

        A run that has not ended ``grace_s`` seconds later is interrupted by :meth:`poll`
        (ranks busy in a long step, or code that never asks ``should_stop``). ``status``
        is what the store records when the run then ends without failing (a sweep passes
        ``"pruned"``); by default ``interrupted`` if it stopped early, else ``finished``.
        The first request sets the status; a later one can only shorten the grace.
        """
        if self.state != "running":
            return
        now = time.monotonic()
        self._interrupt_at = min(self._interrupt_at if self._interrupt_at is not None else math.inf, now + grace_s)
        if self.stop_requested_at is None:
            self.stop_requested_at = now
            self._stop_status = status
            self.job.request_stop()

    def interrupt(self) -> None:
        """Interrupt the ranks now (SIGINT; blocked ones are aborted after the grace period)."""
        if self.state == "running":
            self.job.interrupt()

    def _finish(self, state: str, error: str = "") -> None:
        self.state, self.error, self.ended = state, error, time.monotonic()
        died = self.exception is not None and self.exception.died
        if self._bar is not None and not (self.keep_open and died):  # a run that will restart keeps its bar going
            self._bar.close()
        if (
            self.store is not None
            and self.run_id is not None
            and (self.end_status or self.job is None)
            and not (self.keep_open and died)
        ):
            status = {"finished": "finished", "stopped": "interrupted", "failed": "failed"}[state]
            if state != "failed" and self._stop_status is not None:
                status = self._stop_status
            self.store.finish_run(
                self.run_id, status, error or ("stopped on request" if status == "interrupted" else None)
            )
        if self.end_status or self.job is None:  # else the owner writes the status, then calls close_trackers()
            self.close_trackers()

    def close_trackers(self) -> None:
        """Let the trackers log the run as the store now has it (its final status too) and close them; idempotent."""
        if self.trackers is not None:
            self.trackers.close()
            self.trackers = None

    # -- what it produced ---------------------------------------------------------------------
    @property
    def history(self) -> pd.DataFrame:
        """Rank 0's rows (received so far, or the full history once finished) as a DataFrame."""
        import pandas as pd

        if self.results and self.results[0].get("history"):
            return pd.DataFrame(self.results[0]["history"])
        return pd.DataFrame(self.rows)

    def final_metrics(self) -> dict[str, float]:
        """Last value of every numeric metric seen (loss, val_loss, val_accuracy, ...), and steps done."""
        final: dict[str, float] = {}
        rows = self.results[0]["history"] if self.results and self.results[0].get("history") else self.rows
        for row in rows:
            for name, step, value in ((n, row["step"], v) for n, v in row.items()):
                if name not in _NUMERIC_SKIP and isinstance(value, (int, float)) and not isinstance(value, bool):
                    final[name] = value
                    if row.get("kind") == "train":
                        final["steps"] = step
        return final

    @property
    def duration_s(self) -> float:
        """Seconds since :meth:`start` (until the end once ended; 0 before it)."""
        return 0.0 if self.started is None else (self.ended or time.monotonic()) - self.started


_NUMERIC_SKIP = {"kind", "step", "rank", "world_size", "epoch", "time_s"}
#: Metrics of one rank's share of the batch: stored as ``name@rankK`` for every rank, rank 0 too, so the
#: plain names (what the panel, compare and the trackers plot) are the run's, the global batch's.
_RANK_OWN = {"rank_loss"}


def _metric_rows(row: dict[str, Any]) -> list[tuple[int, str, float]]:
    return [
        (row["step"], name, value)
        for name, value in row.items()
        if name not in _NUMERIC_SKIP and isinstance(value, (int, float)) and not isinstance(value, bool)
    ]

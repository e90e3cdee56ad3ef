"""How ``rd.train`` goes on after ranks die: its restart policy.

A :class:`RestartPolicy` holds what the user allowed (how many restarts, the fewest engines
a run may go on with) and the checkpoint directory the restarts resume from, all checked
before anything starts (:meth:`RestartPolicy.of`). :meth:`RestartPolicy.train` runs the
:class:`~rapydli.experiments.job.TrainingJob` and, each time ranks die while restarts are
left, brings the engines back (all of them, or at least ``min_workers``), resumes the same
run from its last complete checkpoint and records the restart: on the run (store record
``restarts``: time, cause, ranks, step resumed from, workers) and to the callbacks (a
``kind="restart"`` row, the live plot's marker). An exception raised in the user's code is
never retried. :func:`rapydli.experiments.run.run_training` composes it with the cluster
choice and the result.

Examples
--------
>>> policy, config = RestartPolicy.of(TrainConfig(checkpoint_every=10), restarts=2, min_workers=1)  # doctest: +SKIP
>>> attempts = policy.train(cluster, spec, config, name="run")  # doctest: +SKIP
>>> attempts.restarted[0]["resumed_from_step"]  # doctest: +SKIP
10
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rapydli.errors import ConfigError, RankFailure
from rapydli.trainer.config import TrainConfig

if TYPE_CHECKING:  # pragma: no cover
    from rapydli.cluster import Cluster
    from rapydli.experiments.job import TrainingJob
    from rapydli.experiments.spec import RunSpec


@dataclass
class Attempts:
    """What a run trained over its attempts: the last :class:`TrainingJob`, its rows and its restarts.

    Attributes
    ----------
    job
        The last attempt (the first one when nothing died); its ``exception`` is the run's.
    history
        Every metrics row delivered, each step once: an attempt's rows up to the step the
        next one resumed from, then the next one's.
    restarted
        One dict per restart: ``time``, ``cause``, ``ranks``, ``resumed_from_step``, ``workers``
        (the ranks it went on with) and ``recovery_s`` (seconds from the failure seen to the
        resumed run's first step under way).
    """

    job: TrainingJob
    history: list[dict[str, Any]]
    restarted: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True)
class RestartPolicy:
    """How many times a run goes on after ranks die, on how few engines, from which checkpoints.

    Attributes
    ----------
    restarts
        Restarts allowed (``>= 0``).
    min_workers
        The fewest engines a restart may go on with (``None``: all of them).
    scratch
        The checkpoint directory made for the restarts when the config named none (under
        ``$RAPYDLI_HOME/checkpoints``); removed by :meth:`clean_up` once the run finished.
    """

    restarts: int
    min_workers: int | None = None
    scratch: Path | None = None

    @classmethod
    def of(
        cls, config: TrainConfig, restarts: int | None = None, min_workers: int | None = None
    ) -> tuple[RestartPolicy, TrainConfig]:
        """The policy ``rd.train``'s arguments ask for, checked, and the config the run trains with.

        ``restarts`` defaults to ``config.max_restarts`` and ``min_workers`` to
        ``config.min_workers``. A run that may restart and names no ``checkpoint_dir``
        gets a scratch one. Raises :class:`ConfigError` for a count that is not an integer
        ``>= 0``.
        """
        left = config.max_restarts if restarts is None else restarts
        if not isinstance(left, int) or isinstance(left, bool) or left < 0:
            raise ConfigError(f"restarts={restarts!r} is invalid: an integer >= 0")
        if min_workers is not None:
            config = config.replace(min_workers=min_workers)
        scratch = None
        if left and config.checkpoint_dir is None:
            import uuid

            from rapydli.paths import subdir

            scratch = subdir("checkpoints") / uuid.uuid4().hex[:12]
            config = config.replace(checkpoint_dir=str(scratch))
        return cls(left, config.min_workers, scratch), config

    def check(self, engines: int) -> None:
        """Refuse, before anything starts, a ``min_workers`` larger than the ``engines`` the run uses."""
        if self.min_workers is not None and self.min_workers > engines:
            raise ConfigError(
                f"min_workers={self.min_workers} is invalid: the cluster has {engines} engines, allowed 1..{engines}"
            )

    def train(
        self,
        cluster: Cluster,
        spec: RunSpec,
        config: TrainConfig,
        *,
        callbacks: Sequence[Callable[[dict[str, Any]], None]] = (),
        name: str | None = None,
        progress: bool | Callable[..., Any] = True,
    ) -> Attempts:
        """Train on every engine of ``cluster`` and go on after ranks die while restarts are left; the attempts.

        A restart that cannot go on (the engines do not come back, Ctrl-C meanwhile) ends
        the run as ``failed`` (``interrupted``) with the attempt recorded, and raises.
        """
        __tracebackhide__ = True  # noqa: F841 - IPython shows the user's cell, not these frames
        from rapydli.experiments.job import Continuation, Recording, TrainingJob

        left = self.restarts
        job = (
            TrainingJob(
                cluster,
                spec,
                config,
                range(cluster.n),
                callbacks=callbacks,
                recording=Recording(name=name),
                progress=progress,
                keep_open=left > 0,
                keep_model=True,
            )
            .start()
            .wait()
        )
        attempts = Attempts(job, list(job.rows))
        while job.exception is not None and job.exception.died and left > 0:
            left -= 1
            seen = time.time()
            restart = {"time": seen, "cause": str(job.exception).splitlines()[0], "ranks": job.exception.ranks}
            try:
                targets = self._bring_back(cluster, config, job.exception)
                delivered = [(row.get("kind"), row["step"]) for row in attempts.history]
                job = TrainingJob(
                    cluster,
                    spec,
                    config.replace(resume=True),
                    targets,
                    callbacks=callbacks,
                    recording=Recording(name=name),
                    progress=progress,
                    continues=Continuation(job.run_id, delivered, job.progress_bar),
                    keep_open=left > 0,
                    keep_model=job.model_dir or False,
                ).start()
            except BaseException as exc:
                if job.progress_bar is not None:  # no restart: the bar ends where the run did
                    job.progress_bar.close()
                _record_failed_restart(job, [*attempts.restarted, {**restart, "error": str(exc)}], exc)
                raise
            job.wait(
                until=lambda resumed: resumed.start_step is not None
            )  # marked as soon as it resumed, not when it ends
            attempts.restarted.append(
                {**restart, "resumed_from_step": job.start_step, "workers": len(targets),
                 "recovery_s": round(time.time() - seen, 2)}  # from the failure seen to training again
            )  # fmt: skip
            _record_restarts(job, attempts.restarted, callbacks)
            job.wait()
            before = [
                row for row in attempts.history if job.start_step is None or row["step"] <= job.start_step
            ] + job.recovered_rows
            attempts.history = sorted(before, key=lambda row: row["step"]) + job.rows
            attempts.job = job
        return attempts

    def clean_up(self) -> None:
        """Remove the scratch checkpoint directory (a finished run no longer needs it)."""
        if self.scratch is not None:
            import shutil

            shutil.rmtree(self.scratch, ignore_errors=True)

    def _bring_back(self, cluster: Cluster, config: TrainConfig, failure: RankFailure) -> list[int]:
        """Bring the cluster's engines back after ``failure``; the ranks the run goes on with.

        All of them, or, with ``min_workers``, as many as the cluster can bring back if that
        is enough (:meth:`rapydli.cluster.Cluster.restart`).
        """
        from rapydli.errors import ClusterError

        where = last_checkpoint_text(config)
        size = cluster.n
        try:
            cluster.restart(min_engines=self.min_workers)
        except ClusterError as exc:
            raise ClusterError(
                f"ranks {failure.ranks} died and the cluster could not be restarted: {exc}; {where}"
            ) from exc
        alive = cluster.alive_ranks()
        needed = self.min_workers or size
        if len(alive) < needed:
            raise ClusterError(
                f"only {len(alive)} of {size} engines came back after ranks {failure.ranks} died (need {needed}); {where}"
            )
        return alive


def last_checkpoint_text(config: TrainConfig) -> str:
    """Where a run that cannot go on can be continued from: its last complete checkpoint, or that it has none."""
    from rapydli.trainer import checkpoint as ckpt

    if config.checkpoint_dir is None:
        return "the run kept no checkpoint (TrainConfig.checkpoint_dir was not set)"
    path = ckpt.checkpoint_path(config.checkpoint_dir)
    if not path.exists():
        return f"no checkpoint was complete in {config.checkpoint_dir} before the ranks died"
    return (
        f"the last checkpoint is in {config.checkpoint_dir} (rd.train(..., TrainConfig(resume=True, ...)) continues it)"
    )


def _record_failed_restart(job: TrainingJob, restarted: list[dict[str, Any]], error: BaseException) -> None:
    """A restart that could not go on ends the run: ``failed`` (``interrupted`` on Ctrl-C) with the error, and the attempt recorded."""
    if job.store is None or job.run_id is None:
        return
    job.store.add_record(job.run_id, "restarts", "json", restarted)
    if isinstance(error, KeyboardInterrupt):
        job.store.finish_run(job.run_id, "interrupted", "interrupted by the user while the cluster restarted")
    else:
        job.store.finish_run(job.run_id, "failed", f"{type(error).__name__}: {error}")


def _record_restarts(
    job: TrainingJob, restarted: list[dict[str, Any]], callbacks: Sequence[Callable[[dict[str, Any]], None]]
) -> None:
    """The restarts so far on the run (store record ``restarts``) and to the callbacks (a marker in the live plot)."""
    if job.store is not None and job.run_id is not None:
        job.store.add_record(job.run_id, "restarts", "json", restarted)
    latest = restarted[-1]
    for callback in callbacks:
        callback(
            {
                "kind": "restart",
                "step": latest["resumed_from_step"] or 0,
                "cause": latest["cause"],
                "ranks": latest["ranks"],
                "workers": latest.get("workers"),
                "recovery_s": latest.get("recovery_s"),
            }
        )

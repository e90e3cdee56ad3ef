"""``rapydli bench recovery``: from a rank killed mid-run to training again, and the steps done twice.

Each round trains a small MLP on the digits on ``n`` local engines with ``restarts=1`` and a
checkpoint every ``--checkpoint-every`` steps; at its ``--kill-at``-th forward, rank 1 notes
the time and SIGKILLs itself, as an OOM kill or a crash does. Measured per round:

* ``kill_to_step_s``: from the kill to the first step of the resumed run that reached the
  notebook (the run's row: every rank has finished it);
* ``kill_to_noticed_s``: from the kill to the run failing in the notebook (a rank died);
* ``recovery_s``: the run's own record, from noticing to the resumed run's first step under way;
* ``steps_redone``: steps done again, since the last complete checkpoint.

Today's path is the only one: the cluster restarts every engine, the task is shipped again
and the ranks resume from the checkpoint (:mod:`rapydli.experiments.restarts`). Survivors
that go on without restarting (issue 48's shrink-and-continue) are not built yet; the
summary says so, and this benchmark is the baseline they will be set against in the same run.
"""

from __future__ import annotations

import os
import signal
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from rapydli.bench.report import emit

#: The issue's goal for data parallelism, kill to training again.
GOAL_S = 2.0


@dataclass(frozen=True)
class KilledAt:
    """``model_fn``: the zoo's MLP; on rank 1 its ``at_call``-th forward writes the time to ``marker`` and
    SIGKILLs the rank (once: a marker there means done)."""

    marker: str
    at_call: int

    def __call__(self) -> Any:
        from rapydli.cluster.engine import context
        from rapydli.zoo.models import mlp

        model = mlp()
        calls = [0]
        marker, at_call = Path(self.marker), self.at_call

        def kill(module: Any, args: Any) -> None:
            calls[0] += 1
            if context().rank == 1 and calls[0] == at_call and not marker.exists():
                marker.write_text(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)

        model.register_forward_pre_hook(kill)
        return model


def one_round(cluster: Any, directory: Path, kill_at: int, checkpoint_every: int, steps: int) -> dict[str, Any]:
    """One run killed at ``kill_at`` and restarted; its row of measurements."""
    from rapydli.experiments.store.runstore import require_store
    from rapydli.notebook import train
    from rapydli.trainer.config import TrainConfig

    marker = directory / "killed"
    seen: list[tuple[float, dict[str, Any]]] = []
    config = TrainConfig(max_steps=steps, batch_size=32, allreduce="mpi", eval_every=0,
                            checkpoint_every=checkpoint_every, checkpoint_dir=str(directory / "ckpt"))  # fmt: skip
    result = train(
        KilledAt(str(marker), kill_at),
        "rapydli.zoo.datasets:digits",
        config,
        cluster=cluster,
        restarts=1,
        callbacks=[lambda row: seen.append((time.time(), row))],
        progress=False,
        live=False,
    )
    killed = float(marker.read_text())
    (restart,) = require_store().records(str(result.run_id))["restarts"]["value"]
    resumed = restart["resumed_from_step"] or 0
    first = next(t for t, row in seen if row.get("kind") == "train" and row["step"] == resumed + 1 and t > killed)
    return {
        "ranks": cluster.n,
        "kill_at_step": kill_at,
        "resumed_from_step": resumed,
        "steps_redone": kill_at - 1 - resumed,
        "kill_to_noticed_s": restart["time"] - killed,
        "recovery_s": restart.get("recovery_s"),
        "kill_to_step_s": first - killed,
    }


@click.command()
@click.option("-n", "--engines", "n", default=2, show_default=True, help="local engines (ranks)")
@click.option("--repeat", default=3, show_default=True, help="killed runs")
@click.option("--kill-at", default=7, show_default=True, help="the step whose forward rank 1 dies in")
@click.option("--checkpoint-every", default=4, show_default=True, help="steps between checkpoints")
@click.option("--steps", default=12, show_default=True, help="steps of each run")
@click.option("--json", "json_path", default=None, help="write the results as JSON to this path")
def command(n: int, repeat: int, kill_at: int, checkpoint_every: int, steps: int, json_path: str | None) -> None:
    """A rank killed mid-run: seconds from the kill to training again, and the steps redone (restarts=1)."""
    from rapydli.cluster import Cluster
    from rapydli.spread import Spread, machine_load

    if n < 2:
        raise click.BadParameter("needs 2 or more engines: rank 1 is killed", param_hint="-n")
    if not 1 < kill_at <= steps:
        raise click.BadParameter(f"must be 2..{steps} (--steps)", param_hint="--kill-at")
    rows = []
    with Cluster(n=n) as cluster, tempfile.TemporaryDirectory(prefix="rapydli-bench-recovery-") as scratch:
        for number in range(repeat):
            directory = Path(scratch) / str(number)
            directory.mkdir()
            rows.append({"round": number + 1, **one_round(cluster, directory, kill_at, checkpoint_every, steps)})
    spread = Spread.of([row["kill_to_step_s"] for row in rows])
    summary = {
        "today (restarts=1): kill to training again, median s": spread.median,
        "today: range over the rounds, s": f"{spread.low:.2f} - {spread.high:.2f} (n={spread.n})",
        "today: steps done twice, median": Spread.of([row["steps_redone"] for row in rows]).median,
        f"goal <= {GOAL_S:g} s (survivors go on)": "not built yet: the survivors restart with every rank (issue 48)",
        "load": f"{machine_load()['load_1m']:.1f} on {os.cpu_count()} cores",
    }
    emit("recovery", rows, summary, json_path)

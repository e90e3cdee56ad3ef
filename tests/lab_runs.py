"""Real runs for the browser tests, made in a process of their own (``python tests/lab_runs.py``)
with ``RAPYDLI_HOME`` pointing at the test's store: two training runs that differ in
``lr`` on a 2-engine cluster, whose model is defined here (so, as for a notebook's, its
source is recorded), and a sweep whose diverging trial is pruned. Prints the run ids as JSON."""

from __future__ import annotations

import json

import rapydli as rd
from rapydli.zoo import datasets, models


def digits_mlp() -> object:
    """The zoo's MLP for digits, defined in __main__ as a notebook cell would define it."""
    model = models.mlp()
    return model


def main() -> dict[str, object]:
    ids: dict[str, object] = {}
    with rd.Cluster(n=2) as cluster:
        for key, lr in (("train_a", 0.1), ("train_b", 0.03)):
            config = rd.TrainConfig(max_steps=12, eval_every=6, batch_size=32, lr=lr, allreduce="mpi")
            ids[key] = rd.train(
                digits_mlp, datasets.digits, config, cluster=cluster, progress=False, live=False, name="mlp_digits"
            ).run_id
        config = rd.TrainConfig(max_steps=20, eval_every=5, batch_size=32, allreduce="mpi")
        enqueue = [{"lr": 0.05}, {"lr": 0.02}, {"lr": 9.0}]  # the last diverges: pruned at its first report
        result = rd.sweep(
            models.mlp,
            datasets.digits,
            config,
            {"lr": rd.loguniform(1e-3, 10.0)},
            trials=3,
            cluster=cluster,
            enqueue=enqueue,
            live=False,
            parallel=1,
        )
        ids["sweep"] = result.run_id
        ids["trial_states"] = list(result.table["state"])
    return ids


if __name__ == "__main__":
    print(json.dumps(main()))

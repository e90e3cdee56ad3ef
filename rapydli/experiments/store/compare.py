"""Runs side by side: the parameters that differ and the final metrics.

One definition of "what differs", used by ``rapydli runs compare`` and by the REST
API's ``runs/compare`` (the panel's compare view): parameters are flattened to dotted
keys (``config.lr``) and a key differs when its JSON text is not the same in every run
(a key missing from a run counts as a difference).

Examples
--------
>>> flatten({"lr": 0.1, "config": {"epochs": 3, "opt": {"name": "sgd"}}})
{'lr': 0.1, 'config.epochs': 3, 'config.opt.name': 'sgd'}
>>> param_diff({"a": {"lr": 0.1, "seed": 0}, "b": {"lr": 0.2, "seed": 0}})
['lr']
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from rapydli.errors import ConfigError

#: Most runs one comparison takes (the panel overlays their curves).
MAX_COMPARE = 10


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts as one dict of dotted keys; lists and scalars are leaves."""
    out: dict[str, Any] = {}
    if isinstance(value, Mapping) and value:
        for key, inner in value.items():
            out.update(flatten(inner, f"{prefix}.{key}" if prefix else str(key)))
    else:
        out[prefix] = value
    return out


def _text(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def param_diff(flat_params: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Sorted dotted keys whose value is not the same in every run of ``flat_params``."""
    keys = sorted({k for flat in flat_params.values() for k in flat})
    return [k for k in keys if len({_text(flat[k]) if k in flat else "\0missing" for flat in flat_params.values()}) > 1]


#: How :func:`run_summary` reads each metric, by kind (``rapydli runs compare`` prints it).
SUMMARY_KINDS = {
    "eval": "last evaluation",
    "mean": "run mean: samples over step time",
    "last": "last logged value",
}


def run_summary(store: Any, run_id: str) -> tuple[dict[str, float], dict[str, str]]:
    """A run's final metrics as a run's, not as its last step's.

    Validation metrics (``val_*``) are the last evaluation's; ``samples_per_s`` is the run's
    mean throughput: every training step's samples (its ``samples_per_s`` times its
    ``step_time_s``) over the sum of the step times; other metrics and scalar records are
    their last value (as :meth:`RunStore.final_metrics`).

    Returns
    -------
    tuple
        ``({name: value}, {name: kind})`` with kinds the keys of :data:`SUMMARY_KINDS`.
    """
    final = dict(store.final_metrics(run_id))
    kinds = {name: "eval" if name.startswith("val_") else "last" for name in final}
    per_step: dict[int, dict[str, float]] = {}
    for row in store.metrics(
        run_id
    ):  # a training step logs samples_per_s then step_time_s; take the first of each per step
        if row["name"] in ("samples_per_s", "step_time_s"):
            per_step.setdefault(row["step"], {}).setdefault(row["name"], row["value"])
    mean = mean_samples_per_s(
        (v["samples_per_s"], v["step_time_s"]) for v in per_step.values() if "samples_per_s" in v and "step_time_s" in v
    )
    if mean is not None:
        final["samples_per_s"] = mean
        kinds["samples_per_s"] = "mean"
    return final, kinds


def mean_samples_per_s(steps: Iterable[tuple[float, float]]) -> float | None:
    """A run's mean throughput from its training steps' (``samples_per_s``, ``step_time_s``): every step's samples
    over the sum of the step times (None without a timed step). The one definition the store, the CLI, the lab
    panel and :attr:`rapydli.experiments.run.RunResult.samples_per_s` report."""
    timed = [(rate, seconds) for rate, seconds in steps if seconds > 0]
    total = sum(seconds for _, seconds in timed)
    return sum(rate * seconds for rate, seconds in timed) / total if total > 0 else None


def compare_runs(store: Any, run_ids: Sequence[str], *, all_params: bool = False) -> dict[str, Any]:
    """What ``rapydli runs compare`` prints, as data.

    Parameters
    ----------
    store
        A :class:`~rapydli.experiments.store.runstore.RunStore`.
    run_ids
        Two to :data:`MAX_COMPARE` full run ids, all different.
    all_params
        List every parameter, not only those that differ.

    Returns
    -------
    dict
        ``runs`` (each run's dict with ``final``, from :func:`run_summary`, and
        ``final_kinds``: how each was read), ``params`` (shown dotted keys),
        ``values`` (``{run_id: {key: value}}``, a key missing from a run absent),
        ``differ`` (the keys that differ), ``metrics`` (sorted names of final metrics).
    """
    ids = list(run_ids)
    if len(ids) < 2:
        raise ConfigError(f"comparing needs at least two run ids; got {len(ids)}")
    if len(ids) > MAX_COMPARE:
        raise ConfigError(f"at most {MAX_COMPARE} runs can be compared at once; got {len(ids)}")
    if len(set(ids)) != len(ids):
        raise ConfigError("the run ids to compare must be different")
    runs = []
    flat: dict[str, dict[str, Any]] = {}
    for run_id in ids:
        run = store.get_run(run_id)
        run["final"], run["final_kinds"] = run_summary(store, run_id)
        runs.append(run)
        flat[run_id] = flatten(run["params"])
    differ = param_diff(flat)
    shown = sorted({k for f in flat.values() for k in f}) if all_params else differ
    return {
        "runs": runs,
        "params": shown,
        "values": {run_id: {k: f[k] for k in shown if k in f} for run_id, f in flat.items()},
        "differ": differ,
        "metrics": sorted({name for run in runs for name in run["final"]}),
    }

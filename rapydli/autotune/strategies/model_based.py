"""Model-based search: a Bayesian linear model of log time over the parameters picks what to measure next.

Few evaluations find good configurations because each one teaches the model about every
configuration sharing its parameter values (Kernel Tuner's ``bayes_opt`` with a model
cheap enough to refit after every measurement; numpy only):

1. ``space.always`` (the library variants) is measured first: the yardstick (with early
   abandonment against the fastest of them so far).
2. ``options["priors"]`` (the winners of similar problems, e.g. the model's larger layers
   tuned before this one) are tried next, then ``options["initial"]`` seeded random draws.
3. Then, repeatedly, the configuration with the lowest lower confidence bound
   (``mean - kappa * std`` of the predicted log time relative to the best library time) is
   measured, with early abandonment: ``problem.abandon_s`` is set to ``margin`` x the best
   time so far, so a configuration already that much slower after its first timed run is
   not timed further (Triton's autotune prunes the same way by first-run times).
   ``options["history"]`` (``(config, time / best library time)`` pairs of other problems)
   trains the model too, so a new layer starts from what earlier layers taught.

With ``batch`` > 1 the lowest bounds are measured together (one per engine of a
parallel runner). It stops when the space is measured, after ``budget`` evaluations, after ``patience``
evaluations without a better time, or when the runner answers ``"missing"`` (its
deadline passed).

Example
-------
>>> from rapydli.autotune.search import Config
>>> features([Config.of("c_direct", {"kb": 2}), Config.of("c_direct", {"kb": 4})]).shape
(2, 4)
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from rapydli.autotune.runner import Measurement, Runner
from rapydli.autotune.search import Config, SearchSpace
from rapydli.autotune.strategies import options_with_defaults
from rapydli.errors import ConfigError

TIMED = ("ok", "slow")  # statuses with a time the model learns from
RIDGE = 1.0  # prior precision of the weights


def _tokens(config: Config) -> list[tuple[Any, ...]]:
    return [("candidate", config.candidate), *((config.candidate, k, v) for k, v in config.params)]


def features(configs: Sequence[Config], vocabulary: Sequence[tuple[Any, ...]] | None = None) -> np.ndarray:
    """One row per configuration: an intercept, then one-hot candidate and parameter values."""
    vocab = list(vocabulary) if vocabulary is not None else list(dict.fromkeys(t for c in configs for t in _tokens(c)))
    index = {t: i + 1 for i, t in enumerate(vocab)}
    out = np.zeros((len(configs), len(vocab) + 1))
    out[:, 0] = 1.0
    for row, config in enumerate(configs):
        for token in _tokens(config):
            if token in index:
                out[row, index[token]] = 1.0
    return out


def lower_bounds(train: Sequence[Config], y: Sequence[float], pool: Sequence[Config], kappa: float) -> np.ndarray:
    """``mean - kappa * std`` of the Bayesian linear model fitted on ``(train, y)``, for each of ``pool``."""
    vocab = list(dict.fromkeys(t for c in [*train, *pool] for t in _tokens(c)))
    x, xp = features(train, vocab), features(pool, vocab)
    target = np.asarray(y, dtype=float)
    precision = x.T @ x + RIDGE * np.eye(x.shape[1])
    cov = np.linalg.inv(precision)
    weights = cov @ x.T @ target
    residual = target - x @ weights
    noise = max(float(residual @ residual) / max(1, len(target) - 1), 0.01)
    mean = xp @ weights
    std = np.sqrt(noise * np.einsum("ij,jk,ik->i", xp, cov, xp))
    return mean - kappa * std


def tune(space: SearchSpace, runner: Runner, options: Mapping[str, Any] | None = None) -> list[Measurement]:
    """Measure the library variants, then generated configurations the model expects to be fastest.

    Options: ``budget`` (evaluations beyond ``space.always``; None: no limit), ``seed`` (0),
    ``initial`` (random draws before the model leads; 2), ``margin`` (early abandonment
    above this x the best time; 1.25, None: off), ``patience`` (8), ``kappa`` (exploration
    weight; 1.0), ``batch`` (configurations handed to the runner at once: the engines of a
    parallel runner; 1), ``priors`` (configurations to try first) and ``history``
    (``(config, relative time)`` pairs from other problems).
    """
    opts = options_with_defaults(
        options, budget=None, seed=0, initial=2, margin=1.25, patience=8, kappa=1.0, batch=1, priors=(), history=()
    )
    budget, margin = opts["budget"], opts["margin"]
    if budget is not None and (not isinstance(budget, int) or budget < 0):
        raise ConfigError(f"options['budget'] must be a non-negative integer or None, got {budget!r}")
    if margin is not None and not (isinstance(margin, (int, float)) and margin >= 1.0):
        raise ConfigError(f"options['margin'] must be a number >= 1 or None, got {margin!r}")
    problem = space.problem
    results: list[Measurement] = []
    for config in dict.fromkeys(space.always):
        best = min((m.median for m in results if m.ok and m.median), default=None)
        (m,) = runner.run(replace(problem, abandon_s=best * margin) if margin and best else problem, [config])
        results.append(m)
    library = [m.median for m in results if m.ok and m.median]
    scale = min(library) if library else None
    measured = {m.config for m in results}
    pool = [c for c in dict.fromkeys(space.configs) if c not in measured]
    in_pool = set(pool)
    queue = [c for c in dict.fromkeys(opts["priors"]) if c in in_pool]
    rng = random.Random(opts["seed"])
    draws = rng.sample(pool, min(opts["initial"], len(pool)))
    history = [(c, math.log(t)) for c, t in opts["history"] if t and t > 0]
    best = min((m.median for m in results if m.ok and m.median is not None), default=None)
    stale = 0
    taken = 0
    while pool and (budget is None or taken < budget) and stale < opts["patience"]:
        size = min(opts["batch"], len(pool), budget - taken if budget is not None else len(pool))
        chosen: list[Config] = []
        while len(chosen) < size and (queue or draws):
            config = (queue or draws).pop(0)
            if config in in_pool and config not in chosen:
                chosen.append(config)
        if len(chosen) < size:
            own = [
                (m.config, math.log(m.median / scale))
                for m in results
                if m.status in TIMED and m.median and scale and m.config not in space.always
            ]
            train = [*history, *own]
            rest = [c for c in pool if c not in chosen]
            if train:
                bounds = lower_bounds([c for c, _ in train], [y for _, y in train], rest, opts["kappa"])
                chosen += [rest[i] for i in np.argsort(bounds, kind="stable")[: size - len(chosen)]]
            else:
                chosen += rng.sample(rest, size - len(chosen))
        for config in chosen:
            pool.remove(config)
            in_pool.discard(config)
        timed_problem = replace(problem, abandon_s=best * margin) if margin and best else problem
        batch = runner.run(timed_problem, chosen)
        if all(m.status == "missing" for m in batch):  # the runner's deadline passed
            break
        for m in batch:
            if m.status == "missing":
                continue
            taken += 1
            results.append(m)
            if m.ok and m.median is not None and (best is None or m.median < best):
                best, stale = m.median, 0
            else:
                stale += 1
    return results

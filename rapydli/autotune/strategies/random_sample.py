"""Random sampling with a budget: a seeded sample of the pruned space, plus ``space.always``."""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

from rapydli.autotune.runner import Measurement, Runner
from rapydli.autotune.search import SearchSpace
from rapydli.autotune.strategies import options_with_defaults
from rapydli.errors import ConfigError


def tune(space: SearchSpace, runner: Runner, options: Mapping[str, Any] | None = None) -> list[Measurement]:
    """Measure ``options["budget"]`` (default 8) configurations drawn with ``options["seed"]`` (default 0)."""
    opts = options_with_defaults(options, budget=8, seed=0)
    budget = opts["budget"]
    if not isinstance(budget, int) or budget < 1:
        raise ConfigError(f"options['budget'] must be a positive integer, got {budget!r}")
    pool = [c for c in space.configs if c not in space.always]
    sample = random.Random(opts["seed"]).sample(pool, min(budget, len(pool)))
    chosen = set(sample)
    ordered = [c for c in pool if c in chosen]  # keep space order: the same draw measures the same way
    return runner.run(space.problem, list(dict.fromkeys([*space.always, *ordered])))

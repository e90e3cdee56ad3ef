"""Exhaustive search: measure every configuration left after pruning."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rapydli.autotune.runner import Measurement, Runner
from rapydli.autotune.search import SearchSpace


def tune(space: SearchSpace, runner: Runner, options: Mapping[str, Any] | None = None) -> list[Measurement]:
    """Measure ``space.always`` and every configuration of ``space`` (no options are read)."""
    configs = list(dict.fromkeys([*space.always, *space.configs]))
    return runner.run(space.problem, configs)

"""Search strategies, registered by name; each is ``tune(space, runner, options) -> list[Measurement]``.

* ``exhaustive``: measure every configuration that survives the constraints (the BEAST way).
* ``random``: measure ``options["budget"]`` configurations drawn with ``options["seed"]``,
  plus ``space.always``.
* ``model_based``: the library variants, then generated configurations chosen one at a time
  by a Bayesian linear model of their time, with early abandonment of slow ones (few
  evaluations; what budgeted model tuning uses).

Example
-------
>>> from rapydli.autotune.strategies import get
>>> get("exhaustive").__module__
'rapydli.autotune.strategies.exhaustive'
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from importlib import import_module
from typing import Any

from rapydli.errors import ConfigError

Strategy = Callable[..., list]

_STRATEGIES: dict[str, str] = {
    "exhaustive": "rapydli.autotune.strategies.exhaustive",
    "random": "rapydli.autotune.strategies.random_sample",
    "model_based": "rapydli.autotune.strategies.model_based",
}


def names() -> list[str]:
    """Registered strategy names."""
    return sorted(_STRATEGIES)


def get(name: str) -> Strategy:
    """The ``tune`` function of strategy ``name``."""
    if name not in _STRATEGIES:
        raise ConfigError(f"strategy must be one of {names()}, got {name!r}")
    return import_module(_STRATEGIES[name]).tune


def options_with_defaults(options: Mapping[str, Any] | None, **defaults: Any) -> dict[str, Any]:
    """``defaults`` updated with ``options``."""
    merged = dict(defaults)
    merged.update(options or {})
    return merged

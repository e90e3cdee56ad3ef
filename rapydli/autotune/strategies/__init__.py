"""Search strategies, registered by name in :data:`STRATEGIES`; each is ``tune(space, runner, options) -> list[Measurement]``.

* ``exhaustive``: measure every configuration that survives the constraints (the BEAST way).
* ``random``: measure ``options["budget"]`` configurations drawn with ``options["seed"]``,
  plus ``space.always``.
* ``model_based``: the library variants, then generated configurations chosen one at a time
  by a Bayesian linear model of their time, with early abandonment of slow ones (few
  evaluations; what budgeted model tuning uses).

Other packages add strategies in the ``rapydli.strategies`` entry-point group (a
``tune`` function); ``rapydli tune --strategy`` offers every registered name.

Example
-------
>>> from rapydli.autotune.strategies import get
>>> get("exhaustive").__module__
'rapydli.autotune.strategies.exhaustive'
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from rapydli.errors import ConfigError
from rapydli.registry import Registry

Strategy = Callable[..., list]

STRATEGIES = Registry(
    "search strategy",
    {
        "exhaustive": "rapydli.autotune.strategies.exhaustive:tune",
        "random": "rapydli.autotune.strategies.random_sample:tune",
        "model_based": "rapydli.autotune.strategies.model_based:tune",
    },
    group="rapydli.strategies",
)


def names() -> list[str]:
    """Registered strategy names (entry points included)."""
    return STRATEGIES.names()


def get(name: str) -> Strategy:
    """The ``tune`` function of strategy ``name``."""
    if name not in STRATEGIES:
        raise ConfigError(f"strategy must be one of {names()}, got {name!r}")
    tune: Strategy = STRATEGIES.load(name)
    return tune


def options_with_defaults(options: Mapping[str, Any] | None, **defaults: Any) -> dict[str, Any]:
    """``defaults`` updated with ``options``."""
    merged = dict(defaults)
    merged.update(options or {})
    return merged

"""Search-space dimensions for ``rd.sweep``: ``rd.loguniform``, ``rd.uniform``, ``rd.choice``, ``rd.intrange``.

Each dimension knows how to ask an Optuna trial for a value (``suggest``) and, where
it is discrete, its values for a grid (``grid``). A space is a dict from
:class:`~rapydli.trainer.config.TrainConfig` field names to dimensions; :func:`validate_space`
checks names and bounds before anything starts.

Examples
--------
>>> space = {"lr": loguniform(1e-4, 1e-1), "optimizer": choice(["sgd", "adamw"])}
>>> validate_space(space)["optimizer"].grid()
['sgd', 'adamw']
>>> loguniform(0, 1)
Traceback (most recent call last):
...
rapydli.errors.ConfigError: loguniform(0, 1) is invalid: needs 0 < low < high
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rapydli.errors import ConfigError


@dataclass(frozen=True)
class LogUniform:
    """A float drawn log-uniformly from ``[low, high]``."""

    low: float
    high: float

    def suggest(self, trial: Any, name: str) -> float:
        return trial.suggest_float(name, self.low, self.high, log=True)

    def grid(self) -> list[Any]:
        raise ConfigError(f"{self} is continuous: the grid sampler needs rd.choice or rd.intrange dimensions")


@dataclass(frozen=True)
class Uniform:
    """A float drawn uniformly from ``[low, high]``."""

    low: float
    high: float

    def suggest(self, trial: Any, name: str) -> float:
        return trial.suggest_float(name, self.low, self.high)

    def grid(self) -> list[Any]:
        raise ConfigError(f"{self} is continuous: the grid sampler needs rd.choice or rd.intrange dimensions")


@dataclass(frozen=True)
class Choice:
    """One of ``values``."""

    values: tuple[Any, ...]

    def suggest(self, trial: Any, name: str) -> Any:
        return trial.suggest_categorical(name, list(self.values))

    def grid(self) -> list[Any]:
        return list(self.values)


@dataclass(frozen=True)
class IntRange:
    """An integer in ``[low, high]`` (both included), every ``step``."""

    low: int
    high: int
    step: int = 1

    def suggest(self, trial: Any, name: str) -> int:
        return trial.suggest_int(name, self.low, self.high, step=self.step)

    def grid(self) -> list[Any]:
        return list(range(self.low, self.high + 1, self.step))


Dimension = LogUniform | Uniform | Choice | IntRange


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def loguniform(low: float, high: float) -> LogUniform:
    """A learning-rate-like float, log-uniform in ``[low, high]`` (``0 < low < high``)."""
    if not (_number(low) and _number(high) and 0 < low < high):
        raise ConfigError(f"loguniform({low!r}, {high!r}) is invalid: needs 0 < low < high")
    return LogUniform(float(low), float(high))


def uniform(low: float, high: float) -> Uniform:
    """A float, uniform in ``[low, high]`` (``low < high``)."""
    if not (_number(low) and _number(high) and low < high):
        raise ConfigError(f"uniform({low!r}, {high!r}) is invalid: needs low < high")
    return Uniform(float(low), float(high))


def choice(values: Sequence[Any]) -> Choice:
    """One of ``values`` (a non-empty list of str, int, float, bool or None)."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or not values:
        raise ConfigError(f"choice({values!r}) is invalid: needs a non-empty list of values")
    if any(v is not None and not isinstance(v, (str, int, float, bool)) for v in values):
        raise ConfigError(f"choice({values!r}) is invalid: values must be str, int, float, bool or None")
    return Choice(tuple(values))


def intrange(low: int, high: int, step: int = 1) -> IntRange:
    """An integer in ``[low, high]``, both included."""
    ints = all(isinstance(v, int) and not isinstance(v, bool) for v in (low, high, step))
    if not (ints and low <= high and step >= 1):
        raise ConfigError(
            f"intrange({low!r}, {high!r}, step={step!r}) is invalid: needs integers low <= high, step >= 1"
        )
    return IntRange(low, high, step)


def validate_space(space: Mapping[str, Any]) -> dict[str, Dimension]:
    """Check that ``space`` maps TrainConfig field names to dimensions; return it as a dict."""
    from rapydli.trainer.config import fields_spec

    if not isinstance(space, Mapping) or not space:
        raise ConfigError(
            f"space={space!r} is invalid: a non-empty dict of TrainConfig field -> rd.loguniform/uniform/choice/intrange"
        )
    known = {spec.name for spec in fields_spec()}
    for name, dimension in space.items():
        if name not in known:
            raise ConfigError(f"space field {name!r} is not a TrainConfig field; known: {', '.join(sorted(known))}")
        if not isinstance(dimension, (LogUniform, Uniform, Choice, IntRange)):
            raise ConfigError(
                f"space[{name!r}]={dimension!r} is invalid: use rd.loguniform, rd.uniform, rd.choice or rd.intrange"
            )
    return dict(space)

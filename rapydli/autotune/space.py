"""Parameter spaces: named parameters with domains, pruned by hard and soft constraints.

A kernel template exposes its tuning parameters as a :class:`Space`. *Hard* constraints
come from the device query (a vector wider than the ISA, more accumulators than there
are registers) and *soft* constraints from the user or the problem (no point blocking 16
output channels when the layer has 3). Both are Python predicates over the parameters;
each records the parameters it reads, and enumeration checks a predicate as soon as all
of those are bound, so a doomed prefix is cut before the rest of the product is built.

Example
-------
>>> space = Space({"kb": [1, 2, 4], "wb": [1, 2, 4]})
>>> space.hard(lambda kb, wb: kb * wb <= 8, "registers")
>>> space.soft(lambda kb: kb <= 2, "kb <= K")
>>> [c["kb"] * 10 + c["wb"] for c in space.configs()]
[11, 12, 14, 21, 22, 24]
>>> space.counts()
{'total': 9, 'after_hard': 8, 'after_soft': 6}
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rapydli.errors import ConfigError


@dataclass(frozen=True)
class Constraint:
    """A predicate over some parameters of a space.

    Parameters
    ----------
    predicate
        Called with the parameters it names as keyword arguments; returns truthy to keep.
    reads
        The parameter names the predicate reads (taken from its signature).
    kind
        ``"hard"`` (device limit) or ``"soft"`` (user or problem limit).
    name
        Human-readable description, shown in reports.
    """

    predicate: Callable[..., bool]
    reads: tuple[str, ...]
    kind: str
    name: str

    def check(self, bound: Mapping[str, Any]) -> bool:
        """Evaluate the predicate on the bound parameters it reads."""
        return bool(self.predicate(**{p: bound[p] for p in self.reads}))


@dataclass
class Space:
    """Named parameters with finite domains, and the constraints that prune them.

    Parameters
    ----------
    params
        Mapping of parameter name to its domain (a sequence of values), in binding order.
    """

    params: dict[str, Sequence[Any]]
    constraints: list[Constraint] = field(default_factory=list)
    evaluations: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        for name, domain in self.params.items():
            if not isinstance(name, str) or not name.isidentifier():
                raise ConfigError(f"space parameter names must be identifiers, got {name!r}")
            if len(domain) == 0:
                raise ConfigError(f"space parameter {name!r} has an empty domain")
        self.params = {name: list(domain) for name, domain in self.params.items()}

    def _add(self, predicate: Callable[..., bool], kind: str, name: str | None) -> None:
        reads = tuple(inspect.signature(predicate).parameters)
        unknown = [p for p in reads if p not in self.params]
        if unknown:
            raise ConfigError(
                f"constraint {name or predicate!r} reads unknown parameters {unknown}; known: {list(self.params)}"
            )
        self.constraints.append(
            Constraint(predicate, reads, kind, name or str(getattr(predicate, "__name__", "constraint")))
        )

    def hard(self, predicate: Callable[..., bool], name: str | None = None) -> None:
        """Add a hard (device) constraint; its parameters are read from its signature."""
        self._add(predicate, "hard", name)

    def soft(self, predicate: Callable[..., bool], name: str | None = None) -> None:
        """Add a soft (user or problem) constraint; its parameters are read from its signature."""
        self._add(predicate, "soft", name)

    def _schedule(self, kinds: tuple[str, ...]) -> list[list[Constraint]]:
        """For each binding depth, the constraints whose last-read parameter is bound there."""
        order = {name: i for i, name in enumerate(self.params)}
        at_depth: list[list[Constraint]] = [[] for _ in self.params]
        for constraint in self.constraints:
            if constraint.kind not in kinds:
                continue
            depth = max((order[p] for p in constraint.reads), default=0)
            at_depth[depth].append(constraint)
        return at_depth

    def _walk(self, kinds: tuple[str, ...]) -> Iterator[dict[str, Any]]:
        names = list(self.params)
        schedule = self._schedule(kinds)
        bound: dict[str, Any] = {}

        def recurse(depth: int) -> Iterator[dict[str, Any]]:
            if depth == len(names):
                yield dict(bound)
                return
            name = names[depth]
            for value in self.params[name]:
                bound[name] = value
                ok = True
                for constraint in schedule[depth]:
                    self.evaluations += 1
                    if not constraint.check(bound):
                        ok = False
                        break
                if ok:
                    yield from recurse(depth + 1)
            bound.pop(name, None)

        yield from recurse(0)

    def configs(self) -> list[dict[str, Any]]:
        """Every configuration that satisfies all hard and soft constraints, in domain order."""
        return list(self._walk(("hard", "soft")))

    def total(self) -> int:
        """Size of the full Cartesian product."""
        count = 1
        for domain in self.params.values():
            count *= len(domain)
        return count

    def counts(self) -> dict[str, int]:
        """``{"total", "after_hard", "after_soft"}``: sizes before and after pruning."""
        return {
            "total": self.total(),
            "after_hard": sum(1 for _ in self._walk(("hard",))),
            "after_soft": sum(1 for _ in self._walk(("hard", "soft"))),
        }


def empty_space() -> Space:
    """The space of a candidate without parameters: exactly one (empty) configuration."""
    return Space({})

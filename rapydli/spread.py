"""Measurements with their spread: the median of repeated, interleaved rounds and the range they span.

A timing taken once on a shared machine says little: another process may have held a core
for the whole of it. The studies that compare timings (a scaling study's points, ...)
repeat their measurements in interleaved rounds (every candidate once per round, so a
burst of load hits all of them alike), pair the candidates within each round, and report
the median with the range of the rounds (:class:`Spread`). A conclusion (one is faster,
a speedup) is drawn only when the range excludes "no difference" (:meth:`Spread.verdict`);
a value that cannot be (an efficiency above 1) is flagged as an artefact of the load seen
(:func:`machine_load`), never reported as a result.

Examples
--------
>>> Spread.of([2.0, 2.2, 1.9]).verdict()
'above 1'
>>> Spread.of([0.9, 1.2, 1.0]).verdict()
'not distinguishable from 1 (the repeats span 0.9 to 1.2)'
"""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Spread:
    """The median of ``n`` repeated measurements and the range (``low``, ``high``) they span."""

    median: float
    low: float
    high: float
    n: int

    @classmethod
    def of(cls, samples: Sequence[float]) -> Spread:
        """The spread of ``samples`` (finite ones; NaN fields when none is)."""
        kept = [float(s) for s in samples if math.isfinite(s)]
        if not kept:
            return cls(math.nan, math.nan, math.nan, 0)
        return cls(statistics.median(kept), min(kept), max(kept), len(kept))

    @classmethod
    def quartiles(cls, samples: Sequence[float]) -> Spread:
        """The median and interquartile range of ``samples`` (per-step times of one run, where a
        single stalled step should not set the range)."""
        kept = sorted(float(s) for s in samples if math.isfinite(s))
        if len(kept) < 4:
            return cls.of(kept)
        q1, median, q3 = statistics.quantiles(kept, n=4)
        return cls(median, q1, q3, len(kept))

    def minus(self, amount: float) -> Spread:
        """The spread of every measurement less ``amount`` (a ratio's spread as an overhead: ``minus(1.0)``)."""
        return Spread(self.median - amount, self.low - amount, self.high - amount, self.n)

    @property
    def relative_width(self) -> float:
        """``(high - low) / median``: how far the repeats disagree (0 for one measurement)."""
        return (self.high - self.low) / self.median if self.median else math.inf

    def verdict(self, reference: float = 1.0) -> str:
        """``"above 1"`` or ``"below 1"`` (``reference``) when every repeat is, else why not."""
        if self.n == 0:
            return "not measured"
        if self.low > reference:
            return f"above {reference:g}"
        if self.high < reference:
            return f"below {reference:g}"
        return f"not distinguishable from {reference:g} (the repeats span {self.low:.3g} to {self.high:.3g})"


def machine_load() -> dict[str, float]:
    """This machine's load now: ``load_1m`` (runnable processes, 1-minute average) and ``cores``."""
    return {"load_1m": os.getloadavg()[0], "cores": float(os.cpu_count() or 1)}


def load_text(load: dict[str, float]) -> str:
    """``"load 3.2 on 2 cores"``."""
    return f"load {load['load_1m']:.1f} on {int(load['cores'])} cores"


def busy(load: dict[str, float]) -> bool:
    """Whether other work competed for the cores (more runnable processes than cores)."""
    return load["load_1m"] > load["cores"]


def paired(numerator: Sequence[float], denominator: Sequence[float]) -> Spread:
    """The spread of ``numerator[i] / denominator[i]``: two variants timed in the same interleaved rounds.

    Pairing within a round cancels what a shared machine does between rounds (a burst of
    load slows both); the ratio of two medians would not.

    >>> paired([8.0, 8.8, 8.1], [10.0, 11.0, 9.0]).median
    0.8
    """
    return Spread.of([a / b for a, b in zip(numerator, denominator, strict=True) if b])


def target(spread: Spread, limit: float, *, at_most: bool = True, percent: bool = False) -> str:
    """Whether a measured ``spread`` meets a target ``<= limit`` (``at_most``) or ``>= limit``.

    ``"met"`` or ``"not met"`` only when every round agrees; otherwise ``"unclear (the
    rounds span ...)"``: the machine was too noisy to conclude, and the answer says so.

    >>> target(Spread.of([0.80, 0.82, 0.84]), 0.85)
    'met'
    >>> target(Spread.of([0.80, 0.90]), 0.85)
    'unclear (the rounds span 0.8 to 0.9 around the target 0.85: repeat with more rounds on a quieter machine)'
    """
    if spread.n == 0:
        return "not measured"
    inside, outside = (
        (spread.high <= limit, spread.low > limit) if at_most else (spread.low >= limit, spread.high < limit)
    )
    if inside:
        return "met"
    if outside:
        return "not met"
    number = "{:+.2%}".format if percent else "{:.3g}".format
    return (
        f"unclear (the rounds span {number(spread.low)} to {number(spread.high)} around the target {number(limit)}: "
        "repeat with more rounds on a quieter machine)"
    )


def rounds_text(spread: Spread, percent: bool = False) -> str:
    """``"0.78 to 0.86 over 3 rounds"`` (or ``"+1.20% to +3.50% over 5 rounds"``): the interval printed beside a median."""
    if spread.n == 0:
        return "not measured"
    low, high = (
        (f"{spread.low:+.2%}", f"{spread.high:+.2%}") if percent else (f"{spread.low:.3g}", f"{spread.high:.3g}")
    )
    return f"{low} to {high} over {spread.n} round{'s' if spread.n != 1 else ''}"

"""What a search strategy works on: configurations (candidate + parameters) of one problem."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rapydli.autotune.problem import ConvShape
from rapydli.errors import ConfigError

MODES = ("train", "inference")


@dataclass(frozen=True)
class Config:
    """One point of the search: a candidate name and its parameters (hashable, picklable)."""

    candidate: str
    params: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def of(cls, candidate: str, params: Mapping[str, Any] | None = None) -> Config:
        """Build from a parameter mapping."""
        return cls(candidate, tuple(sorted((params or {}).items())))

    @property
    def param_dict(self) -> dict[str, Any]:
        """The parameters as a dict."""
        return dict(self.params)

    @property
    def params_key(self) -> str:
        """The parameters as canonical JSON (cache key)."""
        return json.dumps(self.param_dict, sort_keys=True)

    def __str__(self) -> str:
        inner = ",".join(f"{k}={v}" for k, v in self.params)
        return f"{self.candidate}({inner})" if inner else self.candidate


@dataclass(frozen=True)
class Problem:
    """A tuning problem: a convolution shape, a mode, and how to measure it.

    Parameters
    ----------
    shape
        The convolution.
    mode
        ``"train"`` (forward + data gradient + weight gradient are timed) or ``"inference"``.
    device
        ``"cpu"`` or ``"cuda"``.
    warmup, repetitions
        Untimed runs, then timed runs (at least 3 of them are kept even past ``time_budget``).
    time_budget
        Seconds of timed runs per configuration after which repetitions stop early.
    tolerance
        Largest accepted relative error (Frobenius norm) against the float64 reference.
    threads
        Threads of each timed run (None: the measuring process's torch thread count).
        :func:`~rapydli.autotune.tune_conv2d` sets it, so every runner and every engine
        count times with the same number of threads.
    abandon_s
        Early abandonment: a configuration whose first timed run takes longer than this
        (seconds, all passes) is not timed further and is reported ``"slow"`` (None: time
        every repetition). Strategies set it to the best time so far times a margin.
    """

    shape: ConvShape
    mode: str = "train"
    device: str = "cpu"
    warmup: int = 1
    repetitions: int = 5
    time_budget: float = 1.0
    tolerance: float = 1e-4
    threads: int | None = None
    abandon_s: float | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.repetitions < 1 or self.warmup < 0:
            raise ConfigError("repetitions must be >= 1 and warmup >= 0")
        if self.threads is not None and (not isinstance(self.threads, int) or self.threads < 1):
            raise ConfigError(f"threads must be a positive integer or None, got {self.threads!r}")

    @property
    def key(self) -> str:
        """Cache key of the problem (shape and mode)."""
        return f"{self.shape.key}:{self.mode}"


@dataclass
class SearchSpace:
    """The configurations of a problem, with per-candidate pruning counts.

    ``always`` lists configurations every strategy measures (the library variants, so a
    tuned layer is never slower than the best library choice).
    """

    problem: Problem
    configs: list[Config]
    always: list[Config] = field(default_factory=list)
    counts: dict[str, dict[str, int]] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)

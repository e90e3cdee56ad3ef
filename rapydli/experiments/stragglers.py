"""A rank that is persistently slower than the others: found from the per-rank step timings, named with its host.

In a data-parallel step every rank waits for the slowest in the gradient allreduce, so a
slow rank (a busy core, a throttled node, a slow disk) does not show in its own waiting
time but in everybody else's. What each rank spends *not* waiting for the others
(``step_time_s - comm_wait_s - data_time_s``: its compute and its own share of the
communication) tells them apart. :class:`StragglerWatch` reads the rows a run delivers
(rank 0's ``train`` rows and the other ranks' ``rank`` rows), and once the last
``window`` complete steps show one rank's busy time above ``ratio`` times the median of
the others' (and at least :data:`MIN_GAP_S` more), the busiest in most of those steps, it
reports that rank once, with its host.

Only ranks that do the same work are compared: the watch is for data-parallel layouts
(pipeline stages and tensor slices differ by design).

Examples
--------
>>> watch = StragglerWatch(ranks=2, hosts={0: "n1", 1: "n2"}, window=3)
>>> for step in range(1, 4):
...     _ = watch.add({"kind": "train", "rank": 0, "step": step, "step_time_s": 0.05, "comm_wait_s": 0.03, "data_time_s": 0.0})
...     found = watch.add({"kind": "rank", "rank": 1, "step": step, "step_time_s": 0.05, "comm_wait_s": 0.0, "data_time_s": 0.0})
>>> print(found.text())
rank 1 (host n2) is a straggler: busy 50 ms per step against 20 ms on the other ranks (median of the last 3 steps); the others wait for it in the allreduce
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

WINDOW = 10  # complete steps a verdict rests on
RATIO = 1.3  # how much busier than the others' median a straggler is
MAJORITY = 0.8  # the share of the window's steps in which it must be the busiest
MIN_GAP_S = 0.005  # and at least this much busier per step (sub-millisecond steps jitter by more than RATIO)


@dataclass(frozen=True)
class Straggler:
    """One rank found persistently slower: its busy time per step against the others' (seconds, medians over ``steps``)."""

    rank: int
    host: str
    busy_s: float
    others_s: float
    step: int
    steps: int

    def text(self) -> str:
        """One line naming the rank, its host and the figures."""
        return (
            f"rank {self.rank} (host {self.host}) is a straggler: busy {1e3 * self.busy_s:.0f} ms per step against "
            f"{1e3 * self.others_s:.0f} ms on the other ranks (median of the last {self.steps} steps); "
            "the others wait for it in the allreduce"
        )

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready (the run's ``stragglers`` record)."""
        return {
            "rank": self.rank,
            "host": self.host,
            "busy_s": self.busy_s,
            "others_s": self.others_s,
            "step": self.step,
            "steps": self.steps,
            "text": self.text(),
        }


@dataclass
class StragglerWatch:
    """Finds stragglers among ``ranks`` data-parallel ranks from their step timings (see the module docstring).

    Parameters
    ----------
    ranks
        The run's ranks (0 .. ranks-1).
    hosts
        The host of each rank (named in the report).
    window, ratio
        The last ``window`` complete steps; a rank busier than ``ratio`` times the others' median.
    """

    ranks: int
    hosts: dict[int, str]
    window: int = WINDOW
    ratio: float = RATIO
    found: list[Straggler] = field(default_factory=list)
    _busy: dict[int, dict[int, float]] = field(default_factory=dict)  # step -> rank -> busy seconds
    _complete: list[int] = field(default_factory=list)  # steps every rank reported, in order

    def add(self, row: dict[str, Any]) -> Straggler | None:
        """Take one timing row; a :class:`Straggler` when this row completes the evidence for a new one."""
        if row.get("kind") not in ("train", "rank") or self.ranks < 2 or "step_time_s" not in row:
            return None
        busy = row["step_time_s"] - row.get("comm_wait_s", 0.0) - row.get("data_time_s", 0.0)
        step = int(row["step"])
        of_step = self._busy.setdefault(step, {})
        of_step[int(row.get("rank", 0))] = busy
        if len(of_step) < self.ranks:
            return None
        self._complete.append(step)
        recent = self._complete[-self.window :]
        for old in list(self._busy):
            if old < recent[0] and old in self._complete:
                del self._busy[old]
        if len(recent) < self.window:
            return None
        return self._judge(recent)

    def _judge(self, steps: list[int]) -> Straggler | None:
        medians = {rank: statistics.median(self._busy[s][rank] for s in steps) for rank in range(self.ranks)}
        slowest = max(medians, key=lambda rank: medians[rank])
        others = statistics.median(v for rank, v in medians.items() if rank != slowest)
        busiest_in = sum(max(self._busy[s], key=lambda rank: self._busy[s][rank]) == slowest for s in steps)
        gap = medians[slowest] - others
        if (
            others <= 0
            or medians[slowest] < self.ratio * others
            or gap < MIN_GAP_S
            or busiest_in < MAJORITY * len(steps)
        ):
            return None
        if any(known.rank == slowest for known in self.found):
            return None  # reported once
        straggler = Straggler(slowest, self.hosts.get(slowest, "?"), medians[slowest], others, steps[-1], len(steps))
        self.found.append(straggler)
        return straggler

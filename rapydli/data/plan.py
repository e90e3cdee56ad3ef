"""The clairvoyant part of clairvoyant loading: a rank's whole access stream, and its tiers.

Because every epoch's order is a pure function of ``(seed, epoch, rank, world_size)``
(:func:`rapydli.data.sampler.rank_indices`), a rank knows before training which samples it
will read, how often and when. NoPFS (Dryden et al., SC'21) uses this to keep each
rank's most frequently accessed samples in its fastest storage; this module computes the
stream and that assignment, with no I/O, so both can be tested as pure functions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from rapydli.data.sampler import rank_indices

#: Tier names, fastest first; ``"storage"`` is the backing dataset itself.
TIERS = ("ram", "disk", "storage")


def access_stream(
    num_samples: int, rank: int, world_size: int, seed: int, epochs: int, drop_last: bool = False
) -> list[list[int]]:
    """This rank's sample indices for every epoch, in the order they will be read.

    Examples
    --------
    >>> access_stream(4, rank=0, world_size=2, seed=0, epochs=2)
    [[0, 3], [1, 2]]
    """
    return [
        rank_indices(num_samples, rank, world_size, seed, epoch, shuffle=True, drop_last=drop_last).tolist()
        for epoch in range(epochs)
    ]


@dataclass
class TierPlan:
    """Which tier each sample of a rank's stream lives in.

    Attributes
    ----------
    tier
        ``index -> "ram" | "disk" | "storage"`` for every index in the stream.
    priority
        Indices from most to least frequently accessed (ties: earlier first access first).
    frequency
        ``index -> number of accesses`` over all epochs.
    planned_bytes
        ``tier -> bytes`` the plan puts there (by the sizes it was given).
    """

    tier: dict[int, str]
    priority: list[int]
    frequency: dict[int, int]
    planned_bytes: dict[str, int] = field(default_factory=dict)

    def count(self, tier: str) -> int:
        """Number of distinct samples assigned to ``tier``."""
        return sum(1 for t in self.tier.values() if t == tier)


def assign_tiers(stream: list[list[int]], nbytes: Callable[[int], int], ram_bytes: int, disk_bytes: int) -> TierPlan:
    """Assign each sample to RAM, then local disk, by access frequency within the budgets.

    Samples are taken from most to least frequently accessed over the whole stream (ties:
    the one first accessed earlier comes first); each goes to RAM if it still fits in
    ``ram_bytes``, else to disk if it fits in ``disk_bytes``, else it stays in storage.

    Examples
    --------
    >>> plan = assign_tiers([[3, 1], [1, 2]], nbytes=lambda i: 10, ram_bytes=10, disk_bytes=10)
    >>> plan.priority, plan.tier
    ([1, 3, 2], {1: 'ram', 3: 'disk', 2: 'storage'})
    """
    frequency: dict[int, int] = {}
    first: dict[int, int] = {}
    position = 0
    for epoch in stream:
        for index in epoch:
            frequency[index] = frequency.get(index, 0) + 1
            first.setdefault(index, position)
            position += 1
    priority = sorted(frequency, key=lambda i: (-frequency[i], first[i]))
    budget = {"ram": ram_bytes, "disk": disk_bytes}
    used = {"ram": 0, "disk": 0, "storage": 0}
    tier: dict[int, str] = {}
    for index in priority:
        size = nbytes(index)
        chosen = next((t for t in ("ram", "disk") if used[t] + size <= budget[t]), "storage")
        used[chosen] += size
        tier[index] = chosen
    return TierPlan(tier=tier, priority=priority, frequency=frequency, planned_bytes=used)

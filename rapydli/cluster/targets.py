"""Parsing rank lists like ``0,2-3`` (never with ``eval``)."""

from __future__ import annotations

import re
from collections.abc import Sequence

from rapydli.errors import ConfigError

_ITEM = re.compile(r"^(\d+)(?:-(\d+))?$")


def parse_targets(targets: Sequence[int] | str | None, size: int) -> list[int]:
    """Ranks selected by ``targets``: None (all), a list of ints, or text like ``"0,2-3"``.

    Examples
    --------
    >>> parse_targets("0,2-3", 4)
    [0, 2, 3]
    >>> parse_targets(None, 2)
    [0, 1]
    """
    if targets is None:
        return list(range(size))
    if isinstance(targets, str):
        ranks: list[int] = []
        for item in targets.replace(" ", "").split(","):
            match = _ITEM.match(item)
            if not match:
                raise ConfigError(f"--targets {targets!r} is invalid: use ranks and ranges like '0,2-3'")
            low = int(match.group(1))
            high = int(match.group(2)) if match.group(2) is not None else low
            if high < low:
                raise ConfigError(f"--targets range {item!r} is empty: write it low-high")
            ranks.extend(range(low, high + 1))
    else:
        ranks = [int(r) for r in targets]
    if not ranks:
        raise ConfigError("targets is empty: select at least one rank")
    out_of_range = sorted({r for r in ranks if not 0 <= r < size})
    if out_of_range:
        raise ConfigError(f"targets {out_of_range} out of range: this cluster has ranks 0..{size - 1}")
    return sorted(set(ranks))

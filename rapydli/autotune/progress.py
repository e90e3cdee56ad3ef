"""What a model tuning shows while it runs: a tqdm bar and, optionally, a line per tuned layer.

The bar counts convolution layers done (a shape shared by several layers finishes them
together) and shows the configurations timed and the best layer speedup so far;
``tqdm.auto`` draws it as a widget in a notebook and as text in a terminal. Per-layer
lines go through ``tqdm.write`` so they do not tear the bar.

Example
-------
>>> progress = TuningProgress(total=3, enabled=False)
>>> progress.measured("ok"); progress.layer_done(2, speedup=1.3); progress.postfix()
'timed 1, best 1.30x'
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

LayerLine = Callable[[dict[str, Any]], None]


def table_line(row: dict[str, Any], header: bool = False) -> str:
    """One fixed-width line of the per-layer table (or its header) for a terminal."""
    if header:
        return (
            f"{'rank':>4} {'layers':>6} {'shape (n,c,h,w,k,r,s,stride,pad gG dD)':<40} {'share':>6} {'default':>9} "
            f"{'tuned':>9} {'speedup':>7} {'evals':>5}  status"
        )
    speedup = row.get("speedup")  # None: the repetitions' range does not support one
    low = row.get("speedup_low")
    measured = isinstance(low, float) and math.isfinite(low)
    shown = f"{speedup:>6.2f}x" if speedup is not None else f"{'noisy' if measured else 'n/a':>7}"
    return (
        f"{row['rank']:>4} {row['layers']:>6} {row['shape']:<40} {row['share'] * 100:>5.1f}% "
        f"{row['default_ms']:>7.3f}ms {row['tuned_ms']:>7.3f}ms {shown} {row['evaluated']:>5}  "
        f"{row['status']}" + (f"  [{row['flag']}]" if row.get("flag") else "")
    )


class TuningProgress:
    """A tqdm bar over a model's tunable layers.

    Parameters
    ----------
    total
        Tunable convolution layers.
    enabled
        Draw the bar (False: count silently).
    on_layer
        Called with each per-shape row as its tuning ends (see :func:`table_line`).
    """

    def __init__(self, total: int, enabled: bool = True, on_layer: LayerLine | None = None) -> None:
        self.timed = 0
        self.best: float | None = None
        self.on_layer = on_layer
        self.bar: Any = None
        if enabled:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, desc="autotune", unit="layer", dynamic_ncols=True)

    def postfix(self) -> str:
        """``"timed N, best S x"``: what the bar shows after its count."""
        best = f"{self.best:.2f}x" if self.best is not None else "-"
        return f"timed {self.timed}, best {best}"

    def describe(self, text: str) -> None:
        """Set the bar's description (the phase: profiling, a layer, the whole-model check)."""
        if self.bar is not None:
            self.bar.set_description_str(text, refresh=True)

    def measured(self, status: str) -> None:
        """Count one measurement taken (timed ones show in the bar)."""
        if status in ("ok", "slow"):
            self.timed += 1
            if self.bar is not None:
                self.bar.set_postfix_str(self.postfix())

    def layer_done(self, layers: int, speedup: float | None, row: dict[str, Any] | None = None) -> None:
        """``layers`` layers (of one shape) are done, at ``speedup`` over the library default."""
        if speedup is not None:
            self.best = speedup if self.best is None else max(self.best, speedup)
        if self.bar is not None:
            self.bar.update(layers)
            self.bar.set_postfix_str(self.postfix())
        if row is not None and self.on_layer is not None:
            self.on_layer(row)

    def write(self, line: str) -> None:
        """Print ``line`` above the bar (or plainly when there is none)."""
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(line)

    def close(self) -> None:
        """Close the bar."""
        if self.bar is not None:
            self.bar.close()

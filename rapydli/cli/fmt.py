"""How the command line prints values in its tables: floats rounded, nothing cut short.

JSON output (``--json``, ``runs export``) does not go through here: it keeps full precision.

Examples
--------
>>> fmt_value(0.8245125348189415), fmt_value(0.02693883019285411), fmt_value(1353.2), fmt_value(3)
('0.8245', '0.02694', '1353', '3')
>>> fmt_value({"lr": 0.02693883019285411, "layers": [64, 0.5]})
'{"layers": [64, 0.5], "lr": 0.02694}'
"""

from __future__ import annotations

import json
import math
from typing import Any

#: Significant digits of a float in the CLI's tables.
DIGITS = 4


def round_float(value: float, digits: int = DIGITS) -> float | int:
    """``value`` rounded to ``digits`` significant digits (whole numbers of 10^digits and more to integers)."""
    if not math.isfinite(value) or value == 0:
        return value
    if abs(value) >= 10**digits and abs(value) < 1e15:
        return round(value)
    return float(f"{value:.{digits}g}")


def rounded(value: Any, digits: int = DIGITS) -> Any:
    """``value`` with every float in it (nested in dicts and lists too) rounded by :func:`round_float`."""
    if isinstance(value, float):
        return round_float(value, digits)
    if isinstance(value, dict):
        return {k: rounded(v, digits) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [rounded(v, digits) for v in value]
    return value


def fmt_value(value: Any, digits: int = DIGITS) -> str:
    """Text of one table cell: strings as they are, floats rounded, the rest as JSON with rounded floats."""
    if isinstance(value, str):
        return value
    if value is None:
        return "-"
    if isinstance(value, float):
        number = round_float(value, digits)
        return f"{number:g}" if isinstance(number, float) and abs(number) < 10**digits else str(number)
    return json.dumps(rounded(value, digits), sort_keys=True, default=str)

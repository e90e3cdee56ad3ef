"""Printing and saving benchmark results: one table on stdout, the same rows as JSON."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Any

import pandas as pd

from rapydli.version import __version__


def machine_info() -> dict[str, Any]:
    """Facts that make a benchmark figure interpretable later."""
    import torch

    return {
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "rapydli": __version__,
        "cpus": os.cpu_count(),
        "processor": platform.processor() or platform.machine(),
        "load_average_1min": os.getloadavg()[0],  # a busy machine makes every figure noisy
    }


def emit(name: str, rows: list[dict[str, Any]], summary: dict[str, Any], json_path: str | None) -> pd.DataFrame:
    """Print ``rows`` as a table and ``summary`` as ``key: value`` lines; write JSON if asked.

    Returns the table as a DataFrame.
    """
    table = pd.DataFrame(rows)
    with pd.option_context("display.width", 200, "display.max_columns", 50, "display.max_rows", 500):
        print(f"== rapydli bench {name} ==")
        print(table.to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    for key, value in summary.items():
        print(f"{key}: {value:.3g}" if isinstance(value, float) else f"{key}: {value}")
    print(f"load average (1 min) at the end: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    if json_path:
        path = Path(json_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        payload = {"benchmark": name, "machine": machine_info(), "rows": rows, "summary": summary}
        path.write_text(json.dumps(payload, indent=2, default=str))
        print(f"wrote {path}")
    return table

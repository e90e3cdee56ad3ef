"""Records of a notebook's results: encoding, the run store, and reading them back.

``rd.record(name, value)`` (:func:`rapydli.notebook.record`) sends a recorded value to
two places:

* the executed notebook itself, as a display output whose metadata holds the value
  (``{"rapydli": {"name": ..., "type": ..., "value": ...}}``), so it can be read back
  from the ``.ipynb`` alone with :func:`read_records` (as scrapbook's ``glue`` does);
* the run store, under the current batch item (a batch passes its id to the kernel in
  ``RAPYDLI_BATCH_ITEM``), else under the last run this process created (e.g. by
  ``rd.train``); when there is neither, a note says the value is only in the notebook.

Values are scalars (numbers, booleans, short strings), small DataFrames (tables) and
plotly figures; dicts and lists of JSON values are kept as ``json``.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rapydli.errors import ConfigError, RapydliError
from rapydli.experiments.store import runstore as store_mod

#: Mime type of the display output that carries a record.
MIMETYPE = "application/vnd.rapydli.record+json"
#: Largest table (rows x columns) that :func:`record` accepts.
MAX_TABLE_CELLS = 100_000
MAX_STRING = 10_000


def encode(value: Any) -> tuple[str, Any]:
    """``(type, JSON value)`` for a recordable value; ConfigError for anything else.

    Types: ``scalar`` (number, bool, string), ``table`` (pandas DataFrame/Series, stored
    as ``{"columns", "index", "data"}``), ``figure`` (plotly figure, stored as its JSON
    dict) and ``json`` (dicts/lists of JSON values).
    """
    if isinstance(value, bool) or value is None:
        return "scalar", value
    if isinstance(value, numbers.Integral):
        return "scalar", int(value)
    if isinstance(value, numbers.Real):
        number = float(value)
        return "scalar", None if math.isnan(number) else number
    if isinstance(value, str):
        if len(value) > MAX_STRING:
            raise ConfigError(f"rd.record: strings are limited to {MAX_STRING} characters; got {len(value)}")
        return "scalar", value
    item = getattr(value, "item", None)
    if callable(item) and getattr(value, "shape", None) == ():  # numpy / torch 0-d values
        return encode(item())
    module = type(value).__module__
    if module.startswith("pandas"):
        import pandas as pd

        if isinstance(value, pd.Series):
            value = value.to_frame()
        if isinstance(value, pd.DataFrame):
            if value.size > MAX_TABLE_CELLS:
                raise ConfigError(
                    f"rd.record: tables are limited to {MAX_TABLE_CELLS} cells; got {value.shape[0]}x{value.shape[1]}"
                )
            return "table", json.loads(value.to_json(orient="split", date_format="iso"))
    if module.startswith("plotly") and hasattr(value, "to_json"):
        return "figure", json.loads(value.to_json())
    if isinstance(value, (Mapping, list, tuple)):
        try:
            return "json", json.loads(store_mod.to_json(value))
        except ConfigError as exc:
            raise ConfigError(f"rd.record: {exc}") from exc
    raise ConfigError(
        f"rd.record: cannot record a {type(value).__name__}; record a number, string, bool, "
        "pandas DataFrame, plotly figure, or a dict/list of those"
    )


def decode(type_: str, value: Any) -> Any:
    """The Python object for a stored record: DataFrame for tables, plotly Figure for figures."""
    if type_ == "table":
        import pandas as pd

        return pd.DataFrame(**value)
    if type_ == "figure":
        import plotly.graph_objects as go

        return go.Figure(value)
    return value


def store_record(name: str, type_: str, encoded: Any) -> str | None:
    """Add an encoded record to the current batch item or run; its id, or None when there is none."""
    run_id = store_mod.current_run_id()
    if run_id is None:
        return None
    try:
        store = store_mod.open_store()
        if store is None:
            return None
        store.add_record(run_id, name, type_, encoded)
    except RapydliError as exc:
        print(f"rd.record: {name!r} not stored in the run store: {exc}", file=sys.stderr)
        return None
    return run_id


def read_records(notebook: str | os.PathLike[str], *, decoded: bool = True) -> dict[str, Any]:
    """Every value recorded in an executed notebook, by name, read from the ``.ipynb`` alone.

    Parameters
    ----------
    notebook
        Path of the executed notebook.
    decoded
        Return DataFrames and plotly figures (default) rather than their JSON form.

    Examples
    --------
    >>> read_records("out/05-batch-experiments/1a2b3c4d5e.ipynb")["accuracy"]  # doctest: +SKIP
    0.94
    """
    import nbformat

    try:
        nb = nbformat.read(Path(notebook), as_version=4)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read notebook {notebook}: {exc}") from exc
    found: dict[str, Any] = {}
    for cell in nb.cells:
        for output in cell.get("outputs", []) if cell.cell_type == "code" else []:
            payload = output.get("metadata", {}).get("rapydli")
            if output.get("output_type") == "display_data" and isinstance(payload, Mapping) and "name" in payload:
                found[payload["name"]] = (
                    decode(payload["type"], payload["value"])
                    if decoded
                    else {"type": payload["type"], "value": payload["value"]}
                )
    return found

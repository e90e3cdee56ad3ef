"""What a batch will run: grid expansion, validation against the notebook, hashes.

Everything here runs before any item starts, so a wrong key, a wrong type or an
unreadable notebook refuses the whole batch with one :class:`ConfigError`.
"""

from __future__ import annotations

import ast
import hashlib
import itertools
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rapydli.errors import ConfigError

_TYPES: dict[str, tuple[type, ...]] = {
    "int": (int,),
    "float": (int, float),
    "str": (str,),
    "bool": (bool,),
    "list": (list,),
    "dict": (dict,),
}


def parse_value(text: str) -> Any:
    """A grid value from the command line: JSON (numbers, true/false/null, lists) or a plain string."""
    text = text.strip()
    try:
        return json.loads(text)
    except ValueError:
        return text


def split_values(text: str) -> list[str]:
    """Split ``v1,v2`` at top-level commas (commas inside ``[]``, ``{}`` or quotes stay)."""
    parts: list[str] = []
    depth, quote, current = 0, "", list[str]()
    for char in text:
        if quote:
            quote = "" if char == quote else quote
        elif char in "\"'":
            quote = char
        elif char in "[{":
            depth += 1
        elif char in "]}":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append("".join(current))
            current = []
            continue
        current.append(char)
    parts.append("".join(current))
    return parts


def parse_grid(items: Sequence[str]) -> dict[str, list[Any]]:
    """``["lr=0.1,0.01", "workers=1,2"]`` -> ``{"lr": [0.1, 0.01], "workers": [1, 2]}``."""
    grid: dict[str, list[Any]] = {}
    for item in items:
        key, sep, values = item.partition("=")
        key = key.strip()
        if not sep or not key.isidentifier():
            raise ConfigError(f"--grid expects key=v1,v2,... with a parameter name as key; got {item!r}")
        if key in grid:
            raise ConfigError(f"--grid names {key!r} twice")
        parsed = [parse_value(v) for v in split_values(values) if v.strip()]
        if not parsed:
            raise ConfigError(f"--grid {key}= has no values")
        grid[key] = parsed
    return grid


def load_params_file(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Points from a YAML/JSON file.

    A mapping expands like ``--grid``: a list value is an axis, any other value is fixed
    (write ``[[1, 2]]`` to pass the list ``[1, 2]`` itself). A list of mappings gives the
    points one by one.
    """
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"--params-file {path}: cannot read it: {exc}") from exc
    if isinstance(data, Mapping):
        axes = {str(k): (v if isinstance(v, list) else [v]) for k, v in data.items()}
        return expand(axes)
    if isinstance(data, list) and all(isinstance(p, Mapping) for p in data):
        return [dict(p) for p in data]
    raise ConfigError(f"--params-file {path}: expected a mapping of parameter -> value(s) or a list of mappings")


def expand(grid: Mapping[str, Sequence[Any]], base: Sequence[Mapping[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Cartesian product of the grid axes, for each base point (default: one empty point)."""
    points = [dict(p) for p in (base or [{}])]
    keys = list(grid)
    out = []
    for point in points:
        overlap = set(point) & set(keys)
        if overlap:
            raise ConfigError(f"parameter(s) {', '.join(sorted(overlap))} given in both --params-file and --grid")
        for combo in itertools.product(*(grid[k] for k in keys)):
            out.append({**point, **dict(zip(keys, combo))})
    return out


def read_notebook(path: str | os.PathLike[str]) -> Any:
    """The notebook node; ConfigError when it is missing or not a notebook."""
    import nbformat

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"notebook {path} does not exist")
    try:
        return nbformat.read(path, as_version=4)
    except Exception as exc:  # nbformat raises several unrelated types for bad files
        raise ConfigError(f"notebook {path} is unreadable: {exc}") from exc


def kernel_for(nb: Any, kernel: str | None = None) -> tuple[str, str]:
    """The kernel a notebook runs with and its language: ``(kernel name, language)``.

    ``kernel`` if given, else the notebook's kernelspec, else this environment's Python
    kernel (``python3``: jupyter_client runs it with the Python that runs the batch item),
    so a notebook written by nbformat, jupytext or an editor, with no kernel metadata,
    runs. The language is the notebook's, else the kernel's.
    """
    from jupyter_client.kernelspec import NATIVE_KERNEL_NAME, KernelSpecManager, NoSuchKernel

    name = kernel or nb.metadata.get("kernelspec", {}).get("name") or NATIVE_KERNEL_NAME
    language = nb.metadata.get("language_info", {}).get("name") or nb.metadata.get("kernelspec", {}).get("language")
    if not language:
        try:
            language = KernelSpecManager().get_kernel_spec(name).language
        except NoSuchKernel:
            raise ConfigError(f"kernel {name!r} named by the notebook is not installed; pass --kernel") from None
    return name, language


def notebook_parameters(path: str | os.PathLike[str], kernel: str | None = None) -> dict[str, dict[str, Any]] | None:
    """The ``parameters`` cell's names with their default and expected type, via papermill's translator.

    Returns ``{name: {"default": value or None, "type": "int"|"float"|...|None, "text": source}}``,
    or ``None`` when no cell is tagged ``parameters`` (papermill then injects the
    parameters at the top of the notebook, and nothing can be checked).
    """
    from papermill.translators import papermill_translators

    nb = read_notebook(path)
    cells = [cell for cell in nb.cells if "parameters" in cell.get("metadata", {}).get("tags", [])]
    if not cells:
        return None
    translator = papermill_translators.find_translator(*kernel_for(nb, kernel))
    params = {}
    for info in translator.inspect(cells[0]):
        name, text = info.name, info.default
        try:
            default = ast.literal_eval(text) if text is not None else None
        except (ValueError, SyntaxError):
            default = None  # an expression (e.g. a call): its type is unknown
            kind = None
        else:
            kind = _type_name(default)
        declared = (info.inferred_type_name or "None").strip()
        if declared in _TYPES:
            kind = declared
        params[name] = {"default": default, "type": kind, "text": text}
    return params


def _type_name(value: Any) -> str | None:
    for name, types in (
        ("bool", (bool,)),
        ("int", (int,)),
        ("float", (float,)),
        ("str", (str,)),
        ("list", (list, tuple)),
        ("dict", (dict,)),
    ):
        if isinstance(value, types):
            return name
    return None


def validate(
    points: Sequence[Mapping[str, Any]], params: Mapping[str, Mapping[str, Any]] | None, notebook: str
) -> list[dict[str, Any]]:
    """Check every key is a parameter of the notebook and every value has its default's type.

    Returns the points with integers given for float parameters turned into floats (so
    ``lr=1`` and ``lr=1.0`` are the same item). With ``params`` ``None`` (the notebook has
    no ``parameters`` cell) there is nothing to check against and the points are returned as given.
    """
    if params is None:
        return [dict(point) for point in points]
    checked = []
    for point in points:
        out = {}
        for key, value in point.items():
            if key not in params:
                allowed = ", ".join(sorted(params)) or "(none)"
                raise ConfigError(f"{key!r} is not a parameter of {notebook}; its parameters are: {allowed}")
            kind = params[key]["type"]
            if kind is not None:
                ok = isinstance(value, _TYPES[kind]) and not (kind in ("int", "float") and isinstance(value, bool))
                if not ok:
                    raise ConfigError(
                        f"parameter {key!r} of {notebook} expects {kind} (default {params[key]['text']}); "
                        f"got {value!r} ({type(value).__name__})"
                    )
                if kind == "float":
                    value = float(value)
            out[key] = value
        checked.append(out)
    return checked


def param_hash(point: Mapping[str, Any]) -> str:
    """Short stable hash of a parameter point (the item's file name)."""
    text = json.dumps(dict(point), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:10]


def notebook_hash(path: str | os.PathLike[str]) -> str:
    """Hash of the notebook's cell types and sources (outputs and metadata do not count)."""
    nb = read_notebook(path)
    digest = hashlib.sha256()
    for cell in nb.cells:
        digest.update(cell.cell_type.encode() + b"\0" + cell.source.encode() + b"\0")
    return digest.hexdigest()[:16]

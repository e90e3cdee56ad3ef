"""What a run records of the user's code: importable names, or the notebook's source.

A function or class from a module is recorded as ``"module:qualname"`` (a repeat imports it
back). One defined in the notebook (``__main__``) cannot be imported again, so its source
is recorded instead, with the source of the notebook-defined classes and functions it uses
(``Net`` for a ``model_fn`` that returns ``Net()``), for ``rapydli runs show`` to display.
The source comes from :mod:`linecache`, where IPython keeps every executed cell; on
Python 3.11 ``inspect.getsource`` cannot find a notebook class, so a class is found by
name in the cell its methods were compiled from.

:func:`run_sources` gives a recorded run's code for display (the panel's Source section):
the notebook sources, and the source of each ``"module:qualname"`` it names, read from the
module's file without importing it.
"""

from __future__ import annotations

import ast
import inspect
import linecache
import textwrap
import types
from collections.abc import Mapping
from importlib.machinery import PathFinder
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from rapydli.experiments.store.refs import callable_ref

#: Notebook-defined names followed from a function to what it uses (bounds the walk).
MAX_SOURCES = 20
#: Run parameters that may name code as ``"module:qualname"``, in the order they are shown.
CODE_PARAMS = ("model_fn", "data_fn", "loss_fn", "optimizer_fn")


def code_params(model: Any, data: Any, code: Mapping[str, Any]) -> dict[str, Any]:
    """Run parameters for ``loss_fn``/``optimizer_fn``/``metrics`` and the notebook sources of all of them.

    ``model`` and ``data`` are recorded by the caller (as ``model_fn``/``data_fn``); their
    notebook source, if any, is included here under ``"sources"``.
    """
    params: dict[str, Any] = {}
    for key in ("loss_fn", "optimizer_fn"):
        if code.get(key) is not None:
            params[key] = describe(code[key])
    metrics = code.get("metrics")
    if metrics is not None:
        items = (
            metrics.items()
            if isinstance(metrics, Mapping)
            else [(None, m) for m in ([metrics] if isinstance(metrics, str) else metrics)]
        )
        params["metrics"] = [m if isinstance(m, str) else (f"{n}=" if n else "") + describe(m) for n, m in items]
    roots = [model, data, code.get("loss_fn"), code.get("optimizer_fn")]
    if metrics is not None and not isinstance(metrics, str):
        roots += [m for m in (metrics.values() if isinstance(metrics, Mapping) else metrics) if callable(m)]
    sources = notebook_sources([r for r in roots if r is not None])
    if sources:
        params["sources"] = sources
    return params


def describe(obj: Any) -> str:
    """``"module:qualname"`` when importable, else a readable name (``"<notebook> loss"``, ``MSELoss()``)."""
    ref = callable_ref(obj)
    if ref is not None:
        return ref
    if isinstance(obj, (types.FunctionType, type)):
        where = "<notebook>" if getattr(obj, "__module__", None) == "__main__" else getattr(obj, "__module__", "?")
        return f"{where} {obj.__qualname__}"
    return repr(obj) if len(repr(obj)) < 200 else type(obj).__qualname__ + "(...)"


def notebook_sources(roots: list[Any]) -> dict[str, str]:
    """``{qualname: source}`` of the notebook-defined objects among ``roots`` and those they use."""
    found: dict[str, str] = {}
    pending = [_definition(r) for r in roots]
    seen: set[int] = set()
    while pending and len(found) < MAX_SOURCES:
        obj = pending.pop(0)
        if obj is None or id(obj) in seen or getattr(obj, "__module__", None) != "__main__":
            continue
        seen.add(id(obj))
        source = source_of(obj)
        if source is None:
            continue
        found[obj.__qualname__] = source
        pending.extend(_uses(obj))
    return found


def _definition(obj: Any) -> Any:
    """The function or class that defines ``obj`` (an instance's class)."""
    if isinstance(obj, (types.FunctionType, type)):
        return obj
    if isinstance(obj, types.MethodType):
        return obj.__func__
    return type(obj)


def _uses(obj: Any) -> list[Any]:
    """What a function (or a class's methods) refers to: globals, closures, defaults, annotations."""
    functions = (
        [obj]
        if isinstance(obj, types.FunctionType)
        else [v for v in vars(obj).values() if isinstance(v, types.FunctionType)]
    )
    used = []
    for fn in functions:
        names = set(fn.__code__.co_names) | {
            n for c in fn.__code__.co_consts if isinstance(c, types.CodeType) for n in c.co_names
        }
        used += [fn.__globals__[n] for n in sorted(names) if n in fn.__globals__]
        used += [cell.cell_contents for cell in fn.__closure__ or () if _filled(cell)]
        used += [*(fn.__defaults__ or ()), *(fn.__kwdefaults__ or {}).values(), *fn.__annotations__.values()]
    if isinstance(obj, type):
        used += list(obj.__bases__)
    return [d for d in map(_definition, used) if isinstance(d, (types.FunctionType, type))]


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
    except ValueError:
        return False
    return True


def source_of(obj: Any) -> str | None:
    """The source of a function or class, also when it was defined in a notebook cell."""
    try:
        return textwrap.dedent(inspect.getsource(obj))
    except (OSError, TypeError):
        pass
    if not isinstance(obj, type):
        return None
    # a class: find it in the cell one of its methods came from, else (a dataclass's methods come
    # from "<string>") the newest cell that defines a class of that name at its top level
    for member in vars(obj).values():
        code = getattr(member, "__code__", None)
        if code is not None:
            found = _class_in(code.co_filename, obj.__name__, code.co_firstlineno)
            if found is not None:
                return found
    for name in reversed(_cell_names()):
        found = _class_in(name, obj.__name__, None)
        if found is not None:
            return found
    return None


def _cell_names() -> list[str]:
    """File names of the notebook cells in :mod:`linecache` (entries without a file), oldest first."""
    return [name for name, entry in list(linecache.cache.items()) if len(entry) == 4 and entry[1] is None]


def _class_in(filename: str, name: str, line: int | None) -> str | None:
    """The source of class ``name`` in ``filename`` (the one around ``line``; else a top-level one)."""
    lines = linecache.getlines(filename)
    try:
        tree = ast.parse("".join(lines))
    except (SyntaxError, ValueError):
        return None
    nodes = ast.walk(tree) if line is not None else iter(tree.body)
    for node in nodes:
        if (
            isinstance(node, ast.ClassDef)
            and node.name == name
            and (line is None or node.lineno <= line <= (node.end_lineno or 0))
        ):
            start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            return textwrap.dedent("".join(lines[start - 1 : node.end_lineno]))
    return None


def run_sources(params: Mapping[str, Any], cwd: str | None = None) -> list[dict[str, Any]]:
    """The code a recorded run names, for display: first the notebook's own, then what it imports.

    Parameters
    ----------
    params
        The run's recorded parameters (``model_fn``, ``data_fn``, ... and ``sources``).
    cwd
        The directory the run ran in: its modules are looked for there too.

    Returns
    -------
    list of dict
        ``name``, ``origin`` (``module`` or ``notebook``), ``source``; a module's also
        ``role`` (the parameter naming it), ``ref``, ``file`` and ``line``.
    """
    notebook = params.get("sources")
    found: list[dict[str, Any]] = [
        {"name": str(name), "origin": "notebook", "source": text}
        for name, text in (notebook.items() if isinstance(notebook, Mapping) else ())
        if isinstance(text, str)
    ]
    for role in CODE_PARAMS:
        ref = params.get(role)
        if isinstance(ref, str) and ref.count(":") == 1:
            located = module_source(ref, cwd)
            if located is not None:
                found.append({"name": ref.split(":")[1], "origin": "module", "role": role, "ref": ref, **located})
    return found


def module_source(ref: str, cwd: str | None = None) -> dict[str, Any] | None:
    """``{"file", "line", "source"}`` of the function or class ``"module:qualname"`` names.

    The module's file is found as ``import`` would find it (or under ``cwd``) and parsed,
    never imported: nothing of it runs. None when it cannot be found.
    """
    module, _, qualname = ref.partition(":")
    file = _module_file(module, cwd)
    if file is None:
        return None
    try:
        text = file.read_text()
        nodes: list[ast.stmt] = ast.parse(text).body
    except (OSError, SyntaxError, ValueError):
        return None
    node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | None = None
    for part in qualname.split("."):
        node = next(
            (
                n
                for n in nodes
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.name == part
            ),
            None,
        )
        if node is None:
            return None
        nodes = node.body
    assert node is not None
    start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
    lines = text.splitlines(keepends=True)[start - 1 : node.end_lineno]
    return {"file": str(file), "line": start, "source": textwrap.dedent("".join(lines))}


def _module_file(module: str, cwd: str | None) -> Path | None:
    """The ``.py`` file of ``module``: its top package as ``import`` finds it (else under ``cwd``),
    then each submodule in its parent's folders; no module is imported."""
    parts = module.split(".")
    try:
        spec = find_spec(parts[0])  # a top-level name: looked up, not imported
    except (ImportError, ValueError):
        spec = None
    if spec is None and cwd:
        spec = PathFinder.find_spec(parts[0], [cwd])
    for depth in range(1, len(parts)):
        if spec is None or not spec.submodule_search_locations:
            return None
        spec = PathFinder.find_spec(".".join(parts[: depth + 1]), list(spec.submodule_search_locations))
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return None
    return Path(spec.origin)

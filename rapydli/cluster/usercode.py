"""Code defined in the notebook, on the engines: classes intact, cells' lines in tracebacks.

Three things make notebook-defined code (``__main__``) behave on an engine as it does in the
notebook:

* **Classes are pickled by cloudpickle alone.** ipyparallel "cans" a ``__main__`` class
  passed as an argument (``rd.train(Net, ...)``, ``cluster.push({"Net": Net})``) by
  rebuilding it on the engine with ``type(name, bases, dict)``, and
  ``view.use_cloudpickle()`` leaves that in place (it only stops canning functions). The
  methods, pickled by cloudpickle, keep a ``__class__`` cell that points to cloudpickle's
  copy of the class, so ``super().__init__()`` meets an instance of the *other* copy:
  ``TypeError: super(type, obj): obj must be an instance or subtype of type``.
  :func:`pickle_classes_by_value` drops that canning on the client and the engines, so
  cloudpickle rebuilds the class and its methods together (and, by its class tracker,
  as the same class object on every call).
* **The cells' source travels with the task.** A function from a notebook cell keeps the
  cell's file name (``/tmp/ipykernel_.../123.py`` or ``<ipython-input-...>``): cloudpickle
  (3.1 and later) writes ``<dynamic-code>`` in its place, so :func:`pickle_classes_by_value`
  has it write the real name. The cell's lines IPython keeps only in the notebook's
  :mod:`linecache`; :func:`notebook_cells` collects them on the client and
  :func:`register_cells` puts them in the engine's :mod:`linecache`, so a traceback from
  an engine shows the cell's lines.
* **The user's frames come first** in a failure's text (:func:`user_frames_first`); the
  notebook shows them alone (:func:`condensed`), its cells named as IPython names them
  (:func:`cells_named`: ``Cell In[5], line 3``).
"""

from __future__ import annotations

import linecache
import os
import re
import sys
import sysconfig
from collections.abc import Mapping
from typing import Any

#: At most this many characters of cell source go with one task (the newest cells first).
MAX_CELL_CHARS = 2_000_000


def pickle_classes_by_value() -> None:
    """Let cloudpickle, not ipyparallel's ``CannedClass``, carry ``__main__`` classes, and keep
    the file names of the code it pickles (idempotent)."""
    import types

    from cloudpickle import cloudpickle
    from ipyparallel.serialize import canning

    canning.can_map.pop(type, None)
    table = cloudpickle.Pickler._dispatch_table
    if not getattr(table[types.CodeType], "keeps_file_names", False):
        table[types.CodeType] = _file_name_kept(table[types.CodeType])


def _file_name_kept(reduce_code: Any) -> Any:
    """cloudpickle's code reducer, with the code's own file name where it writes ``<dynamic-code>``."""

    def reduce(code: Any) -> Any:
        rebuild, args = reduce_code(code)
        return rebuild, tuple(code.co_filename if arg == _DYNAMIC else arg for arg in args)

    reduce.keeps_file_names = True  # type: ignore[attr-defined]
    return reduce


_DYNAMIC = "<dynamic-code>"


def notebook_cells() -> dict[str, list[str]]:
    """``{file name: lines}`` of the notebook cells this process ran (empty outside IPython).

    Cells are the :mod:`linecache` entries IPython registered without a file behind them
    (``mtime`` is ``None``); the newest are kept up to :data:`MAX_CELL_CHARS`.
    """
    cells: dict[str, list[str]] = {}
    size = 0
    for name, cached in reversed(list(linecache.cache.items())):
        entry: Any = cached
        if len(entry) != 4 or entry[1] is not None or not entry[2]:
            continue
        if name.startswith("<") and not name.startswith("<ipython-input-"):
            continue
        if not name.startswith("<") and os.path.exists(name):
            continue
        size += sum(len(line) for line in entry[2])
        if size > MAX_CELL_CHARS:
            break
        cells[name] = list(entry[2])
    return cells


def register_cells(cells: Mapping[str, list[str]] | None) -> None:
    """Make the notebook's cells readable to :mod:`linecache` on this engine (for tracebacks)."""
    for name, lines in (cells or {}).items():
        cached: Any = linecache.cache.get(name)
        if cached is None or len(cached) != 4 or cached[1] is None:  # never shadow a real file's entry
            linecache.cache[name] = (sum(len(line) for line in lines), None, list(lines), name)


# -- failure text --------------------------------------------------------------------------

_FRAME = re.compile(r'^(?:File |  File ")([^",:]+)')
_LIBRARY_ROOTS = tuple(
    os.path.realpath(p) + os.sep
    for p in {sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
)
_OURS = os.path.dirname(os.path.dirname(os.path.realpath(__file__))) + os.sep


def is_user_file(path: str) -> bool:
    """True for a frame in the user's code: a notebook cell or a file outside RaPyDLI, Python and site-packages."""
    if path.startswith("<"):
        return path.startswith(("<ipython-input-", "<distributed cell>"))
    real = os.path.realpath(path)
    return (
        not real.startswith((_OURS, *_LIBRARY_ROOTS))
        and "site-packages" not in real.split(os.sep)
        and real != sys.executable
    )


def user_frames_first(text: str) -> str:
    """A remote traceback with the blocks of the user's own frames repeated at the top.

    ``text`` is the engine's traceback (blocks separated by blank lines, one per frame, the
    exception last). When it has frames in the user's code and frames elsewhere
    (RaPyDLI, torch), those of the user's code are put first under a heading, and the
    whole traceback follows unchanged.
    """
    blocks = text.split("\n\n")
    frames = [(b, _FRAME.match(b.lstrip("\n"))) for b in blocks]
    user = [b for b, m in frames if m is not None and is_user_file(m.group(1))]
    others = [b for b, m in frames if m is not None and not is_user_file(m.group(1))]
    if not user or not others:
        return text
    exception = blocks[-1].strip().splitlines()[-1] if blocks else ""
    return "in your code (innermost last):\n\n" + "\n\n".join(user) + f"\n\n{exception}\n\nfull traceback:\n" + text


#: What a condensed failure says in place of the frames it folds away.
FOLDED = "({count} frame{s} of RaPyDLI and libraries folded away: failure.details() shows every rank's whole traceback)"
_CELL_FRAME = re.compile(r"File (\S+?):(\d+)(?=, in )")


def condensed(text: str) -> str:
    """A rank's failure as a user reads it: the frames in the user's code and the exception, the rest folded.

    ``text`` is what :func:`user_frames_first` made; one without frames of the user's (a
    failure inside RaPyDLI or a library, a rank that died) is kept whole.
    """
    head, sep, full = text.partition("\n\nfull traceback:\n")
    if not sep or not head.startswith("in your code"):
        return text
    files = [m.group(1) for m in (_FRAME.match(b.lstrip("\n")) for b in full.split("\n\n")) if m is not None]
    folded = sum(1 for f in files if not is_user_file(f))
    return f"{head}\n\n{FOLDED.format(count=folded, s='' if folded == 1 else 's')}" if folded else head


def cells_named(text: str) -> str:
    """``text`` with the notebook's cell files named as IPython names them: ``Cell In[5], line 3`` for
    ``File /tmp/ipykernel_1234/2081.py:3`` (unchanged outside IPython, or for a file that is no cell of it)."""
    try:
        from IPython import get_ipython
    except ImportError:  # pragma: no cover - IPython is a dependency
        return text
    shell = get_ipython()
    name_of = getattr(getattr(shell, "compile", None), "format_code_name", None)
    if name_of is None:
        return text

    def named(match: re.Match[str]) -> str:
        found = name_of(match.group(1))
        return f"{found[0]} {found[1]}, line {match.group(2)}" if found else match.group(0)

    return _CELL_FRAME.sub(named, text)

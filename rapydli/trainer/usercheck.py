"""Mistakes in the user's functions, named once and up front instead of deep in every rank's traceback.

On the ranks, :func:`check_data` reads what ``data_fn()`` returned before anything is
built on it; the model's output is read by :func:`rapydli.trainer.outputs.interpret`,
which raises :class:`~rapydli.trainer.outputs.OutputError` at the first step. Every rank
runs the same code, so every rank fails alike: on the client, :func:`same_mistake` turns
such a :class:`~rapydli.errors.RankFailure` into one short error of the same kind, naming
the user's function and the fix, with the user's frames.

Examples
--------
>>> check_data(([1, 2], [3]), "make_data")
([1, 2], [3])
>>> try:
...     check_data(range(4), "make_data")
... except UserCodeError as exc:
...     print(str(exc).split(";")[0])
data_fn make_data returned a range of 4 samples
"""

from __future__ import annotations

import re
from typing import Any

from rapydli.errors import ConfigError, RankFailure, RapydliError, UserCodeError

#: The errors that name a mistake in the user's code: the same on every rank, so shown once.
USER_MISTAKES = ("UserCodeError", "OutputError", "ConfigError")


def describe(value: Any) -> str:
    """What a user's function returned, in a few words (its type, and its length when it has one)."""
    kind = type(value).__name__
    article = "an" if kind[:1].lower() in "aeiou" else "a"
    try:
        size = len(value)
    except TypeError:  # also a len() that raises TypeError: no length to show
        return f"{article} {kind}"
    if isinstance(value, (tuple, list)):
        return f"{article} {kind} of {size} item{'s' if size != 1 else ''}"
    return f"{article} {kind} of {size} sample{'s' if size != 1 else ''}"


def name_of(fn: Any) -> str:
    """How an error names the user's function: its qualified name (``module:name`` outside ``__main__``)."""
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__
    module = getattr(fn, "__module__", None)
    return f"{module}:{name}" if module and module != "__main__" else str(name)


def check_data(result: Any, name: str) -> tuple[Any, Any]:
    """``(train, val)`` from what ``data_fn()`` (called ``name``) returned, or one :class:`UserCodeError`.

    ``train`` must be a dataset (``len`` and indexing: RaPyDLI shards and batches it
    itself, so not a ``DataLoader``); ``val`` a dataset or ``None``.
    """
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        raise UserCodeError(
            f"data_fn {name} returned {describe(result)}; it must return (train, val): two datasets "
            "(val may be None), e.g. `return train_set, val_set`"
        )
    for role, data in zip(("train", "val"), result):
        if data is None and role == "val":
            continue
        if not (hasattr(data, "__len__") and hasattr(data, "__getitem__")):
            hint = (
                " (a DataLoader: return its .dataset; RaPyDLI shards and batches it)"
                if hasattr(data, "batch_size")
                else ""
            )
            raise UserCodeError(
                f"data_fn {name} returned {describe(data)} as its {role} set{hint}; "
                "each must be a dataset with len() and indexing, e.g. a TensorDataset"
            )
    return result[0], result[1]


#: Where a remote traceback's exception starts: ``ErrorName: message`` at a line's start (the module path may prefix it).
_RAISED = re.compile(r"^(?:[\w.]+\.)?(" + "|".join(USER_MISTAKES) + r"): ", re.MULTILINE)


def same_mistake(failure: RankFailure) -> RapydliError | None:
    """One short error for a failure that is the same mistake of the user's code on every failing rank.

    ``None`` when the ranks failed otherwise (a process died, different errors, RaPyDLI's
    own bug): then the :class:`RankFailure` itself is the error to show.
    """
    from rapydli.trainer.outputs import OutputError

    if failure.died or not failure.failures:
        return None
    found = set()
    for text in failure.failures.values():
        raised = list(_RAISED.finditer(text))
        if not raised:
            return None
        last = raised[-1]  # the exception of the traceback (its message may span lines)
        found.add((last.group(1), text[last.end() :].rstrip()))
    if len(found) != 1:
        return None
    ename, message = found.pop()
    first = failure.failures[min(failure.failures)]
    frames = _user_frames(first)
    text = message + (f"\n\n{frames}" if frames else "")
    kinds: dict[str, type[RapydliError]] = {
        "OutputError": OutputError,
        "ConfigError": ConfigError,
        "UserCodeError": UserCodeError,
    }
    return kinds[ename](text)


def _user_frames(text: str) -> str:
    """The user's frames that :func:`rapydli.cluster.usercode.user_frames_first` put first (empty if none)."""
    head, sep, _ = text.partition("\n\nfull traceback:\n")
    if not sep or not head.startswith("in your code"):
        return ""
    blocks = head.split("\n\n")
    return "\n\n".join(blocks[:-1])  # the frames; the exception line is the message already

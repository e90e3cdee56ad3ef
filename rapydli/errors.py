"""The exceptions and warnings RaPyDLI raises.

Every error derives from :class:`RapydliError`, so a caller can catch all of them at
once; the subclasses are the ones callers catch on their own.
"""

from __future__ import annotations


class RapydliError(Exception):
    """Base class of every error raised by RaPyDLI."""


class ConfigError(RapydliError, ValueError):
    """A configuration value is invalid; raised before any process starts.

    The message names the field and the allowed values or range.
    """


class UserCodeError(ConfigError, TypeError):
    """A function of the user's (``data_fn``, ``model_fn``, ...) returned what RaPyDLI cannot use.

    The message names the function, what it returned and what is expected instead.
    """


class ClusterError(RapydliError):
    """A cluster could not be started, reached, or is in the wrong state."""


class RankFailure(RapydliError):
    """Code failed on one or more MPI ranks.

    Parameters
    ----------
    message
        Summary naming the failing rank(s).
    failures
        Mapping of rank to the remote traceback text (or the reason a rank died).
    died
        True when the failing ranks' processes died (killed, segfault, ``os._exit``, their
        host or job gone) rather than raising an exception in the user's code: a run with
        restarts left may go on from its checkpoint after such a failure, never after an
        exception.
    """

    def __init__(self, message: str, failures: dict[int, str] | None = None, died: bool = False) -> None:
        super().__init__(message)
        self.failures: dict[int, str] = dict(failures or {})
        self.died = died

    @property
    def ranks(self) -> list[int]:
        """The failing ranks, sorted."""
        return sorted(self.failures)

    def details(self) -> str:
        """Every failing rank's whole traceback (the message shows the user's frames, once for ranks that failed alike)."""
        return "\n".join(f"--- rank {rank} ---\n{text}" for rank, text in sorted(self.failures.items()))

    def _render_traceback_(self) -> list[str]:
        """IPython shows the ranks' tracebacks, not the client-side frames that re-raised them."""
        return [f"RankFailure: {line}" if i == 0 else line for i, line in enumerate(str(self).splitlines())]


class StoreError(RapydliError):
    """The run store could not be read or written, or a run id is unknown."""


class NotFoundError(RapydliError, KeyError):
    """A named thing (run, sweep, cluster) does not exist."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else ""


class DataError(RapydliError):
    """A sample store is corrupt, truncated, or does not match its schema."""


class RapydliWarning(UserWarning):
    """Warnings RaPyDLI emits (the test suite turns them into errors)."""

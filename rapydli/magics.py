"""IPython magics: ``%rapydli start|stop|status|restart`` and ``%%distributed``.

``%load_ext rapydli`` registers them. They are thin: parsing and display here, clusters
and failure handling in :mod:`rapydli.cluster`.
"""

from __future__ import annotations

import json
import os
import sys
from collections import defaultdict
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from rapydli.cluster import Cluster, choose_cluster, current, parse_targets
from rapydli.cluster.job import print_output
from rapydli.errors import ConfigError


def _strip_comment(line: str) -> str:
    """``line`` without a trailing ``# comment``: a ``#`` outside quotes, at the start or after a space."""
    quote = ""
    for index, char in enumerate(line):
        if quote:
            quote = "" if char == quote else quote
        elif char in "\"'":
            quote = char
        elif char == "#" and (index == 0 or line[index - 1].isspace()):
            return line[:index].rstrip()
    return line


def _parse(magic: Any, line: str) -> Any:
    """``parse_argstring`` (after a trailing comment is dropped) whose errors carry the magic's usage (and run nothing)."""
    try:
        return parse_argstring(magic, _strip_comment(line))
    except UsageError as exc:
        raise UsageError(f"{exc}\n{magic.parser.format_usage()}") from None


def _option_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _launcher_options(items: list[str]) -> dict[str, Any]:
    options = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"launcher option {item!r} is not key=value")
        options[key] = _option_value(value)
    return options


@magics_class
class RapydliMagics(Magics):
    """The notebook's connection to its MPI engines."""

    def __init__(self, shell: Any) -> None:
        super().__init__(shell)
        self._cluster: Cluster | None = None

    # -- cluster management --------------------------------------------------------------

    @property
    def cluster(self) -> Cluster | None:
        """The notebook's cluster: the one started here, else any running in this kernel."""
        if self._cluster is None:
            self._cluster = current()
        return self._cluster

    def _start(self, n: int, launcher: str = "local", options: dict[str, Any] | None = None) -> Cluster:
        cluster = self.cluster
        if cluster is not None and cluster.status()["state"] in ("running", "degraded", "dead"):
            if cluster.n == n and cluster.launcher.name == launcher and not options:
                print(f"[rapydli] reusing the running cluster of {n} engines")
                return cluster
            raise UsageError(
                f"a cluster of {cluster.n} engines ({cluster.launcher.name}) is already running in this kernel: "
                "`%rapydli stop` it first, or `%rapydli restart` it"
            )
        try:
            cluster = Cluster(n=n, launcher=launcher, **(options or {}))
        except ConfigError as exc:
            raise UsageError(str(exc)) from None
        print(f"[rapydli] starting {n} MPI engines ({launcher}, {cluster.threads} thread(s) each) ...", flush=True)
        cluster.start()
        self._cluster = cluster
        return cluster

    @line_magic
    @magic_arguments()
    @argument("action", choices=["start", "stop", "status", "restart"], help="what to do with the cluster")
    @argument("-n", type=int, default=None, help="number of engines (MPI ranks) for start")
    @argument("--launcher", default="local", help="local, ssh, slurm or pbs")
    @argument("options", nargs="*", help="launcher options as key=value")
    def rapydli(self, line: str) -> Any:
        """Manage the notebook's MPI cluster: ``%rapydli start [-n N] [--launcher L] [key=value ...]``."""
        args = _parse(self.rapydli, line)
        if args.n is not None and args.n < 1:
            raise UsageError(f"-n {args.n} is invalid: must be >= 1")
        if args.action == "start":
            cluster = self._start(args.n or os.cpu_count() or 1, args.launcher, _launcher_options(args.options))
            return cluster.status()
        cluster = self.cluster
        if cluster is None:
            if args.action == "status":
                return {"state": "stopped"}
            raise UsageError(f"no cluster to {args.action}: `%rapydli start -n N` first")
        if args.action == "stop":
            cluster.stop()
            self._cluster = None
            print("[rapydli] cluster stopped")
            return None
        if args.action == "restart":
            print(f"[rapydli] restarting {cluster.n} engines ...", flush=True)
            cluster.restart()
        return cluster.status()

    # -- %%distributed -------------------------------------------------------------------

    @cell_magic
    @magic_arguments()
    @argument("-n", type=int, default=None, help="ranks to run on (starts a cluster of N if none runs)")
    @argument("--targets", default=None, help="ranks to run on, e.g. 0,2-3; rank/world_size then count within them")
    @argument("--timeout", type=float, default=None, help="seconds before the cell is interrupted on every rank")
    @argument("--push", default=None, help="comma-separated notebook variables to send first")
    @argument("--gather", action="store_true", help="return a list of every rank's value")
    @argument("--no-stream", action="store_true", help="print output when the cell ends, grouped by rank")
    def distributed(self, line: str, cell: str) -> Any:
        """Run the cell on every MPI rank with ``rank``, ``world_size``, ``world_rank``, ``comm``, ``device`` defined.

        With ``--targets`` the selected ranks form a group of their own: ``rank`` and
        ``world_size`` count within the group (``--targets 1,3`` runs as ``rank`` 0 and 1 of
        ``world_size`` 2) and ``comm`` spans only them; ``world_rank`` is the rank in the
        whole cluster. Without ``--targets``, ``rank == world_rank``.

        Output is streamed with a ``[rank r]`` prefix (``r`` is the ``world_rank``); rich
        output is shown from the first rank only; the value is the first rank's last expression (a list by rank with
        ``--gather``). An exception or a dead engine on any rank interrupts the others and
        raises one :class:`~rapydli.errors.RankFailure` naming the rank.
        """
        __tracebackhide__ = True  # noqa: F841 - IPython shows the user's cell, not these frames
        args = _parse(self.distributed, line)
        if args.timeout is not None and args.timeout <= 0:
            raise UsageError(f"--timeout {args.timeout:g} is invalid: must be > 0 seconds")
        if args.n is not None and args.n < 1:
            raise UsageError(f"-n {args.n} is invalid: must be >= 1")
        pushed = self._pushed(args.push)
        cluster = self._ensure(args.n)
        try:
            targets = parse_targets(args.targets, cluster.n) if args.targets else list(range(args.n or cluster.n))
        except ConfigError as exc:
            raise UsageError(str(exc)) from None
        if pushed:
            cluster.push(pushed, targets)
        buffered: dict[tuple[int, str], list[str]] = defaultdict(list)

        def hold(rank: int, stream: str, text: str) -> None:
            buffered[(rank, stream)].append(text)

        try:
            values = cluster.run_cell(
                cell,
                targets=targets,
                timeout=args.timeout,
                gather=args.gather,
                on_output=hold if args.no_stream else print_output,
                on_display=_display,
            )
        finally:
            for (rank, stream), lines in sorted(buffered.items()):
                print_output(rank, stream, "\n".join(lines))
        return values if args.gather else values[0]

    def _pushed(self, names: str | None) -> dict[str, Any]:
        if not names:
            return {}
        wanted = [n.strip() for n in names.split(",") if n.strip()]
        namespace = self.shell.user_ns if self.shell is not None else {}
        missing = [n for n in wanted if n not in namespace]
        if missing:
            raise UsageError(f"--push: {', '.join(missing)} not defined in the notebook")
        return {n: namespace[n] for n in wanted}

    def _ensure(self, n: int | None) -> Cluster:
        """The notebook's cluster (restarted if its engines died), else the one chosen by
        :func:`~rapydli.cluster.ensure.choose_cluster`: a new local one of ``n`` engines
        (default: one per core), which stays up for the next cells."""
        cluster = self.cluster
        if cluster is not None and cluster.status()["state"] not in ("stopped", "failed"):
            if not cluster.running:
                print(f"[rapydli] engines had died; restarting {cluster.n} fresh engines (their variables are gone)", flush=True)
                cluster.restart()
            if n is not None and n > cluster.n:
                raise UsageError(f"-n {n} is more than the running cluster's {cluster.n} engines: `%rapydli stop` and start more")
            return cluster
        try:
            cluster, _ = choose_cluster(None, n=n or os.cpu_count() or 1, need=n or 1, start=False)
        except ConfigError as exc:
            raise UsageError(str(exc)) from None
        if not cluster.running:
            print(f"[rapydli] starting {cluster.n} MPI engines (local, {cluster.threads} thread(s) each) ...", flush=True)
            cluster.start()
        self._cluster = cluster
        return cluster


def _display(content: dict[str, Any]) -> None:
    from IPython.display import publish_display_data

    publish_display_data(data=content.get("data", {}), metadata=content.get("metadata", {}))


def load_ipython_extension(ipython: Any) -> None:
    """Register the magics with ``ipython``; figures shown from now on also carry static HTML."""
    from rapydli.notebook import static_figures

    ipython.register_magics(RapydliMagics)
    static_figures()


def unload_ipython_extension(ipython: Any) -> None:
    """Stop the cluster the magics started."""
    magics = ipython.magics_manager.registry.get("RapydliMagics")
    if magics is not None and magics._cluster is not None:
        magics._cluster.stop()
        magics._cluster = None
    print("[rapydli] magics unloaded", file=sys.stderr)

"""IPython magics: ``%rapydli start|stop|status|restart|where`` and ``%%distributed``.

``%load_ext rapydli`` registers them. They are thin: parsing and display here, clusters
and failure handling in :mod:`rapydli.cluster`.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from collections import defaultdict
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments

from rapydli.cluster import Cluster, choose_cluster, current, parse_targets, ready
from rapydli.cluster.hang import ACTIONS as HANG_ACTIONS
from rapydli.cluster.job import print_output
from rapydli.cluster.launchers import DEFAULT_LAUNCHER, LAUNCHERS
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
    """``parse_argstring`` whose errors carry the magic's usage (and run nothing).

    Options and positionals may be intermixed, so launcher options can follow flags
    (``start -n 4 --launcher slurm partition=debug``); quotes group words as in a shell
    (``setup="module load cuda"``), and a ``#`` that starts a word outside quotes starts a
    comment (``hosts=a#1`` keeps its ``#``).
    """
    try:
        return magic.parser.parse_intermixed_args(shlex.split(_strip_comment(line)))
    except ValueError as exc:  # shlex: an unclosed quote
        raise UsageError(f"cannot read {line!r}: {exc}\n{magic.parser.format_usage()}") from None
    except UsageError as exc:
        raise UsageError(f"{exc}\n{magic.parser.format_usage()}") from None


def _option_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _launcher_options(items: list[str]) -> dict[str, Any]:
    """``key=value`` items as options; a key given twice collects its values in a list
    (``setup="module load cuda" setup="source venv/bin/activate"``)."""
    options: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"launcher option {item!r} is not key=value")
        parsed = _option_value(value)
        if key in options:
            previous = options[key] if isinstance(options[key], list) else [options[key]]
            parsed = previous + (parsed if isinstance(parsed, list) else [parsed])
        options[key] = parsed
    return options


def _print_job(job: dict[str, Any]) -> None:
    reason = f" ({job['reason']})" if job.get("reason") not in ("", "None", None) else ""
    where = f" on {job['nodes']}" if job.get("nodes") else ""
    print(f"[rapydli] job {job['id']}: {job['state']}{reason}{where}", flush=True)


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

    def _start(
        self,
        n: int,
        launcher: str = DEFAULT_LAUNCHER,
        options: dict[str, Any] | None = None,
        timeout: float | None = None,
        wait: bool = True,
    ) -> Cluster:
        try:  # options are checked first: a mistake is named even while another cluster runs
            timing: dict[str, Any] = {"start_timeout": timeout} if timeout else {}
            candidate = Cluster(n=n, launcher=launcher, **(options or {}), **timing)
        except ConfigError as exc:
            raise UsageError(str(exc)) from None
        cluster = self.cluster
        if cluster is not None and cluster.status()["state"] in ("running", "degraded", "dead", "starting"):
            if cluster.n == n and cluster.launcher.name == launcher and not options:
                print(f"[rapydli] reusing the running cluster of {n} engines")
                return cluster
            raise UsageError(
                f"a cluster of {cluster.n} engines ({cluster.launcher.name}) is already running in this kernel: "
                "`%rapydli stop` it first, or `%rapydli restart` it"
            )
        cluster = candidate
        print(f"[rapydli] starting {n} MPI engines ({launcher}, {cluster.threads} thread(s) each) ...", flush=True)
        self._cluster = cluster  # `%rapydli status` shows a start that failed, with its job
        if not wait:
            cluster.start(wait=False)
            print(
                "[rapydli] submitted: `%rapydli status` shows the job, `%rapydli stop` cancels it; "
                "`%%distributed` waits for the engines",
                flush=True,
            )
            return cluster
        cluster.start(on_state=_print_job)
        return cluster

    @line_magic
    @magic_arguments()
    @argument("action", choices=["start", "stop", "status", "restart", "where"], help="what to do with the cluster")
    @argument("-n", type=int, default=None, help="number of engines (MPI ranks) for start")
    @argument("--launcher", default=DEFAULT_LAUNCHER, help=f"how the engines start: {', '.join(LAUNCHERS)}")
    @argument("--timeout", type=float, default=None, help="seconds to wait for the engines (a queued job is cancelled)")
    @argument("--no-wait", action="store_true", help="return once submitted; %%distributed waits for the engines")
    @argument("--all-threads", action="store_true", help="where: every thread of every rank, not only the task's")
    @argument("options", nargs="*", help="launcher options as key=value")
    def rapydli(self, line: str) -> Any:
        """Manage the notebook's MPI cluster: ``%rapydli start [-n N] [--launcher L] [--timeout S] [--no-wait] [key=value ...]``.

        ``%rapydli where [--all-threads]`` prints the Python stack of every rank, grouped
        where ranks agree (:meth:`Cluster.where`), also while they are blocked in MPI.
        """
        args = _parse(self.rapydli, line)
        if args.n is not None and args.n < 1:
            raise UsageError(f"-n {args.n} is invalid: must be >= 1")
        if args.action != "start" and (args.options or args.n is not None):
            raise UsageError(f"-n and launcher options belong to `%rapydli start`, not {args.action}")
        if args.timeout is not None and args.timeout <= 0:
            raise UsageError(f"--timeout {args.timeout:g} is invalid: must be > 0 seconds")
        if args.action == "start":
            options = _launcher_options(args.options)
            started = self._start(args.n or os.cpu_count() or 1, args.launcher, options, args.timeout, not args.no_wait)
            return started.status()
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
        if args.action == "where":
            print(cluster.where().text(all_threads=args.all_threads))
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
    @argument(
        "--hang-timeout",
        type=float,
        default=None,
        help="seconds no rank progresses before the cell counts as hung (default 60)",
    )
    @argument(
        "--on-hang",
        choices=list(HANG_ACTIONS),
        default="wait",
        help="when the cell hangs: print the diagnosis and keep waiting, or abort",
    )
    def distributed(self, line: str, cell: str) -> Any:
        """Run the cell on every MPI rank with ``rank``, ``world_size``, ``world_rank``, ``comm``, ``device`` defined.

        With ``--targets`` the selected ranks form a group of their own: ``rank`` and
        ``world_size`` count within the group (``--targets 1,3`` runs as ``rank`` 0 and 1 of
        ``world_size`` 2) and ``comm`` spans only them; ``world_rank`` is the rank in the
        whole cluster. Without ``--targets``, ``rank == world_rank``.

        Output is streamed with a ``[rank r]`` prefix (``r`` is the ``world_rank``); rich
        output is shown from the first rank only; the value is the first rank's last expression (a list by rank with
        ``--gather``). An exception or a dead engine on any rank interrupts the others and
        raises one :class:`~rapydli.errors.RankFailure` naming the rank. When no rank
        progresses for ``--hang-timeout`` seconds while one waits in a collective, the cell
        prints which rank waits for what (``--on-hang abort`` then ends it).
        """
        __tracebackhide__ = True  # noqa: F841 - IPython shows the user's cell, not these frames
        args = _parse(self.distributed, line)
        if args.timeout is not None and args.timeout <= 0:
            raise UsageError(f"--timeout {args.timeout:g} is invalid: must be > 0 seconds")
        if args.n is not None and args.n < 1:
            raise UsageError(f"-n {args.n} is invalid: must be >= 1")
        if args.hang_timeout is not None and args.hang_timeout <= 0:
            raise UsageError(f"--hang-timeout {args.hang_timeout:g} is invalid: must be > 0 seconds")
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
                hang_timeout_s=args.hang_timeout,
                on_hang=args.on_hang,
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
        """The notebook's cluster, else the one chosen by :func:`~rapydli.cluster.ensure.choose_cluster`:
        a new local one of ``n`` engines (default: one per core), which stays up for the next cells.

        :func:`~rapydli.cluster.ensure.ready` makes it usable (waits for a start under way,
        restarts dead engines).
        """
        held = (
            self._cluster
            if self._cluster is not None and self._cluster.status()["state"] not in ("stopped", "failed")
            else None
        )
        try:
            cluster, owned = choose_cluster(held, n=n or os.cpu_count() or 1, need=n or 1, start=False)
        except ConfigError as exc:
            raise UsageError(str(exc)) from None
        if owned:
            print(
                f"[rapydli] starting {cluster.n} MPI engines (local, {cluster.threads} thread(s) each) ...", flush=True
            )
        ready(cluster)
        self._cluster = cluster
        return cluster


def _display(content: dict[str, Any]) -> None:
    from IPython.display import publish_display_data

    publish_display_data(data=content.get("data", {}), metadata=content.get("metadata", {}))


def load_ipython_extension(ipython: Any) -> None:
    """Register the magics with ``ipython``; figures shown from now on also carry their PNG."""
    from rapydli.widgets.display import static_figures

    ipython.register_magics(RapydliMagics)
    static_figures()


def unload_ipython_extension(ipython: Any) -> None:
    """Stop the cluster the magics started."""
    magics = ipython.magics_manager.registry.get("RapydliMagics")
    if magics is not None and magics._cluster is not None:
        magics._cluster.stop()
        magics._cluster = None
    print("[rapydli] magics unloaded", file=sys.stderr)

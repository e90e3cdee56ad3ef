"""Batches of notebook experiments: one papermill execution per parameter point.

``rd.batch("nb.ipynb", grid={"lr": [0.1, 0.01], "workers": [1, 2]}, parallel=2)`` (and
``rapydli batch``) expands the grid, checks every point against the notebook's
``parameters`` cell, then runs each point in its own process (at most ``parallel`` at
once) with its own working directory: on this machine, on other hosts over ssh, or as a
Slurm job each (``launcher=``, :mod:`rapydli.experiments.batch.places`). Results land in ``out``::

    out/<notebook-stem>/<param-hash>.ipynb    executed notebook (rd.record values inside)
    out/<notebook-stem>/<param-hash>.json     the item's parameters, hashes and outcome
    out/<notebook-stem>/<param-hash>/         the item's working directory
    out/summary.csv, out/report.html          one row per item; plots

Re-running the same batch skips items already finished with the same parameters and
the same notebook source. Each item and the batch are runs in the store (kind ``batch``;
items have the batch as parent); a re-run that skips every item records nothing new.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rapydli.cluster.launchers import DEFAULT_LAUNCHER, HOSTS_LAUNCHER
from rapydli.errors import ConfigError
from rapydli.experiments.batch import spec as batchspec
from rapydli.experiments.batch.places import ItemProcess, Places, places
from rapydli.experiments.store import merge as storemerge
from rapydli.experiments.store import runstore as store_mod
from rapydli.paths import private_dir
from rapydli.settings import BATCH_ITEM, STORE_PATH, TRACKERS

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

    from rapydli.experiments.trackers.follow import RunTrackers

DEFAULT_OUT = "batch-results"


@dataclass
class Item:
    """One point of a batch and where its files go."""

    parameters: dict[str, Any]
    key: str
    output: Path
    record: Path
    cwd: Path
    outcome: dict[str, Any] = field(default_factory=dict)


def batch(
    notebook: str | os.PathLike[str],
    grid: Mapping[str, Any] | Sequence[str] | None = None,
    *,
    params_file: str | os.PathLike[str] | None = None,
    points: Sequence[Mapping[str, Any]] | None = None,
    parallel: int = 1,
    out: str | os.PathLike[str] = DEFAULT_OUT,
    kernel: str | None = None,
    timeout: float | None = None,
    retry: int = 0,
    force: bool = False,
    progress: bool = True,
    hosts: Sequence[str] | None = None,
    ssh_command: str = "ssh",
    launcher: str | None = None,
    launcher_options: Mapping[str, Any] | None = None,
    trackers: Sequence[str] | str | None = None,
) -> pd.DataFrame:
    """Run a notebook once per parameter point with papermill; return the summary table.

    Parameters
    ----------
    notebook
        The notebook. Keys are checked against its cell tagged ``parameters`` when it has
        one; without one, papermill injects the parameters at the top.
    grid
        ``{"lr": [0.1, 0.01], "workers": [1, 2]}`` (a non-list value is fixed) or the
        command-line form ``["lr=0.1,0.01", "workers=1,2"]``; expanded as a cartesian product.
    params_file
        YAML/JSON file: a mapping expanded like ``grid``, or a list of points.
    points
        Explicit points (mappings), each combined with the grid.
    parallel
        Items running at once (each in its own process; with ``launcher="slurm"``, the
        batch's jobs in the queue).
    out
        Output folder (see the module docstring).
    kernel
        Jupyter kernel name; default the notebook's own kernelspec, else this
        environment's Python kernel (a notebook with no kernel metadata).
    timeout
        Seconds an item may run before it (and every process it started) is killed; a
        Slurm job's time in the queue does not count.
    retry
        Times a failed item is run again before it counts as failed.
    force
        Run every item even when a finished result is already in ``out``.
    progress
        Show a tqdm progress bar.
    hosts, ssh_command
        Run the items on these hosts, one at a time per host, reached with ``ssh_command``
        (see :mod:`rapydli.experiments.batch.hosts`); ``out`` must be on a filesystem they share.
        The same as ``launcher="ssh"`` with these two options.
    launcher, launcher_options
        Where items run (:mod:`rapydli.experiments.batch.places`): ``"local"`` (default),
        ``"ssh"`` or ``"slurm"`` (each item a Slurm job of one task; options such as
        ``{"partition": "debug", "timelimit": "00:30:00", "setup": ["module load ..."]}``).
        Items that run elsewhere record into store files of their own that the batch merges.
    trackers
        Experiment trackers (``["mlflow", "tensorboard"]``) the batch is logged to, with
        ``RAPYDLI_TRACKERS``: the batch is a parent tracker run, each item a child run
        under it, and the runs an item's notebook trains (``rd.train``) children of the
        item's (the items get ``RAPYDLI_TRACKERS``). This process makes each tracker run
        before the runs under it start and ends it once its run has ended.

    Returns
    -------
    pandas.DataFrame
        One row per item: item, the parameters, status, duration, attempts, resumed,
        error, failing_cell, output, run_id, and every scalar recorded with ``rd.record``.
        ``.attrs`` holds ``failed`` (count), ``summary`` and ``report`` (paths).

    Raises
    ------
    ConfigError
        Before anything runs: unknown parameter, wrong value type, unreadable notebook or
        params file, bad option value.

    Examples
    --------
    >>> import rapydli as rd
    >>> table = rd.batch("05-batch-experiments.ipynb", {"lr": [0.1, 0.01], "workers": [1, 2]},
    ...                  parallel=2)  # doctest: +SKIP
    """
    plan = plan_batch(
        notebook,
        grid,
        params_file=params_file,
        points=points,
        out=out,
        kernel=kernel,
        parallel=parallel,
        timeout=timeout,
        retry=retry,
    )
    return run_plan(
        plan,
        parallel=parallel,
        kernel=kernel,
        timeout=timeout,
        retry=retry,
        force=force,
        progress=progress,
        hosts=hosts,
        ssh_command=ssh_command,
        launcher=launcher,
        launcher_options=launcher_options,
        trackers=trackers,
    )


@dataclass
class BatchPlan:
    """A validated batch: the notebook, its hash, the varied keys and the items."""

    notebook: Path
    notebook_hash: str
    out: Path
    varied: list[str]
    items: list[Item]
    grid: dict[str, Any]


def plan_batch(
    notebook: str | os.PathLike[str],
    grid: Mapping[str, Any] | Sequence[str] | None = None,
    *,
    params_file: str | os.PathLike[str] | None = None,
    points: Sequence[Mapping[str, Any]] | None = None,
    out: str | os.PathLike[str] = DEFAULT_OUT,
    kernel: str | None = None,
    parallel: int = 1,
    timeout: float | None = None,
    retry: int = 0,
) -> BatchPlan:
    """Expand and validate a batch without running anything (see :func:`batch`)."""
    _check_options(parallel, timeout, retry, kernel)
    path = Path(notebook).resolve()
    params = batchspec.notebook_parameters(path, kernel)
    if grid is None:
        axes: dict[str, list[Any]] = {}
    elif isinstance(grid, Mapping):
        axes = {str(k): (list(v) if isinstance(v, (list, tuple)) else [v]) for k, v in grid.items()}
        for key, values in axes.items():
            if not values:
                raise ConfigError(f"grid {key!r} has no values")
    elif isinstance(grid, Sequence) and not isinstance(grid, str):
        axes = batchspec.parse_grid(grid)
    else:
        raise ConfigError(f"grid must be a mapping or a list of 'key=v1,v2' strings; got {type(grid).__name__}")
    base: list[dict[str, Any]] = [dict(p) for p in points] if points is not None else [{}]
    if params_file is not None:
        from_file = batchspec.load_params_file(params_file)
        base = [{**b, **f} for b in base for f in from_file]
    all_points = batchspec.expand(axes, base)
    all_points = batchspec.validate(all_points, params, str(notebook))
    folder = Path(out).resolve() / path.stem
    items, seen = [], set()
    for point in all_points:
        key = batchspec.param_hash(point)
        if key in seen:
            continue
        seen.add(key)
        items.append(Item(point, key, folder / f"{key}.ipynb", folder / f"{key}.json", folder / key))
    keys = sorted({k for p in all_points for k in p})
    varied = [k for k in keys if len({json.dumps(p.get(k), sort_keys=True) for p in all_points}) > 1]
    return BatchPlan(path, batchspec.notebook_hash(path), Path(out).resolve(), varied, items, axes)


def _check_options(parallel: int, timeout: float | None, retry: int, kernel: str | None) -> None:
    if isinstance(parallel, bool) or not isinstance(parallel, int) or parallel < 1:
        raise ConfigError(f"parallel must be an integer >= 1; got {parallel!r}")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0):
        raise ConfigError(f"timeout must be a number of seconds > 0; got {timeout!r}")
    if isinstance(retry, bool) or not isinstance(retry, int) or retry < 0:
        raise ConfigError(f"retry must be an integer >= 0; got {retry!r}")
    if kernel is not None:
        from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

        try:
            KernelSpecManager().get_kernel_spec(kernel)
        except NoSuchKernel:
            names = ", ".join(sorted(KernelSpecManager().find_kernel_specs()))
            raise ConfigError(f"kernel {kernel!r} is not installed; installed kernels: {names}") from None


def _finished_before(item: Item, notebook_hash: str) -> dict[str, Any] | None:
    try:
        previous = json.loads(item.record.read_text())
    except (OSError, ValueError):
        return None
    same = previous.get("notebook_hash") == notebook_hash and previous.get("parameters") == item.parameters
    if same and previous.get("status") == "finished" and item.output.exists():
        return previous
    return None


def run_plan(
    plan: BatchPlan,
    *,
    parallel: int = 1,
    kernel: str | None = None,
    timeout: float | None = None,
    retry: int = 0,
    force: bool = False,
    progress: bool = True,
    hosts: Sequence[str] | None = None,
    ssh_command: str = "ssh",
    launcher: str | None = None,
    launcher_options: Mapping[str, Any] | None = None,
    trackers: Sequence[str] | str | None = None,
) -> pd.DataFrame:
    """Run a validated :class:`BatchPlan`; write summary.csv and report.html; return the summary."""
    from rapydli.experiments.batch import report as batchreport
    from rapydli.registry import tracker_names
    from rapydli.settings import settings

    _check_options(parallel, timeout, retry, kernel)
    names = tuple(
        dict.fromkeys([*tracker_names(trackers, "trackers"), *settings().trackers])
    )  # refused before anything runs
    places = item_places(launcher, launcher_options, hosts, ssh_command)
    pending = []
    for item in plan.items:
        previous = None if force else _finished_before(item, plan.notebook_hash)
        if previous is not None:
            item.outcome = {**previous, "resumed": True}
        else:
            pending.append(item)
    private_dir(plan.out)  # the executed notebooks hold the items' outputs: the user's only, when new
    store = store_mod.open_store()
    batch_id = None
    if store is not None and pending:  # a re-run that skips every item adds no batch record
        batch_id = store.create_run(
            "batch",
            plan.notebook.stem,
            {
                "notebook": str(plan.notebook),
                "notebook_hash": plan.notebook_hash,
                "points": [i.parameters for i in plan.items],
                "varied": plan.varied,
                "out": str(plan.out),
                "parallel": parallel,
                "kernel": kernel,
                "timeout": timeout,
                "retry": retry,
                "launcher": launcher or (HOSTS_LAUNCHER if hosts is not None else DEFAULT_LAUNCHER),
            },
            parent=None,
        )
    followed = _follow(store, batch_id, names)  # the batch's tracker run, made before any item's
    runner = _Runner(
        plan,
        store,
        batch_id,
        kernel=kernel,
        timeout=timeout,
        retry=retry,
        parallel=parallel,
        places=places,
        trackers=names,
    )
    try:
        runner.run(pending, progress=progress)
    except BaseException:
        runner.kill_all()
        if store is not None and batch_id:
            store.finish_run(batch_id, "interrupted", error="the batch was interrupted")
        if followed is not None:
            followed.close()
        raise
    summary = batchreport.summary_table(plan)
    plan.out.mkdir(parents=True, exist_ok=True)
    summary_path = plan.out / "summary.csv"
    summary.to_csv(summary_path, index=False)
    report_path = batchreport.write_report(plan, summary, plan.out / "report.html")
    failed = int((summary["status"] != "finished").sum())
    summary.attrs.update(failed=failed, summary=str(summary_path), report=str(report_path), batch_id=batch_id)
    if store is not None and batch_id:
        store.add_artifact(batch_id, summary_path, "summary")
        store.add_artifact(batch_id, report_path, "report")
        store.finish_run(
            batch_id,
            "failed" if failed else "finished",
            error=f"{failed} of {len(plan.items)} items failed" if failed else None,
        )
    if followed is not None:  # after the status: the batch's tracker run ends as the batch did
        followed.close()
    return summary


def _follow(store: Any, run_id: str | None, names: Sequence[str]) -> RunTrackers | None:
    """The trackers of a batch's or item's run, once its tracker runs exist (its children then nest under them)."""
    if not names or store is None or run_id is None:
        return None
    from rapydli.experiments.trackers.follow import RunTrackers

    followed = RunTrackers(store, run_id, names)
    followed.wait_open()
    return followed


def item_places(
    launcher: str | None, options: Mapping[str, Any] | None, hosts: Sequence[str] | None, ssh_command: str
) -> Places:
    """Where the items run: ``hosts`` is :data:`~rapydli.cluster.launchers.HOSTS_LAUNCHER` (``"ssh"``) with ``hosts`` and ``ssh_command``."""
    if hosts is None:
        return places(launcher or DEFAULT_LAUNCHER, options)
    if launcher not in (None, HOSTS_LAUNCHER):
        raise ConfigError(f"hosts= runs items over ssh; it cannot be combined with launcher={launcher!r}")
    return places(HOSTS_LAUNCHER, {"hosts": list(hosts), "ssh_command": ssh_command, **(options or {})})


class _Runner:
    """Runs items where ``places`` puts them, at most ``parallel`` at once, with timeout and retries."""

    def __init__(
        self,
        plan: BatchPlan,
        store: Any,
        batch_id: str | None,
        *,
        kernel: str | None,
        timeout: float | None,
        retry: int,
        parallel: int,
        places: Places,
        trackers: Sequence[str] = (),
    ) -> None:
        self.plan, self.store, self.batch_id, self.places, self.trackers = (
            plan,
            store,
            batch_id,
            places,
            tuple(trackers),
        )
        self.kernel, self.timeout, self.retry, self.parallel = kernel, timeout, retry, parallel
        self._procs: dict[str, ItemProcess] = {}
        self._lock = threading.Lock()
        self._killed = False  # kill_all() was called: no item starts any more

    def run(self, items: list[Item], *, progress: bool) -> None:
        if not items:
            return
        from tqdm.auto import tqdm

        bar = tqdm(total=len(items), desc=f"batch {self.plan.notebook.stem}", unit="item", disable=not progress)
        failed = 0
        pool = ThreadPoolExecutor(max_workers=self.parallel)
        try:
            futures = [pool.submit(self._run_item, item) for item in items]
            for future in as_completed(futures):
                item = future.result()
                failed += item.outcome["status"] != "finished"
                bar.update(1)
                bar.set_postfix(failed=failed)
        except BaseException:  # Ctrl-C included: end the running items before waiting for their threads
            self.kill_all()
            raise
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
            bar.close()

    def _run_item(self, item: Item) -> Item:
        attempts = 0
        while True:
            attempts += 1
            outcome = self._attempt(item)
            if outcome["status"] == "finished" or attempts > self.retry or self._killed:
                break
        item.outcome = {**outcome, "attempts": attempts, "resumed": False}
        item.record.write_text(json.dumps(item.outcome, indent=1, default=str))
        return item

    def _attempt(self, item: Item) -> dict[str, Any]:
        with self.places.slot() as slot:
            return self._attempt_on(item, slot)

    def _attempt_on(self, item: Item, slot: str | None) -> dict[str, Any]:
        item.cwd.mkdir(parents=True, exist_ok=True)
        run_id = None
        if self.store is not None:
            run_id = self.store.create_run(
                "batch",
                f"{self.plan.notebook.stem}/{item.key}",
                {
                    "notebook": str(self.plan.notebook),
                    "parameters": item.parameters,
                    "param_hash": item.key,
                    "notebook_hash": self.plan.notebook_hash,
                    "output": str(item.output),
                    "out": str(self.plan.out),
                    "kernel": self.kernel,
                    "timeout": self.timeout,
                },
                parent=self.batch_id,
                seed=item.parameters.get("seed") if isinstance(item.parameters.get("seed"), int) else None,
                world_size=item.parameters.get("workers") if isinstance(item.parameters.get("workers"), int) else 1,
            )
        followed = _follow(
            self.store, run_id, self.trackers
        )  # the item's tracker run, under the batch's, before its notebook runs
        try:
            return self._execute(item, slot, run_id)
        finally:
            if followed is not None:  # the item's status is in the store now
                followed.close()

    def _execute(self, item: Item, slot: str | None, run_id: str | None) -> dict[str, Any]:
        result_path = item.cwd / ".rapydli-result.json"
        result_path.unlink(missing_ok=True)
        spec = {
            "notebook": str(self.plan.notebook),
            "output": str(item.output),
            "parameters": item.parameters,
            "kernel": self.kernel,
            "cwd": str(item.cwd),
            "notebook_dir": str(self.plan.notebook.parent),
            "run_id": run_id,
            "result": str(result_path),
        }
        spec_path = item.cwd / ".rapydli-spec.json"
        spec_path.write_text(json.dumps(spec))
        env = dict(os.environ)
        if not self.places.remote:  # this machine's cores, shared by the items at once
            env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // self.parallel)))
        env.pop(BATCH_ITEM, None)
        if self.trackers:  # the notebook's rd.train runs: children of the item's tracker run
            env[TRACKERS] = ",".join(self.trackers)
        started = time.time()
        log_path = item.cwd / ".rapydli-item.log"
        args = ["-m", "rapydli.experiments.batch.item", str(spec_path)]
        job_store = None
        if self.places.remote and run_id:  # results come back through a store file of the item's own
            job_store = storemerge.job_store(self.store, run_id, item.cwd / ".rapydli-runs.db")
            env[STORE_PATH] = str(job_store)
        with self._lock:
            if self._killed:
                proc = None
            else:
                proc = self.places.start(
                    slot,
                    args,
                    name=f"{self.plan.notebook.stem}-{item.key}",
                    cwd=item.cwd,
                    env=env,
                    log=log_path,
                    timeout=self.timeout,
                )
                self._procs[item.key] = proc
        timed_out = False
        try:
            if proc is not None:
                try:
                    proc.wait(timeout=self.timeout)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    timed_out = True
        finally:
            with self._lock:
                self._procs.pop(item.key, None)
            if job_store is not None and job_store.exists():
                storemerge.merge(self.store, job_store)
        outcome: dict[str, Any] = {"error": None, "failing_cell": None}
        try:
            outcome.update(json.loads(result_path.read_text()))
        except (OSError, ValueError):
            try:
                tail = log_path.read_text(errors="replace")[-2000:]
            except OSError:  # a job cancelled in the queue never wrote one
                tail = ""
            if proc is None or self._killed:
                reason = "the batch was interrupted"
            elif timed_out:
                reason = f"timed out after {self.timeout:g} s"
            else:
                reason = proc.exit_text()
            outcome.update(status="failed", error=f"{reason}\n{tail}".strip())
            if run_id:
                self.store.finish_run(run_id, "failed", error=outcome["error"])
        outcome.update(
            parameters=item.parameters,
            param_hash=item.key,
            notebook_hash=self.plan.notebook_hash,
            output=str(item.output),
            run_id=run_id,
            duration=outcome.get("duration", time.time() - started),
        )
        return outcome

    def kill_all(self) -> None:
        """End every running item (at once) and start no more; returns once they are gone."""
        with self._lock:
            self._killed = True
            procs = list(self._procs.values())
        enders = [threading.Thread(target=proc.kill, name="rapydli-batch-kill") for proc in procs]
        for ender in enders:
            ender.start()
        for ender in enders:
            ender.join()

"""``rapydli runs list|show|compare|tag|note|repeat|export``: the run store from the shell."""

from __future__ import annotations

import json
from typing import Any

import click

from rapydli.cli.fmt import fmt_value
from rapydli.cli.group import Group
from rapydli.experiments.store.runstore import KINDS, STATUSES
from rapydli.registry import TRACKERS


def _store() -> Any:
    from rapydli.experiments.store.runstore import require_store

    return require_store()


def _short(value: Any, width: int = 60) -> str:
    text = fmt_value(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def fitted(text: str, heading: str, last: list[str], width: int | None = None) -> str:
    """A table (``text``: a header line, then a line per row) with a last column ``last`` wrapped, not cut, to the
    terminal's ``width``: beside the table where at least 20 characters are left, else indented under each row."""
    import shutil
    import textwrap

    width = width or shutil.get_terminal_size((100, 24)).columns
    lines = text.splitlines()
    table_width = max(len(line) for line in lines)
    room = width - table_width - 2
    out = [f"{lines[0].ljust(table_width)}  {heading}" if room >= 20 else lines[0]]
    for line, value in zip(lines[1:], last, strict=True):
        if room >= 20:
            chunks = textwrap.wrap(value, room, break_on_hyphens=False) or [""]
            out.append(f"{line.ljust(table_width)}  {chunks[0]}".rstrip())
            out += [" " * (table_width + 2) + chunk for chunk in chunks[1:]]
        else:
            out.append(line)
            out += ["    " + chunk for chunk in textwrap.wrap(value, max(20, width - 4), break_on_hyphens=False)]
    return "\n".join(out)


def _flat_params(params: dict[str, Any]) -> dict[str, Any]:
    """A run's parameters as dotted keys, without the recorded sources; ``config.lr`` reads ``lr``."""
    from rapydli.experiments.store.compare import flatten

    inner = params.get("parameters", params.get("config"))
    shown = {k: v for k, v in params.items() if k not in ("sources", "parameters", "config")}
    flat = flatten(shown)
    if isinstance(inner, dict):
        flat.update(flatten(inner))
    return {k: v for k, v in flat.items() if k}


def differing_params(rows: list[dict[str, Any]]) -> dict[str, str]:
    """``{run_id: "key=value ..."}``: the parameters that differ between the listed runs of the same kind.

    A run alone of its kind (or among runs that all have the same parameters) gets ``""``.
    """
    from rapydli.experiments.store.compare import param_diff

    out: dict[str, str] = {}
    for kind in {r["kind"] for r in rows}:
        flats = {r["id"]: _flat_params(r["params"]) for r in rows if r["kind"] == kind}
        keys = param_diff(flats) if len(flats) > 1 else []
        for run_id, flat in flats.items():
            out[run_id] = " ".join(f"{k}={fmt_value(flat[k]) if k in flat else '-'}" for k in keys)
    return out


@click.group(cls=Group)
def runs() -> None:
    """List, show, compare, tag, annotate, repeat and export recorded runs."""


@runs.command("list")
@click.option("--kind", type=click.Choice(KINDS), default=None, help="Only runs of this kind.")
@click.option("--status", type=click.Choice(STATUSES), default=None, help="Only runs with this status.")
@click.option("--parent", default=None, help="Only children of this run (a sweep's trials, a batch's items).")
@click.option("--limit", "-n", type=click.IntRange(min=1), default=20, show_default=True, help="Newest N runs.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON array of the runs instead of a table.")
def list_runs(kind: str | None, status: str | None, parent: str | None, limit: int, as_json: bool) -> None:
    """List runs, newest first."""
    from rapydli.experiments.store.runview import iso_times

    store = _store()
    if parent is not None:
        parent = store.resolve(parent)
    rows, total = store.list_runs(kind=kind, status=status, limit=limit, parent=parent)
    if as_json:
        click.echo(json.dumps([iso_times(row) for row in rows], sort_keys=True, default=str, indent=1))
        return
    if not rows:
        click.echo("no runs recorded" + (" matching the filters" if kind or status or parent else ""))
        return
    import pandas as pd

    differ = differing_params(rows)
    table = pd.DataFrame(
        [
            {
                "id": r["id"],
                "kind": r["kind"],
                "name": _short(r["name"], 22),
                "status": r["status"],
                "started (UTC)": iso_times(r)["started"][5:16].replace(
                    "T", " "
                ),  # 12-07 01:40: the list fits 80 columns
                "duration": "" if r["duration"] is None else f"{r['duration']:.1f}s",
                "ranks": r["world_size"],
                "parent": r["parent"] or "",
            }
            for r in rows
        ]
    )
    if not any(r["parent"] for r in rows):
        table = table.drop(columns=["parent"])
    click.echo(fitted(table.to_string(index=False), "params that differ", [differ[r["id"]] for r in rows]))
    if total > len(rows):
        click.echo(f"({len(rows)} of {total} runs; use --limit to see more)")


@runs.command()
@click.argument("run_id")
@click.option("--json", "as_json", is_flag=True, help="Print the run, its final metrics and artifacts as JSON.")
def show(run_id: str, as_json: bool) -> None:
    """Show one run: parameters, status, final metrics, records, artifacts, environment.

    Code defined in a notebook (a model class, a loss) is shown with its recorded source.
    """
    from rapydli.experiments.store.runview import iso_times, setup_text
    from rapydli.experiments.trackers.sync import link_rows

    store = _store()
    run = store.get_run(store.resolve(run_id))
    final = store.final_metrics(run["id"])
    artifacts = store.artifacts(run["id"])
    children, n_children = store.list_runs(parent=run["id"], limit=50)
    if as_json:
        payload = {**iso_times(run), "final_metrics": final, "artifacts": artifacts, "tags": store.tags(run["id"]),
                   "records": store.records(run["id"]), "children": [c["id"] for c in children]}  # fmt: skip
        click.echo(json.dumps(payload, indent=1, sort_keys=True, default=str))
        return
    info = iso_times(run)
    click.echo(f"run {run['id']}  {run['kind']}  {run['name']}  [{run['status']}]")
    for key in ("parent", "started", "ended", "duration", "world_size", "seed", "host", "pid", "cwd", "git_commit"):
        value = info[key]
        if key == "duration" and value is not None:
            value = f"{value:.2f} s"
        click.echo(f"  {key:<11} {'' if value is None else value}")
    tags = store.tags(run["id"])
    if tags:
        click.echo("  tags        " + " ".join(tags))
    for link in link_rows(store, run["id"]):  # the run in MLflow, TensorBoard, W&B
        click.echo(f"  {link['tracker']:<11} {link['url'] or link['path'] or link['id']}")
    if run["note"]:
        click.echo("  note        " + run["note"].strip().replace("\n", "\n              "))
    click.echo("  versions    " + ", ".join(f"{k} {v}" for k, v in sorted(run["versions"].items()) if v))
    if run["error"]:
        click.echo("  error       " + run["error"].strip().replace("\n", "\n              "))
    records = store.records(run["id"])
    if "setup_s" in records:  # where the time before the first step went
        click.echo("  set-up      " + setup_text(dict(records["setup_s"]["value"])))
    restarts = records.get("restarts", {}).get("value") or []
    if restarts:  # the world over time: where ranks died and what the run went on with
        from rapydli.experiments.figures import restart_text

        worlds = [f"{run['world_size']} (from step 1)"] + [
            f"{r['workers']} (from step {(r.get('resumed_from_step') or 0) + 1})" for r in restarts if r.get("workers")
        ]
        click.echo("  world size  " + ", ".join(worlds))
        for restart in restarts:
            click.echo("  restart     " + restart_text(restart))
    for straggler in records.get("stragglers", {}).get("value", []):  # a rank the others waited for
        click.echo("  straggler   " + straggler["text"])
    from rapydli.experiments.store.compare import flatten

    click.echo("parameters:")  # all of them, nested ones as dotted keys (config.lr), nothing cut short
    for key, value in sorted(flatten({k: v for k, v in run["params"].items() if k != "sources"}).items()):
        if key:
            click.echo(f"  {key} = {fmt_value(value)}")
    for name, source in (run["params"].get("sources") or {}).items():  # code defined in the notebook
        click.echo(f"source of {name} (defined in the notebook):")
        click.echo("    " + source.rstrip().replace("\n", "\n    "))
    if final:
        click.echo("final metrics:")
        for key, value in sorted(final.items()):
            click.echo(f"  {key} = {fmt_value(value)}")
    others = {
        k: v["type"]
        for k, v in records.items()
        if v["type"] != "scalar" and not k.startswith(("tracker.", "setup_s", "stragglers"))
    }
    if others:
        click.echo("records: " + ", ".join(f"{k} ({t})" for k, t in others.items()))
    if artifacts:
        click.echo("artifacts:")
        for art in artifacts:
            click.echo(f"  {art['kind']:<9} {art['path']}")
    if n_children:
        click.echo(f"children ({n_children}): " + " ".join(c["id"] for c in children))


@runs.command()
@click.argument("run_ids", nargs=-1, required=True)
@click.option("--all-params", is_flag=True, help="Show every parameter, not only those that differ.")
def compare(run_ids: tuple[str, ...], all_params: bool) -> None:
    """Parameters that differ and final metrics, side by side, for two or more runs."""
    import pandas as pd

    from rapydli.experiments.store.compare import compare_runs

    store = _store()
    result = compare_runs(store, [store.resolve(r) for r in run_ids], all_params=all_params)
    ids = [run["id"] for run in result["runs"]]
    header = {run["id"]: f"{run['id']} ({run['status']})" for run in result["runs"]}
    if result["params"]:
        values = result["values"]
        table = pd.DataFrame(
            {header[i]: [_short(values[i].get(k, "-"), 40) for k in result["params"]] for i in ids},
            index=result["params"],
        )
        click.echo("parameters" + ("" if all_params else " that differ") + ":")
        click.echo(table.to_string())
    else:
        click.echo("parameters: identical")
    if result["metrics"]:
        from rapydli.experiments.store.compare import SUMMARY_KINDS

        finals = {run["id"]: run["final"] for run in result["runs"]}
        kinds = {name: kind for run in result["runs"] for name, kind in run["final_kinds"].items()}
        table = pd.DataFrame(
            {header[i]: [fmt_value(finals[i].get(n)) for n in result["metrics"]] for i in ids},
            index=[f"{n} ({kinds[n]})" for n in result["metrics"]],
        )
        click.echo("final metrics (" + "; ".join(f"{k}: {text}" for k, text in SUMMARY_KINDS.items()) + "):")
        click.echo(table.to_string())
    else:
        click.echo("final metrics: none recorded")


@runs.command()
@click.argument("run_id")
@click.argument("tags", nargs=-1)
@click.option("--remove", "-r", is_flag=True, help="Remove these tags instead of adding them.")
def tag(run_id: str, tags: tuple[str, ...], remove: bool) -> None:
    """Add TAGS to a run (or --remove them); with no TAGS, print its tags."""
    store = _store()
    run_id = store.resolve(run_id)
    if tags:
        current = store.remove_tags(run_id, tags) if remove else store.add_tags(run_id, tags)
    else:
        current = store.tags(run_id)
    click.echo(f"{run_id}: " + (" ".join(current) if current else "no tags"))


@runs.command()
@click.argument("run_id")
@click.argument("text", required=False)
@click.option("--clear", is_flag=True, help="Remove the run's note.")
def note(run_id: str, text: str | None, clear: bool) -> None:
    """Set a run's note to TEXT (or --clear it); with neither, print the note."""
    from rapydli.errors import ConfigError

    store = _store()
    run_id = store.resolve(run_id)
    if clear and text is not None:
        raise ConfigError("give either TEXT or --clear, not both")
    if clear or text is not None:
        store.set_note(run_id, None if clear else text)
    current = store.get_run(run_id)["note"]
    click.echo(current if current else f"{run_id}: no note")


@runs.command()
@click.argument("run_ids", nargs=-1, required=True)
def delete(run_ids: tuple[str, ...]) -> None:
    """Delete runs (and their children: a sweep's trials) from the store, and the models they kept under RAPYDLI_HOME.

    A run's trained model lives in ``$RAPYDLI_HOME/models/<run id>`` until the run is deleted
    (``rd.load`` reads it). Checkpoint directories the runs' configs named are yours: they
    stay, and are listed. A running run is refused.
    """
    import shutil
    from pathlib import Path

    from rapydli.paths import subdir

    store = _store()
    models = subdir("models").resolve()
    for run in store.delete_runs([store.resolve(r) for r in run_ids]):
        said = f"deleted {run['id']} ({run['kind']} {run['name']})"
        kept = Path(run["model_dir"]).resolve() if run["model_dir"] else None
        if kept is not None and kept.parent == models:
            shutil.rmtree(kept, ignore_errors=True)
            said += f", its model {kept}"
        checkpoint = (run["params"].get("config") or {}).get("checkpoint_dir")
        if checkpoint:
            said += f"; its checkpoint_dir {checkpoint} stays"
        click.echo(said)


@runs.command()
@click.argument("run_id")
@click.option("--out", default=None, help="Batch runs: output folder (default: the original's).")
@click.option("--parallel", "-j", type=int, default=None, help="Batch runs: items at once (default: the original's).")
def repeat(run_id: str, out: str | None, parallel: int | None) -> None:
    """Re-run a recorded train run or batch (or batch item) with the same parameters and seed."""
    from rapydli.experiments.repeat import repeat_run
    from rapydli.experiments.store.runstore import require_store

    new_id = repeat_run(run_id, out=out, parallel=parallel)
    status = require_store().get_run(new_id)["status"]
    click.echo(f"repeated {run_id} as run {new_id} [{status}]")
    if status != "finished":
        raise click.ClickException(f"the repeated run {new_id} {status}; see `rapydli runs show {new_id}`")


@runs.command()
@click.argument("run_ids", nargs=-1)
@click.option("--kind", type=click.Choice(KINDS), default=None, help="Only runs of this kind.")
@click.option("--status", type=click.Choice(STATUSES), default=None, help="Only runs with this status.")
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["jsonl", "csv"]),
    default="jsonl",
    show_default=True,
    help="jsonl: one run per line with metrics, records, artifacts; csv: one row per run, "
    "params.* and final metrics as columns.",
)
@click.option("--output", "-o", type=click.Path(dir_okay=False, writable=True), default="-", show_default=True)
@click.option(
    "--to",
    "tracker",
    type=click.Choice(TRACKERS.names()),
    default=None,
    help="Log the runs to this experiment tracker instead (again: updates the same tracker runs).",
)
def export(
    run_ids: tuple[str, ...], kind: str | None, status: str | None, fmt: str, output: str, tracker: str | None
) -> None:
    """Export runs (all, filtered, or the given ids) as JSON Lines or CSV, or --to a tracker (MLflow, TensorBoard, W&B).

    To a tracker, a sweep, batch or scaling study goes with its children, nested under it.
    """
    from rapydli.experiments.store.compare import flatten
    from rapydli.experiments.store.runview import iso_times

    store = _store()
    if run_ids:
        runs_ = [store.get_run(store.resolve(r)) for r in run_ids]
    else:
        runs_, _ = store.list_runs(kind=kind, status=status)
    if tracker is not None:
        from rapydli.experiments.trackers.export import export_runs

        for link in export_runs(
            store, [run["id"] for run in reversed(runs_)], tracker
        ):  # oldest first: parents before children
            click.echo(f"{link['run_id']} -> {tracker} {link.get('url') or link.get('logdir') or link.get('id')}")
        return
    with click.open_file(output, "w") as stream:
        if fmt == "jsonl":
            for run in runs_:
                row = {**iso_times(run), "metrics": [{k: m[k] for k in ("step", "name", "value")} for m in store.metrics(run["id"])],
                       "records": store.records(run["id"]), "artifacts": store.artifacts(run["id"])}  # fmt: skip
                stream.write(json.dumps(row, sort_keys=True, default=str) + "\n")
        else:
            import pandas as pd

            rows = []
            for run in runs_:
                flat = flatten(run["params"], "params")
                base = {k: v for k, v in iso_times(run).items() if k not in ("params", "versions")}
                metrics = {f"metric.{k}": v for k, v in store.final_metrics(run["id"]).items()}
                rows.append({**base, **flat, **metrics})
            pd.DataFrame(rows).to_csv(stream, index=False)
    if output != "-":
        click.echo(f"exported {len(runs_)} runs to {output}", err=True)

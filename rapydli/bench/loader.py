"""``rapydli bench loader``: the clairvoyant loader against PyTorch's DataLoader.

One run measures, on the same synthetic dataset and the same per-sample decode cost,
the ``DataLoader`` over a :class:`~rapydli.data.ShardSampler` (``build_loader(kind=
"default")``, ``--workers`` worker processes) and the :class:`~rapydli.data.ClairvoyantLoader`
(as many worker processes, with ``--threads`` prefetch threads among them), each over a directory of files
(:class:`~rapydli.data.FileDataset`) and over an LMDB store
(:class:`~rapydli.data.LMDBDataset`), for ``--epochs`` epochs: samples/s per epoch and the
consumer's stall time (time spent inside ``next(loader)``).

Two settings: ``throttled`` emulates a parallel file system (every read waits
``--latency-ms`` plus its size over ``--bandwidth-mb-s``, see
:class:`rapydli.data.Throttle`; an emulation, the bytes come from the page cache), and
``unthrottled`` reads the page cache directly. The clairvoyant loader's RAM budget is
``--ram-fraction`` of the data; a ``clairvoyant+disk`` row adds a local-disk tier for the
rest, a ``clairvoyant threads`` row runs the clairvoyant loader with its threads in this
process (``workers=0``), and a ``dataloader xT`` row runs the DataLoader with as many
workers as the clairvoyant loader has threads (throttled only), to separate the gain of
more concurrent reads from the gain of caching. Targets (issue 8): throttled, clairvoyant epochs 2.. >= 2x
the DataLoader's samples/s (same worker count); unthrottled, >= 0.95x over all epochs.
"""

from __future__ import annotations

import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import click

from rapydli.spread import Spread, paired, rounds_text, target


def _dataset(samples: int, shape: tuple[int, ...], seed: int) -> Any:
    import torch
    from torch.utils.data import TensorDataset

    generator = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(samples, *shape, generator=generator), torch.arange(samples) % 10)


def _run(loader: Any, epochs: int, step_s: float) -> list[dict[str, Any]]:
    """Iterate ``epochs`` epochs, sleeping ``step_s`` per batch as a training step would take."""
    per_epoch = []
    for _ in range(epochs):
        samples = 0
        started = time.perf_counter()
        for batch in loader:
            samples += int(batch[0].shape[0])
            if step_s:
                time.sleep(step_s)
        per_epoch.append({"samples": samples, "seconds": time.perf_counter() - started})
    for record, stats in zip(per_epoch, loader.stats()["epochs"]):
        record["stall_s"] = stats["stall_s"]
        record["hits"] = stats.get("hits")
        record["storage_bytes"] = stats.get("storage_bytes")
    return per_epoch


def _row(setting: str, store: str, kind: str, per_epoch: list[dict[str, Any]]) -> dict[str, Any]:
    row: dict[str, Any] = {"setting": setting, "store": store, "loader": kind}
    for number, record in enumerate(per_epoch, start=1):
        row[f"sps_e{number}"] = record["samples"] / record["seconds"]
    for number, record in enumerate(per_epoch, start=1):
        row[f"stall_s_e{number}"] = record["stall_s"]
    last = per_epoch[-1]
    if last["hits"] is not None:
        row["last_epoch_hits_ram/disk/storage"] = "/".join(str(last["hits"][t]) for t in ("ram", "disk", "storage"))
        row["storage_MB_all_epochs"] = sum(r["storage_bytes"] for r in per_epoch) / 1e6
    row["sps_epochs_2+"] = sum(r["samples"] for r in per_epoch[1:]) / sum(r["seconds"] for r in per_epoch[1:])
    row["sps_all"] = sum(r["samples"] for r in per_epoch) / sum(r["seconds"] for r in per_epoch)
    return row


@click.command()
@click.option("--samples", default=2048, show_default=True, help="Samples in the synthetic dataset.")
@click.option("--shape", default="3,32,32", show_default=True, help="Shape of one float32 sample.")
@click.option("--batch-size", default=32, show_default=True)
@click.option("--epochs", default=3, show_default=True)
@click.option("--workers", default=2, show_default=True, help="Worker processes of both loaders.")
@click.option("--threads", default=8, show_default=True, help="Clairvoyant prefetch threads (in all).")
@click.option("--latency-ms", default=2.0, show_default=True, help="Emulated per-read latency (throttled).")
@click.option("--bandwidth-mb-s", default=20.0, show_default=True, help="Emulated per-read bandwidth (throttled).")
@click.option("--ram-fraction", default=0.25, show_default=True, help="Clairvoyant RAM budget / data size.")
@click.option("--step-ms", default=2.0, show_default=True, help="Emulated training step per batch (sleep).")
@click.option("--world-size", default=1, show_default=True, help="Ranks the data is sharded over (rank 0 measured).")
@click.option("--seed", default=0, show_default=True)
@click.option(
    "--rounds",
    type=click.IntRange(min=1),
    default=3,
    show_default=True,
    help="Interleaved rounds: every loader once per round; ratios are per round, with their range.",
)
@click.option("--dir", "directory", default=None, help="Where to write the stores (default: a temp dir).")
@click.option("--json", "json_path", default=None, help="Write the rows and summary as JSON here.")
def command(
    samples: int,
    shape: str,
    batch_size: int,
    epochs: int,
    workers: int,
    threads: int,
    latency_ms: float,
    bandwidth_mb_s: float,
    ram_fraction: float,
    step_ms: float,
    world_size: int,
    seed: int,
    rounds: int,
    directory: str | None,
    json_path: str | None,
) -> None:
    """DataLoader vs ClairvoyantLoader over files and LMDB, throttled and not."""
    from rapydli.bench.report import emit
    from rapydli.data import (
        ClairvoyantLoader,
        FileDataset,
        LMDBDataset,
        build_loader,
        write_files,
        write_lmdb,
    )
    from rapydli.data.store import store_bytes
    from rapydli.errors import ConfigError

    if epochs < 2:
        raise ConfigError(f"epochs={epochs} is invalid: the targets compare epochs 2.., need at least 2")
    sample_shape = tuple(int(s) for s in shape.split(","))
    with tempfile.TemporaryDirectory(prefix="rapydli-bench-loader-", dir=directory) as tmp:
        source = _dataset(samples, sample_shape, seed)
        roots = {"files": write_files(source, Path(tmp) / "files"), "lmdb": write_lmdb(source, Path(tmp) / "lmdb")}
        openers = {"files": FileDataset, "lmdb": LMDBDataset}
        data_bytes = store_bytes(LMDBDataset(roots["lmdb"]))
        ram_bytes = int(ram_fraction * data_bytes)
        settings = {
            "throttled": {"read_latency_s": latency_ms / 1e3, "bandwidth_mb_s": bandwidth_mb_s},
            "unthrottled": {},
        }
        common = {"batch_size": batch_size, "rank": 0, "world_size": world_size, "seed": seed, "epochs": epochs}
        rows = []
        # more workers than cores is the point of the "dataloader xT" row: no warning about it
        warnings.filterwarnings("ignore", message="This DataLoader will create", category=UserWarning)
        for round_ in range(rounds):
            for setting, throttle in settings.items():
                for store in ("files", "lmdb"):
                    dataset = openers[store](roots[store], **throttle)
                    kinds = ["dataloader", "clairvoyant", "clairvoyant threads"]
                    if setting == "throttled":
                        kinds += ["clairvoyant+disk", f"dataloader x{threads}"]
                    for kind in kinds:
                        if kind.startswith("dataloader"):
                            count = workers if kind == "dataloader" else threads
                            loader = build_loader(dataset, kind="default", num_workers=count, **common)
                        else:
                            loader = ClairvoyantLoader(
                                dataset,
                                ram_bytes=ram_bytes,
                                disk_bytes=data_bytes if kind == "clairvoyant+disk" else 0,
                                disk_dir=tmp,
                                prefetch_threads=threads,
                                workers=0 if kind == "clairvoyant threads" else workers,
                                **common,
                            )
                        rows.append(
                            {"round": round_, **_row(setting, store, kind, _run(loader, epochs, step_ms / 1e3))}
                        )
                        if kind.startswith("clairvoyant"):
                            loader.close()  # stops its workers
                        del loader
    summary: dict[str, Any] = {
        "data_MB": data_bytes / 1e6,
        "clairvoyant_ram_MB": ram_bytes / 1e6,
        "workers": workers,
        "threads": threads,
    }
    summary.update(_targets(rows))
    emit("loader", rows, summary, json_path)


def _targets(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The ratios of the module's targets: the median over rounds of the per-round ratio, with its range."""

    def find(setting: str, store: str, kind: str, key: str) -> list[float]:
        """``key`` of one loader in every round, in round order."""
        return [r[key] for r in rows if (r["setting"], r["store"], r["loader"]) == (setting, store, kind)]

    def ratio_text(ratio: Spread) -> str:
        return f"{ratio.median:.2f}x ({rounds_text(ratio)})"

    out: dict[str, Any] = {}
    for store in ("files", "lmdb"):
        many = next(
            r["loader"]
            for r in rows
            if r["setting"] == "throttled" and r["store"] == store and r["loader"].startswith("dataloader x")
        )
        ratio = paired(
            find("throttled", store, "clairvoyant", "sps_epochs_2+"), find("throttled", store, many, "sps_epochs_2+")
        )
        out[f"throttled {store} clairvoyant epochs 2+ vs {many} (as many workers as threads)"] = ratio_text(ratio)
        for kind in ("clairvoyant", "clairvoyant+disk"):
            ratio = paired(
                find("throttled", store, kind, "sps_epochs_2+"), find("throttled", store, "dataloader", "sps_epochs_2+")
            )
            out[f"target throttled {store} {kind} epochs 2+ vs DataLoader >= 2x"] = (
                f"{ratio_text(ratio)} {target(ratio, 2.0, at_most=False)}"
            )
        ratio = paired(
            find("unthrottled", store, "clairvoyant", "sps_epochs_2+"),
            find("unthrottled", store, "dataloader", "sps_epochs_2+"),
        )
        out[f"unthrottled {store} clairvoyant epochs 2+ vs DataLoader"] = ratio_text(ratio)
        ratio = paired(
            find("unthrottled", store, "clairvoyant", "sps_all"), find("unthrottled", store, "dataloader", "sps_all")
        )
        out[f"target unthrottled {store} clairvoyant all epochs vs DataLoader >= 0.95x"] = (
            f"{ratio_text(ratio)} {target(ratio, 0.95, at_most=False)}"
        )
    return out

"""Reading what trackers wrote, with their own code (TensorBoard's event reader and W&B's record
protobufs), and the small batch notebook the tracker tests run."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

_BLOCK = 32768  # W&B's .wandb file is a LevelDB log of Record protobufs, after a 7-byte header
_HEADER = 7


_ITEM_TRAINS = """\
from rapydli.experiments.store.runstore import open_store
from rapydli.experiments.trackers.follow import follow
store = open_store()
inner = store.create_run("train", f"inner-{x}", {"x": x})  # under the item (RAPYDLI_PARENT_RUN), as rd.train's run is
followed = follow(store, inner)  # RAPYDLI_TRACKERS, from the batch
store.log_metrics(inner, [(1, "loss", float(x))])
store.finish_run(inner)
followed.close()
"""


def items_notebook(folder: Path) -> Path:
    """``folder/items.ipynb``: parameter ``x``; it records a run ``inner-<x>`` with one loss and logs it to the batch's trackers."""
    import nbformat

    notebook = nbformat.v4.new_notebook()
    notebook.cells = [
        nbformat.v4.new_code_cell("x = 1", metadata={"tags": ["parameters"]}),
        nbformat.v4.new_code_cell(_ITEM_TRAINS),
    ]
    nbformat.write(notebook, folder / "items.ipynb")
    return folder / "items.ipynb"


def tensorboard_scalars(logdir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in ``logdir``'s event files, by tag, as ``(step, value)``, read with TensorBoard's EventAccumulator."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    scalars = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    for tag in acc.Tags().get("tensors", []):  # torch's SummaryWriter may write scalars as tensors
        if tag not in scalars and not tag.endswith("/text_summary"):
            from tensorboard.util import tensor_util

            values = [
                (e.step, float(tensor_util.make_ndarray(e.tensor_proto)))
                for e in acc.Tensors(tag)
                if e.tensor_proto.dtype != 7
            ]
            if values:
                scalars[tag] = values
    return scalars


def tensorboard_texts(logdir: str | Path, tag: str) -> list[str]:
    """Every text written under ``tag`` (``"tags"``) in ``logdir``'s event files, oldest first, read with EventAccumulator."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"tensors": 0})
    acc.Reload()
    return [event.tensor_proto.string_val[0].decode() for event in acc.Tensors(f"{tag}/text_summary")]


def wandb_records(path: str | Path, wait_s: float = 30.0) -> list[Any]:
    """The ``Record`` protobufs of a W&B run file (``run-<id>.wandb``), decoded with W&B's own message classes.

    W&B's service writes the file from its own process and may still be writing when the
    run's ``finish()`` has returned (seen once on a loaded machine: the file held only its
    header): waits, at most ``wait_s``, for the run's exit record, then reads what is there.
    """
    import time

    deadline = time.monotonic() + wait_s
    records = _wandb_records(path)
    while not any(record.WhichOneof("record_type") == "exit" for record in records) and time.monotonic() < deadline:
        time.sleep(0.2)
        records = _wandb_records(path)
    return records


def _wandb_records(path: str | Path) -> list[Any]:
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    pos, chunks, pending = _HEADER, [], b""
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + _HEADER])
        chunk = data[pos + _HEADER : pos + _HEADER + length]
        pos += _HEADER + length
        if kind == 1:
            chunks.append(chunk)
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            chunks.append(pending + chunk)
    return [wandb_internal_pb2.Record.FromString(chunk) for chunk in chunks]


def wandb_history(path: str | Path) -> list[dict[str, Any]]:
    """The history rows (``run.log`` calls) of a W&B run file, values decoded."""
    rows = []
    for record in wandb_records(path):
        if record.WhichOneof("record_type") == "history":
            rows.append(
                {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            )
    return rows


def wandb_run(path: str | Path) -> Any:
    """The run's ``RunRecord`` (its id, group, job type...) as the W&B run file holds it last."""
    runs = [record.run for record in wandb_records(path) if record.WhichOneof("record_type") == "run"]
    assert runs, f"{path} holds no run record"
    return runs[-1]


def wandb_config(path: str | Path) -> dict[str, Any]:
    """The run's config (parameters) as the W&B run file holds it."""
    config: dict[str, Any] = {}
    for record in wandb_records(path):
        if record.WhichOneof("record_type") == "config":
            for item in record.config.update:
                config[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return config

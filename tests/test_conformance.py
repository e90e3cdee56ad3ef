"""The conformance matrix: every architecture users bring (tests/library_models.py) under every layout.

Each cell either trains what one process trains on the same global batch (float64, every
parameter and buffer within 1e-9 relative, tied parameters still one tensor) or is refused
here, in the test process, by the checks ``rd.train`` runs before any rank starts
(:func:`rapydli.parallel.preflight.check_layout`), with one :class:`ConfigError`. A
``RankFailure`` or a crash of the launch fails the cell.

The full matrix is marked ``matrix`` and runs in its own CI job (``make conformance``),
which also writes ``build/conformance.json`` and checks that the README's table is the one
these results give (``python tests/conformance_table.py`` rewrites it). A cross-section runs
in ``make test``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from library_models import ARCHITECTURES, MODELS

from rapydli.errors import ConfigError
from rapydli.trainer import TrainConfig

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
RESULTS = ROOT / "build" / "conformance"
TOLERANCE = 1e-9

#: A ``pipeline_split`` that stands for the architecture's middle block (:func:`fields_for`).
MIDDLE = "<middle block>"

#: The layouts: (column name, ranks, TrainConfig fields).
LAYOUTS = [
    ("dp", 2, {}),
    ("zero1", 2, {"zero": 1}),
    ("zero2", 2, {"zero": 2}),
    ("zero3", 2, {"zero": 3}),
    ("checkpointing", 2, {"activation_checkpointing": "blocks"}),
    ("zero3+checkpointing", 2, {"zero": 3, "activation_checkpointing": "blocks"}),
    ("tp", 2, {"tensor_parallel": 2}),
    ("pp", 2, {"pipeline_stages": 2, "microbatches": 2}),  # split "auto": measured on the model built whole
    (
        "pp x dp",
        4,
        {"pipeline_stages": 2, "microbatches": 2, "pipeline_split": MIDDLE},
    ),  # named: each stage built deferred
    ("zero3 x pp", 4, {"pipeline_stages": 2, "zero": 3, "pipeline_split": MIDDLE}),
]
LAYOUT_NAMES = [name for name, _, _ in LAYOUTS]

#: The cross-section ``make test`` runs: the constructions and modules users met crashing first.
CROSS_SECTION = {
    "gpt2": [
        "zero3",
        "tp",
        "pp",
    ],  # Model(cfg).double(): crashed deferred construction; stages at the layers, a tied head
    "llama": ["zero3", "pp x dp"],  # .to(torch.float64); stages recorded on the meta device
    "bloom": ["checkpointing"],  # transformers' key/value cache under recomputation
    "whisper": ["zero3"],  # a frozen parameter (sinusoidal positions) under ZeRO-3
    "resnet": ["dp"],  # BatchNorm over the global batch
    "torch_mha": ["tp", "pp"],
}


def fields_for(name: str, layout: str) -> tuple[int, dict]:
    """The ranks and TrainConfig fields of ``layout`` for architecture ``name`` (:data:`MIDDLE` named as the model names it)."""
    _, ranks, fields = next(layout_ for layout_ in LAYOUTS if layout_[0] == layout)
    if fields.get("pipeline_split") == MIDDLE:
        from rapydli.parallel import split
        from rapydli.parallel.preflight import meta_model

        try:
            blocks = split.pipeline_blocks(meta_model(MODELS[name].model_fn))
        except ConfigError:  # no blocks: refused by rd.train's own checks, with "auto"
            return ranks, {k: v for k, v in fields.items() if k != "pipeline_split"}
        fields = {**fields, "pipeline_split": blocks[len(blocks) // 2][0]}
    return ranks, fields


def refusal(name: str, layout: str) -> str | None:
    """The ConfigError ``rd.train`` raises for this cell before any rank starts, or ``None`` if it would start."""
    from rapydli.parallel.layout import Layout
    from rapydli.parallel.preflight import check_layout

    architecture = MODELS[name]
    try:
        ranks, fields = fields_for(name, layout)
        cfg = TrainConfig(batch_size=2, max_steps=2, workers=ranks, **fields)
        Layout.of(cfg, ranks)
        check_layout(architecture.model_fn, cfg, architecture.loss)
    except ConfigError as exc:
        return str(exc)
    return None


def run_cells(run_mpi, name: str, layouts: list[str]) -> dict[str, dict]:
    """Every cell of ``name`` in ``layouts``: its refusal, or what the ranks trained (grouped by rank count, one launch each)."""
    out: dict[str, dict] = {}
    by_ranks: dict[int, list] = {}
    for layout in layouts:
        reason = refusal(name, layout)
        if reason is not None:
            out[layout] = {"model": name, "cell": layout, "refused": reason}
            continue
        ranks, fields = fields_for(name, layout)
        by_ranks.setdefault(ranks, []).append([layout, fields])
    for ranks, cells in sorted(by_ranks.items()):
        code = f"import sys; sys.path.insert(0, {str(TESTS)!r}); import cases_matrix; cases_matrix.main({name!r}, {json.dumps(cells)!r})"
        result = run_mpi(code, n=ranks, timeout=900, check=False)
        found = {
            row["cell"]: row
            for row in (json.loads(line) for line in result.stdout.splitlines() if line.startswith("{"))
        }
        for layout, _ in cells:
            out[layout] = found.get(layout) or {
                "model": name,
                "cell": layout,
                "crashed": f"exit {result.returncode}: {result.stderr[-3000:]}",
            }
    return out


def check_cell(row: dict) -> None:
    """A cell trains what one process trains, or was refused with one ConfigError naming the obstacle."""
    if "refused" in row:
        assert row["refused"] and "Traceback" not in row["refused"], row
        return
    assert "crashed" not in row, f"{row['model']} under {row['cell']} crashed in a rank:\n{row.get('crashed')}"
    assert row["compared"] > 0, row
    assert not row["untied"], row
    assert row["worst"] <= TOLERANCE, row


@pytest.mark.mpi
@pytest.mark.parametrize("name", sorted(CROSS_SECTION))
def test_a_cross_section_of_the_matrix(run_mpi, name: str) -> None:
    for row in run_cells(run_mpi, name, CROSS_SECTION[name]).values():
        check_cell(row)
        assert "refused" not in row, row  # these cells train


@pytest.mark.mpi
@pytest.mark.matrix
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("name", [a.name for a in ARCHITECTURES])
def test_every_architecture_in_every_layout(run_mpi, name: str) -> None:
    rows = run_cells(run_mpi, name, LAYOUT_NAMES)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps([rows[layout] for layout in LAYOUT_NAMES], indent=1))
    failures = []
    for row in rows.values():
        try:
            check_cell(row)
        except AssertionError as exc:
            failures.append(str(exc))
    assert not failures, "\n\n".join(failures)


@pytest.mark.matrix
@pytest.mark.skipif(
    not os.environ.get("RAPYDLI_MATRIX_TABLE"),
    reason="after the matrix has run (make conformance sets RAPYDLI_MATRIX_TABLE)",
)
def test_the_readme_shows_the_matrix_these_results_give() -> None:
    from conformance_table import readme_is_current

    assert readme_is_current(), (
        "the README's conformance table is not what the matrix gave: run `python tests/conformance_table.py`"
    )

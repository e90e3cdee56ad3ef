"""Parameters several pipeline stages hold (tied embeddings) stay one parameter, or the layout is refused.

The rank-side code is ``cases_layouts`` (the Trainer on a layout against one process, in
float64) with ``hf_models.gpt2``: Hugging Face GPT-2's shapes, ``lm_head.weight`` tied to
``transformer.wte.weight``, the embedding on stage 0 and the head on stage 1.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from torch import nn

from rapydli.errors import ConfigError
from rapydli.parallel.shared import check_honoured, find_shared
from rapydli.parallel.split import boundaries

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))

from hf_models import gpt2  # noqa: E402

PIPELINED = {"pipeline_stages": 2, "microbatches": 2, "pipeline_split": "h.1"}


def test_tied_embeddings_are_found_by_identity_with_every_name_and_stage() -> None:
    model = gpt2()
    shared = find_shared(model, boundaries(model, ["h.1"], 2))
    assert [(s.names, s.stages) for s in shared] == [(["transformer.wte.weight", "lm_head.weight"], [0, 1])]
    assert shared[0].describe() == {
        "parameter": "transformer.wte.weight",
        "names": ["transformer.wte.weight", "lm_head.weight"],
        "stages": [0, 1],
        "shape": [32, 16],
    }
    assert find_shared(gpt2(tie=False), [0, 2, 4]) == []  # untied: nothing shared
    sequential = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    sequential[4].weight = sequential[0].weight
    sequential[2].weight = sequential[0].weight
    assert [(s.names, s.stages) for s in find_shared(sequential, [0, 2, 4, 5])] == [
        (["0.weight", "2.weight", "4.weight"], [0, 1, 2])
    ]
    assert find_shared(sequential, [0, 5]) == []  # one stage holds every use


def test_a_sharing_that_cannot_be_honoured_is_refused_naming_the_parameter_and_stages() -> None:
    model = gpt2()
    shared = find_shared(model, boundaries(model, ["h.1"], 2))
    with pytest.raises(
        ConfigError,
        match=r"parameter transformer.wte.weight \(also lm_head.weight\) is shared by pipeline stages 0, 1 .* zero=2",
    ):
        check_honoured(shared, model, zero=2, plan=None)
    with pytest.raises(
        ConfigError, match=r"stages 0, 1 \(tied weights\), and the tensor plan splits lm_head which holds it"
    ):
        check_honoured(shared, model, zero=0, plan={"lm_head": "column", "transformer.h.*.mlp.c_fc": "column"})
    check_honoured(shared, model, zero=1, plan={"transformer.h.*.mlp.c_fc": "column"})  # these are fine


def _run(run_mpi, n: int, cases: list) -> list[dict]:
    code = f"import sys; sys.path.insert(0, {str(TESTS)!r}); import cases_layouts; cases_layouts.main({json.dumps(cases)!r})"
    result = run_mpi(code, n=n, timeout=400)
    assert result.stderr.count("OK layouts") == n
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 4], ids=["pp2", "dp2-pp2"])
def test_tied_gpt2_pipelined_trains_what_one_process_trains_and_its_copies_stay_bit_equal(run_mpi, ranks: int) -> None:
    cases = [["gpt2", {**PIPELINED, "grad_clip": 0.05}]]
    if ranks == 4:
        cases.append(["gpt2", {**PIPELINED, "zero": 1}])
    results = _run(run_mpi, ranks, cases)
    assert len(results) == len(cases)
    for result in results:
        assert result["worst"] < 1e-10 and result["loss"] < 1e-10 and result["val_loss"] < 1e-10, result
        assert result["shared"] == [["transformer.wte.weight", "lm_head.weight"]], result
        # after each of the 3 steps, the copy of every rank that holds one (both stages of every replica) was compared
        assert result["tied_checked"] == 3 * ranks * ranks, result
    clipped = results[0]
    assert clipped["clipped"] >= 2 and clipped["grad_norm"] < 1e-10, (
        clipped
    )  # the tied gradient counted once in the norm

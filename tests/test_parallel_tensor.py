"""Tensor-parallel layers on real MPI ranks: blocks equal the dense ones, training equals one process."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch import nn

from rapydli.errors import ConfigError

TESTS = Path(__file__).resolve().parent


def _case(run_mpi, name: str, n: int = 2) -> str:
    code = f"import sys; sys.path.insert(0, {str(TESTS)!r}); import cases_tensor; cases_tensor.{name}()"
    return run_mpi(code, n=n, timeout=180).stdout


@pytest.mark.mpi
def test_mlp_and_attention_blocks_equal_the_dense_ones_with_one_allreduce_per_direction(run_mpi) -> None:
    assert _case(run_mpi, "block_equivalence").count("OK blocks") == 2


@pytest.mark.mpi
def test_training_tiny_lm_tensor_parallel_equals_one_process(run_mpi) -> None:
    assert _case(run_mpi, "training_equivalence").count("OK training") == 2


def test_bad_plans_name_what_is_wrong() -> None:
    from mpi4py import MPI

    from rapydli.parallel.tensor import TensorGroup, parallelize

    group = TensorGroup(MPI.COMM_SELF)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    with pytest.raises(ConfigError, match="'diagonal' is not a style; allowed: column, row, heads"):
        parallelize(model, {"0": "diagonal"}, group)
    with pytest.raises(ConfigError, match="names no module of the model; its linear layers are 0, 2"):
        parallelize(model, {"blocks.*": "column"}, group)
    with pytest.raises(
        ConfigError,
        match=r"'1': 'column' cannot split a ReLU; allowed: 'column' / 'row' for a linear layer \(nn.Linear",
    ):
        parallelize(model, {"1": "column"}, group)
    with pytest.raises(ConfigError, match="is not an attention module"):
        parallelize(model, {"0": "heads"}, group)


def test_built_in_plans_read_gpt2_llama_and_nanogpt_by_structure() -> None:
    import sys

    sys.path.insert(0, str(TESTS))
    import train_cases
    from hf_models import gpt2, llama

    from rapydli.parallel.tensor import plan_for

    assert plan_for(gpt2()) == {
        "transformer.h.*.attn": "heads",
        "transformer.h.*.mlp.c_fc": "column",
        "transformer.h.*.mlp.c_proj": "row",
    }
    assert (
        plan_for(llama())
        == {
            "model.layers.*.self_attn": "heads",  # 4 query and 2 key/value heads: 2 query heads and the key/value head they read per rank
            "model.layers.*.mlp.gate_proj": "column",
            "model.layers.*.mlp.up_proj": "column",
            "model.layers.*.mlp.down_proj": "row",
        }
    )
    assert plan_for(llama(), size=4) == {  # 2 key/value heads cannot split over 4 ranks: attention stays dense
        "model.layers.*.mlp.gate_proj": "column",
        "model.layers.*.mlp.up_proj": "column",
        "model.layers.*.mlp.down_proj": "row",
    }
    # nanoGPT's attention reads its width from x.size(): it stays dense, its MLP is split
    assert plan_for(train_cases.TinyGPT(n_layer=2)) == {"blocks.*.mlp.0": "column", "blocks.*.mlp.2": "row"}


def test_a_plan_that_cannot_split_a_module_names_it_its_shape_and_the_allowed_styles() -> None:
    import sys

    sys.path.insert(0, str(TESTS))
    import train_cases
    from hf_models import gpt2, llama

    from rapydli.parallel.tensor_plans import check_plan

    with pytest.raises(
        ConfigError,
        match=r"'model.layers.0.self_attn' \(LlamaAttention: 4 query heads, 2 key/value heads, q_proj weight \(16, 16\)\): "
        r"2 key/value heads do not split over tensor_parallel=4 into whole heads",
    ):
        check_plan(llama(), {"model.layers.*.self_attn": "heads"}, 4)
    with pytest.raises(
        ConfigError,
        match=r"'model.norm': 'column' cannot split a LlamaRMSNorm \(weight \(16,\)\); allowed: 'column' / 'row' for a linear",
    ):
        check_plan(llama(), {"model.norm": "column"}, 2)
    with pytest.raises(
        ConfigError,
        match=r"'transformer.h.0.ln_1': 'heads' cannot split a LayerNorm, which is not an attention module; allowed",
    ):
        check_plan(gpt2(), {"transformer.h.0.ln_1": "heads"}, 2)
    with pytest.raises(
        ConfigError, match=r"'blocks.0.attn': 'heads' cannot split this CausalSelfAttention \(input width 16\)"
    ):
        check_plan(train_cases.TinyGPT(), {"blocks.*.attn": "heads"}, 2)
    with pytest.raises(
        ConfigError, match=r"transformer.h.0.mlp.c_fc: out_features=64 does not split over tensor_parallel=3"
    ):
        check_plan(gpt2(), {"transformer.h.*.mlp.c_fc": "column"}, 3)
    with pytest.raises(
        ConfigError, match=r"tensor plan 'lm_head' would split lm_head.weight, which is tied to transformer.wte.weight"
    ):
        check_plan(gpt2(), {"lm_head": "column"}, 2)
    check_plan(gpt2(tie=False), {"lm_head": "column"}, 2)
    check_plan(
        gpt2(),
        {"transformer.h.*.attn": "heads", "transformer.h.*.mlp.c_fc": "column", "transformer.h.*.mlp.c_proj": "row"},
        2,
    )


def test_vocabulary_splits_are_checked_before_training() -> None:
    import sys

    sys.path.insert(0, str(TESTS))
    from hf_models import gpt2

    from rapydli.parallel.tensor_plans import check_plan

    with pytest.raises(
        ConfigError,
        match=r"'lm_head' would split lm_head.weight, which is tied to transformer.wte.weight .* give both 'vocab'",
    ):
        check_plan(gpt2(), {"lm_head": "vocab"}, 2)  # the head alone: the tie would come apart
    with pytest.raises(
        ConfigError, match=r"'transformer.wte' would split transformer.wte.weight, which is tied to lm_head.weight"
    ):
        check_plan(gpt2(), {"transformer.wte": "vocab", "lm_head": "column"}, 2)
    with pytest.raises(ConfigError, match=r"transformer.wte: vocabulary size=32 does not split over tensor_parallel=3"):
        check_plan(gpt2(tie=False), {"transformer.wte": "vocab"}, 3)
    with pytest.raises(
        ConfigError,
        match=r"'transformer.ln_f': 'vocab' cannot split a LayerNorm \(weight \(16,\)\); allowed: .*'vocab' for an nn.Embedding",
    ):
        check_plan(gpt2(tie=False), {"transformer.ln_f": "vocab"}, 2)
    with pytest.raises(ConfigError, match=r"'emb': 'vocab' cannot split an nn.Embedding with max_norm"):
        check_plan(nn.ModuleDict({"emb": nn.Embedding(8, 4, max_norm=1.0)}), {"emb": "vocab"}, 2)
    check_plan(gpt2(), {"transformer.wte": "vocab", "lm_head": "vocab"}, 2)  # tied, both split by the same rows


@pytest.mark.mpi
def test_a_vocabulary_split_embedding_and_head_equal_the_dense_ones(run_mpi) -> None:
    assert _case(run_mpi, "vocabulary_equivalence").count("OK vocabulary") == 2


def test_bert_is_read_by_structure_and_a_module_named_twice_differently_is_refused() -> None:
    import sys

    sys.path.insert(0, str(TESTS))
    from hf_models import bert

    from rapydli.parallel.tensor import plan_for
    from rapydli.parallel.tensor_plans import check_plan

    plan = plan_for(bert())  # attention.self ends at the heads' context: its sibling output.dense is the row layer
    assert plan == {
        "bert.encoder.layer.*.intermediate.dense": "column",
        "bert.encoder.layer.*.output.dense": "row",
        "bert.encoder.layer.*.attention.self": "heads",
        "bert.encoder.layer.*.attention.output.dense": "row",
    }
    with pytest.raises(
        ConfigError,
        match=r"'bert.encoder.layer.\*.attention.output.dense' gives 'bert.encoder.layer.0.attention.output.dense' "
        r"'column', but 'bert.encoder.layer.\*.output.dense' gives it 'row'",
    ):
        check_plan(
            bert(),
            {"bert.encoder.layer.*.output.dense": "row", "bert.encoder.layer.*.attention.output.dense": "column"},
            2,
        )

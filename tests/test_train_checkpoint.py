"""Checkpoints: atomic writes, and a resumed run reaching the uninterrupted run's parameters."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch

from rapydli.trainer import checkpoint as ckpt


class _Unpicklable:
    def __reduce__(self):
        raise pickle.PicklingError("refusing to pickle (simulated failure mid-write)")


def test_failed_write_leaves_previous_checkpoint_and_no_partial_file(tmp_path) -> None:
    path = ckpt.checkpoint_path(tmp_path)
    ckpt.save_atomic({"step": 1, "weights": torch.arange(4.0)}, path)
    before = path.read_bytes()
    with pytest.raises(pickle.PicklingError):
        # the big tensor is written first, then pickling fails: a half-written file existed
        ckpt.save_atomic({"step": 2, "weights": torch.zeros(1 << 20), "bad": _Unpicklable()}, path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt"]
    assert path.read_bytes() == before
    assert ckpt.load(path)["step"] == 1


def test_a_layout_record_written_before_the_degrees_had_one_name_reads_with_its_earlier_keys() -> None:
    from rapydli.parallel.layout import Layout

    earlier = {"world_size": 4, "replicas": 2, "stages": 2, "tensor_parallel": 1, "zero": 1, "bounds": [0, 2, 4]}
    assert ckpt.read_record(earlier) == ckpt.layout_record(Layout(4, 2, 1, 1), [0, 2, 4])
    assert ckpt.describe(earlier) == "4 ranks (data_parallel=2 x pipeline_stages=2 x tensor_parallel=1, zero=1)"


def test_checkpoint_replaces_atomically_and_round_trips(tmp_path) -> None:
    path = ckpt.checkpoint_path(tmp_path / "nested")
    ckpt.save_atomic({"step": 1}, path)
    torch.manual_seed(5)
    ckpt.save_atomic({"step": 2, "rng": ckpt.rng_state()}, path)
    expected = torch.rand(3)
    state = ckpt.load(path)
    assert state["step"] == 2 and state["format"] == ckpt.FORMAT_VERSION
    assert sorted(p.name for p in path.parent.iterdir()) == ["checkpoint.pt"]
    ckpt.set_rng_state(state["rng"])
    assert torch.equal(torch.rand(3), expected)


def test_load_rejects_foreign_files(tmp_path) -> None:
    from rapydli.errors import ConfigError

    path = tmp_path / "other.pt"
    torch.save({"model": {}}, path)
    with pytest.raises(ConfigError, match="not a RaPyDLI checkpoint"):
        ckpt.load(path)


RESUME = """
import torch
from torch import nn
from rapydli.trainer import Trainer, TrainConfig
from rapydli.zoo import datasets

class Stop(Exception):
    pass

class StopAt:
    def __init__(self, step):
        self.step = step
    def on_step_end(self, metrics):
        if metrics["step"] == self.step:
            raise Stop()

def model(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 4))

train, val = datasets.synthetic_features(num_samples=80, in_features=16, num_classes=4)
base = dict(epochs=3, batch_size=8, lr=0.01, optimizer="adamw", lr_schedule="cosine", warmup_steps=2,
            weight_decay=0.01, checkpoint_every=CKPT_EVERY, eval_every=2, allreduce="mpi")

whole = Trainer(model(0), None, train, val, TrainConfig(**base, checkpoint_dir="DIR/whole"))
reference = whole.fit()

interrupted = Trainer(model(0), None, train, val, TrainConfig(**base, checkpoint_dir="DIR/cut"), callbacks=[StopAt(STOP)])
try:
    interrupted.fit()
    raise AssertionError("the run was not interrupted")
except Stop:
    pass
resumed = Trainer(model(123), None, train, val, TrainConfig(**base, checkpoint_dir="DIR/cut", resume=True))
assert resumed.step == RESUMED_AT, resumed.step
history = resumed.fit()
assert resumed.step == whole.step == whole.total_steps
for a, b in zip(whole.model.parameters(), resumed.model.parameters()):
    assert torch.allclose(a, b, atol=1e-6, rtol=0), (a - b).abs().max()
train_rows = [r for r in reference if r["kind"] == "train"]
resumed_rows = [r for r in history if r["kind"] == "train"]
assert [r["step"] for r in resumed_rows] == list(range(RESUMED_AT + 1, whole.total_steps + 1))
for a, b in zip(train_rows[RESUMED_AT:], resumed_rows):
    assert abs(a["loss"] - b["loss"]) < 1e-6 and a["lr"] == b["lr"], (a, b)
for r in (whole, interrupted, resumed):
    r.close()
print("OK", whole.rank)
"""


@pytest.mark.mpi
@pytest.mark.parametrize(
    ("every", "stop", "resumed_at"),
    [(3, 4, 3), (6, 8, 6), (0, 6, 4)],  # 4 steps per epoch: resume mid-epoch 0, mid-epoch 1, at an epoch end
    ids=["mid-epoch-0", "mid-epoch-1", "epoch-end"],
)
def test_resumed_run_equals_uninterrupted_run(run_mpi, tmp_path, every: int, stop: int, resumed_at: int) -> None:
    code = (
        RESUME.replace("CKPT_EVERY", str(every))
        .replace("STOP", str(stop))
        .replace("RESUMED_AT", str(resumed_at))
        .replace("DIR", str(tmp_path))
    )
    result = run_mpi(code, n=2, timeout=180)
    assert result.stdout.count("OK") == 2


def test_writer_writes_in_the_background_and_reports_a_failed_write(tmp_path) -> None:
    import torch

    path = tmp_path / "run" / ckpt.CHECKPOINT_NAME
    writer = ckpt.CheckpointWriter()
    weights = torch.ones(4)
    writer.submit({"w": weights}, path)
    weights.add_(1)  # the step goes on changing the parameters: the checkpoint holds the copy
    writer.wait()
    assert torch.equal(ckpt.load(path)["w"], torch.ones(4))

    (tmp_path / "file").write_text("not a directory")
    writer.submit({"w": weights}, tmp_path / "file" / ckpt.CHECKPOINT_NAME)
    with pytest.raises(OSError):
        writer.wait()
    writer.wait()  # the error is raised once
    assert torch.equal(ckpt.load(path)["w"], torch.ones(4))  # the previous checkpoint is intact


def test_partial_writes_of_a_killed_process_are_removed(tmp_path) -> None:
    partial = tmp_path / f".{ckpt.CHECKPOINT_NAME}.abc123.tmp"
    partial.write_bytes(b"half a checkpoint")
    kept = tmp_path / ckpt.CHECKPOINT_NAME
    kept.write_bytes(b"x")
    ckpt.remove_partial_writes(tmp_path)
    assert not partial.exists() and kept.exists()


# -- one checkpoint, any layout ----------------------------------------------------------------

LAYOUTS = ["dp4", "dp2xpp2", "dp2xtp2", "pp2xtp2", "dp4-zero1", "dp2xtp2-zero2"]


@pytest.mark.mpi
def test_a_checkpoint_of_any_layout_resumes_under_any_other_as_an_uninterrupted_run(run_mpi, tmp_path) -> None:
    """The 36 pairs of 6 layouts on 4 ranks (the MLP), tiny_lm's head-split attention from dp2 x tp2 to 3 others, and GPT-2's
    tied embedding and head split by vocabulary rows from dp2 x tp2 to 3 others (pipelined too); one launch."""
    import json
    from pathlib import Path

    tests = Path(__file__).resolve().parent
    lm = ["dp2xtp2-zero2", "dp4", "pp2xtp2"]
    gpt2 = ["dp2xtp2-vocab", "dp4", "pp2xtp2-vocab"]
    code = (
        f"import sys; sys.path.insert(0, {str(tests)!r}); import cases_checkpoint_layouts as c\n"
        f"c.main({str(tmp_path)!r}, 'mlp', {json.dumps(LAYOUTS)!r}, {json.dumps(LAYOUTS)!r})\n"
        f"c.main({str(tmp_path)!r}, 'tiny_lm', {json.dumps(lm[:1])!r}, {json.dumps(lm)!r})\n"
        f"c.main({str(tmp_path)!r}, 'gpt2', {json.dumps(gpt2[:1])!r}, {json.dumps(gpt2)!r})\n"
    )
    result = run_mpi(code, n=4, timeout=580)
    assert result.stderr.count("OK matrix") == 12
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    wholes, pairs = [r for r in rows if "whole" in r], [r for r in rows if "from" in r]
    assert len(wholes) == 6 + 3 + 3 and all(r["worst"] < 1e-12 for r in wholes), (
        wholes
    )  # every layout trains the same parameters
    assert len(pairs) == 36 + 3 + 3
    for pair in pairs:
        assert pair["resumed"] == 3 and pair["step"] == 4, pair  # resumed after step 2, ran to 4
        assert pair["worst"] < 1e-12, pair


@pytest.mark.engines
@pytest.mark.timeout(900)
def test_result_model_and_rd_load_give_the_one_process_model_for_every_layout(tmp_path) -> None:
    """rd.train on 4 engines under each layout: result.model() and rd.load(run_id).model() equal one process's model."""
    import cases_checkpoint_layouts as cases
    from mpi4py import MPI

    import rapydli as rd
    from rapydli.trainer import Trainer

    train, val = cases.features()
    one = Trainer(
        cases.mlp(),
        None,
        train,
        val,
        cases.config("dp4", "mlp", batch_size=8, workers=1, max_steps=3),
        comm=MPI.COMM_SELF,
        optimizer_fn=cases.two_groups,
    )
    one.fit()
    one.close()
    expected = one.model.state_dict()
    # the ranks that write pieces of the trained model (nobody gathers it): replica 0's stages and tensor slices; at ZeRO-3 every rank
    writers = {"dp4": 1, "dp2xpp2": 2, "dp2xtp2": 2, "pp2xtp2": 4, "dp4-zero1": 1, "dp2xtp2-zero2": 2, "dp4-zero3": 4}
    with rd.Cluster(n=4) as cluster:
        for name in [*LAYOUTS, "dp4-zero3"]:
            config = cases.config(name, "mlp", max_steps=3, checkpoint_dir=str(tmp_path / name))
            result = rd.train(
                "cases_checkpoint_layouts:mlp",
                "cases_checkpoint_layouts:features",
                config,
                cluster=cluster,
                progress=False,
                live=False,
                optimizer_fn=cases.two_groups,
            )
            assert (
                result.model_dir is not None and len(list(Path(result.model_dir).glob("part-*.pt"))) == writers[name]
            ), name
            for source, model in (("result", result.model()), ("rd.load", rd.load(result.run_id).model())):
                assert type(model) is type(one.model)
                state = model.state_dict()
                assert state.keys() == expected.keys()
                for key, value in expected.items():
                    assert torch.allclose(state[key], value, atol=1e-5, rtol=0), (
                        name,
                        source,
                        key,
                        (state[key] - value).abs().max(),
                    )
            assert result.state_dict().keys() == expected.keys()
            streamed = dict(
                rd.load(result.run_id).tensors()
            )  # tensor by tensor, as for a model bigger than the notebook's memory
            assert streamed.keys() == result._trained().keys() and all(
                torch.equal(streamed[k], v) for k, v in result._trained().items()
            )


def test_pieces_of_any_layout_assemble_to_the_full_tensor_and_cut_again() -> None:
    """A fused qkv weight split over 2 tensor ranks (a range of each of q, k, v), each slice in 3 ZeRO pieces; another layout's cut."""
    from rapydli.errors import ConfigError
    from rapydli.trainer.manifest import Entry, Placement, assemble

    full = torch.arange(12 * 5, dtype=torch.float64).reshape(12, 5)
    entries = []
    for rank in (0, 1):
        ranges = tuple((c * 4 + rank * 2, c * 4 + rank * 2 + 2) for c in range(3))
        whole_slice = Placement((12, 5), 0, ranges)
        assert torch.equal(whole_slice.cut(full), torch.cat([full[a:b] for a, b in ranges]))
        for flat in ((0, 11), (11, 22), (22, 30)):
            piece = whole_slice.sharded(flat)
            entries.append(Entry("qkv.weight", "optim.exp_avg", piece, piece.cut(full).clone()))
    assert torch.equal(assemble(entries), full)
    other = Placement((12, 5), 1, ((2, 4),), flat=(1, 7))  # a column slice's ZeRO piece: another layout
    assert torch.equal(other.cut(assemble(entries)), full[:, 2:4].reshape(-1)[1:7])
    with pytest.raises(
        ConfigError, match=r"holds 19 of the 30 elements of qkv.weight \(optim.exp_avg\): a part is missing"
    ):
        assemble(entries[1:])  # tensor rank 0's first piece is gone


def test_a_half_written_checkpoint_is_never_read(tmp_path) -> None:
    """Parts of step 4 on disk (one half written) and a manifest cut short: the resume reads step 2's complete checkpoint."""
    from mpi4py import MPI
    from torch import nn

    from rapydli.trainer import TrainConfig, Trainer
    from rapydli.zoo import datasets

    def model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 4))

    train, val = datasets.synthetic_features(num_samples=64, in_features=16, num_classes=4)
    config = TrainConfig(batch_size=8, max_steps=4, eval_every=0, workers=1, checkpoint_dir=str(tmp_path))
    whole = Trainer(model(), None, train, val, config.replace(checkpoint_dir=None), comm=MPI.COMM_SELF)
    whole.fit()
    whole.close()
    cut = Trainer(model(), None, train, val, config.replace(max_steps=2), comm=MPI.COMM_SELF)
    cut.fit()
    cut.close()
    (part,) = tmp_path.glob("part-*-step2.pt")
    (tmp_path / part.name.replace("step2", "step4")).write_bytes(
        part.read_bytes()[:100]
    )  # a part of step 4, half written
    (tmp_path / ".checkpoint.pt.x1y2.tmp").write_bytes(
        ckpt.checkpoint_path(tmp_path).read_bytes()[:50]
    )  # its manifest, cut short
    resumed = Trainer(model(), None, train, val, config.replace(resume=True), comm=MPI.COMM_SELF)
    assert resumed.step == 2 and not list(tmp_path.glob(".*.tmp"))
    resumed.fit()
    resumed.close()
    assert (
        max(
            float((a - b).detach().abs().max())
            for a, b in zip(whole.model.parameters(), resumed.model.parameters(), strict=True)
        )
        < 1e-6
    )
    assert sorted(p.name for p in tmp_path.glob("part-*")) == [
        part.name.replace("step2", "step4")
    ]  # step 4's, complete now

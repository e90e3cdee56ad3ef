"""Reference models and data: shapes, determinism, and that they are learnable."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from rapydli.zoo import datasets, models


@pytest.mark.parametrize(
    ("builder", "data"),
    [
        (lambda: models.mlp(in_features=64), lambda: datasets.synthetic_features(num_samples=40)),
        (models.resnet_digits, datasets.digits),
        (lambda: models.resnet_mini(in_channels=3), lambda: datasets.synthetic_images(num_samples=20, size=32)),
        (
            lambda: models.tiny_lm(vocab_size=64, block_size=16),
            lambda: datasets.synthetic_tokens(num_samples=20, block_size=16),
        ),
    ],
)
def test_models_run_on_their_data_and_backprop(builder, data) -> None:
    train, val = data()
    inputs, targets = torch.utils.data.default_collate([train[i] for i in range(4)])
    logits = builder()(inputs)
    assert logits.shape[:-1] == targets.shape and logits.shape[-1] >= int(targets.max()) + 1
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    loss.backward()
    assert len(val) > 0


def test_datasets_are_seeded_and_split() -> None:
    a_train, a_val = datasets.synthetic_images(num_samples=50, size=8, seed=3)
    b_train, _ = datasets.synthetic_images(num_samples=50, size=8, seed=3)
    c_train, _ = datasets.synthetic_images(num_samples=50, size=8, seed=4)
    assert torch.equal(a_train.tensors[0], b_train.tensors[0])
    assert not torch.equal(a_train.tensors[0], c_train.tensors[0])
    assert len(a_train) + len(a_val) == 50 and len(a_val) == 10
    train, val = datasets.digits()
    assert len(train) + len(val) == 1797 and float(train.tensors[0].max()) <= 1.0
    tokens, _ = datasets.synthetic_tokens(num_samples=8, block_size=5, vocab_size=10)
    x, y = tokens[0]
    assert torch.equal(x[1:], y[:-1])


def test_digits_read_from_scikit_learns_file_are_load_digits() -> None:
    """The file is read without importing sklearn.datasets (1 s of every rank's first run); the data are the same."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    images = torch.tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / 16.0
    expected = datasets._split(images, torch.tensor(bunch.target, dtype=torch.int64), 0.2, 0)
    for got, want in zip(datasets.digits(), expected, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(got.tensors, want.tensors, strict=True))
    code = "import sys; from rapydli.zoo import datasets; datasets.digits(); print('sklearn.datasets' in sys.modules)"
    assert (
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
        == "False"
    )


def test_resnet_mini_is_small() -> None:
    count = sum(p.numel() for p in models.resnet_mini().parameters())
    assert 100_000 < count < 300_000  # ~0.18 M
    assert sum(p.numel() for p in models.resnet_digits().parameters()) < count

"""Reference data with no download: the digits scikit-learn ships and seeded synthetic sets.

Every builder returns ``(train_dataset, val_dataset)`` (map-style
:class:`~torch.utils.data.TensorDataset` of ``(input, target)``), the shape ``data_fn``
has in ``rd.train``; builders are importable by name (``rapydli.zoo.datasets:digits``)
and depend only on their arguments, so a run can be repeated.

Examples
--------
>>> train, val = digits()
>>> train[0][0].shape, len(train) + len(val)
(torch.Size([1, 8, 8]), 1797)
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import TensorDataset

from rapydli.errors import ConfigError


def _split(
    inputs: torch.Tensor, targets: torch.Tensor, val_fraction: float, seed: int
) -> tuple[TensorDataset, TensorDataset]:
    if not 0.0 < val_fraction < 1.0:
        raise ConfigError(f"val_fraction={val_fraction} is invalid: must be in (0, 1)")
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(inputs), generator=generator)
    cut = len(inputs) - max(1, int(round(len(inputs) * val_fraction)))
    train, val = order[:cut], order[cut:]
    return TensorDataset(inputs[train], targets[train]), TensorDataset(inputs[val], targets[val])


def digits(val_fraction: float = 0.2, seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """scikit-learn's bundled 8x8 digits as ``(1, 8, 8)`` float images in [0, 1] and int64 labels.

    1797 samples, 10 classes; a seeded split keeps ``val_fraction`` for validation.
    """
    pixels, target = _digits_table()
    images = torch.tensor(pixels, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
    labels = torch.tensor(target, dtype=torch.int64)
    return _split(images, labels, val_fraction, seed)


def _digits_table() -> tuple[Any, Any]:
    """The digits' 64 pixel columns and their labels, read from the file scikit-learn ships.

    Reading ``sklearn/datasets/data/digits.csv.gz`` directly is what ``load_digits`` does,
    without importing ``sklearn.datasets`` (and SciPy with it): about 1 s of every rank's
    first run on this machine. Where the file is not found, ``load_digits`` reads it.
    """
    import importlib.util
    from pathlib import Path

    import numpy as np

    spec = importlib.util.find_spec("sklearn")
    shipped = (
        [Path(place) / "datasets" / "data" / "digits.csv.gz" for place in (spec.submodule_search_locations or [])]
        if spec
        else []
    )
    for path in shipped:
        if path.is_file():
            table = np.loadtxt(path, delimiter=",")
            return table[:, :-1], table[:, -1].astype(np.int64)
    from sklearn.datasets import load_digits

    bunch = load_digits()
    return bunch.data, bunch.target


def synthetic_images(
    num_samples: int = 1024,
    channels: int = 3,
    size: int = 32,
    num_classes: int = 10,
    noise: float = 0.5,
    val_fraction: float = 0.2,
    seed: int = 0,
) -> tuple[TensorDataset, TensorDataset]:
    """Seeded, learnable image classification: each class is a fixed random pattern plus noise."""
    generator = torch.Generator().manual_seed(seed)
    patterns = torch.randn(num_classes, channels, size, size, generator=generator)
    labels = torch.randint(0, num_classes, (num_samples,), generator=generator)
    images = patterns[labels] + noise * torch.randn(num_samples, channels, size, size, generator=generator)
    return _split(images, labels, val_fraction, seed)


def synthetic_features(
    num_samples: int = 1024,
    in_features: int = 64,
    num_classes: int = 10,
    noise: float = 1.0,
    val_fraction: float = 0.2,
    seed: int = 0,
) -> tuple[TensorDataset, TensorDataset]:
    """Seeded, learnable vector classification (Gaussian clusters), for the MLP."""
    generator = torch.Generator().manual_seed(seed)
    centres = 2.0 * torch.randn(num_classes, in_features, generator=generator)
    labels = torch.randint(0, num_classes, (num_samples,), generator=generator)
    features = centres[labels] + noise * torch.randn(num_samples, in_features, generator=generator)
    return _split(features, labels, val_fraction, seed)


def synthetic_tokens(
    num_samples: int = 512, block_size: int = 32, vocab_size: int = 64, val_fraction: float = 0.2, seed: int = 0
) -> tuple[TensorDataset, TensorDataset]:
    """Seeded token sequences a small LM can learn: arithmetic progressions modulo ``vocab_size``.

    Each sample is ``(tokens[:-1], tokens[1:])`` of length ``block_size`` (next-token targets).
    """
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, vocab_size, (num_samples, 1), generator=generator)
    strides = torch.randint(1, 5, (num_samples, 1), generator=generator)
    sequences = (starts + strides * torch.arange(block_size + 1)) % vocab_size
    return _split(sequences[:, :-1].contiguous(), sequences[:, 1:].contiguous(), val_fraction, seed)

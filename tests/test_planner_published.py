"""The planner's data-parallel model against published scaling figures (within 15 %)."""

from __future__ import annotations

import pytest

from rapydli.experiments.planning import published

# The published points, restated here with their sources so that an edit of the module's
# table shows up as a failure:
#
# * Horovod (Sergeev & Del Balso 2018), README and docs/benchmarks.rst of horovod/horovod:
#   "128 servers with 4 Pascal GPUs each connected by RoCE-capable 25 Gbit/s network.
#   Horovod achieves 90% scaling efficiency for both Inception V3 and ResNet-101, and 68%
#   scaling efficiency for VGG-16"; the README of early 2018, "32 servers with 4 Pascal
#   GPUs each": 90 %, 90 % and 79 %. Per-GPU batch 64 (tf_cnn_benchmarks --batch_size 64).
# * One P100 (TensorFlow's benchmarks page, docs_src/performance/benchmarks.md, DGX-1,
#   synthetic data, batch 64): InceptionV3 142 images/s, VGG16 154 images/s.
# * Parameters (keras.io/api/applications): InceptionV3 23.9 M, VGG16 138.4 M.
# ResNet-101 has no published single-GPU throughput in the material available here, and
# Tarantella's "57x on 96 GPUs" (ResNet-50, V100, InfiniBand) could not be verified from
# it either: neither is used.
EXPECTED = {
    ("Inception V3", 128): (0.90, 142.0, 23.9e6),
    ("Inception V3", 512): (0.90, 142.0, 23.9e6),
    ("VGG-16", 128): (0.79, 154.0, 138.4e6),
    ("VGG-16", 512): (0.68, 154.0, 138.4e6),
}


def test_the_points_are_the_published_ones() -> None:
    got = {(p.model, p.devices): (p.efficiency, p.throughput, p.parameters) for p in published.POINTS}
    assert got == EXPECTED
    assert all(p.gbit_per_s == 25.0 and p.batch == 64 for p in published.POINTS)


@pytest.mark.parametrize("row", published.check(), ids=lambda r: f"{r['model']}-{r['gpus']}")
def test_the_model_predicts_each_published_speedup_within_15_percent(row: dict) -> None:
    assert abs(row["error"]) <= published.TOLERANCE, row
    assert row["within"]


def test_the_prediction_scales_with_the_network_and_the_model() -> None:
    vgg, inception = published.POINTS[3], published.POINTS[1]
    # more bandwidth, better scaling; a model 6x larger on the same network scales worse
    assert published.predicted_speedup(vgg, 512) < published.predicted_speedup(
        published.PublishedPoint("VGG-16", 512, 0.68, 154.0, 64, 138.4e6, 100.0, "faster links"), 512
    )
    assert published.predicted_speedup(vgg, 512) / 512 < published.predicted_speedup(inception, 512) / 512
    assert published.predicted_speedup(vgg, 1) == pytest.approx(1.0)
    counts, speedups = published.curves()["VGG-16"]
    assert counts[0] == 1 and counts[-1] == 512 and speedups == sorted(speedups)

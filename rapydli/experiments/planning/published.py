"""Published data-parallel speedups, and the planner's model of them from one device's throughput.

The planner's data-parallel prediction (:func:`rapydli.experiments.planning.stepmodel.exposed_allreduce`:
gradient buckets allreduced over a ring while backward goes on) is checked past this
machine against scaling figures others measured. Given a published single-device
throughput (samples/s at a per-device batch), the model's parameter count (fp32 gradients)
and the network's bandwidth, :func:`predicted_speedup` predicts the speedup on ``n``
devices (weak scaling: the per-device batch is kept). Assumptions, the same for every point:

* backward is 2/3 of a step's compute (twice the forward's work) and produces the
  gradients evenly over its duration;
* gradients are fused into 64 MiB buffers (Horovod's default fusion threshold, docs/tensor-fusion.rst),
  the first at most 1 MiB as the synchronizer does, each allreduced as a ring as soon as it is full;
* a message costs α = 5 µs (an assumption: RoCE latency is a few µs; nothing here
  publishes it); β is the published link bandwidth. α matters where many fused buffers
  cross many ranks: VGG-16 on 512 GPUs is predicted 7 % above the published speedup with
  α = 5 µs, 16 % above with α = 0 and 1 % below with α = 10 µs; the other points move by
  at most 2 %.

Sources (checked against the text available to the project; see :data:`POINTS`):

* Horovod, Sergeev & Del Balso 2018: README and docs/benchmarks.rst of horovod/horovod:
  "128 servers with 4 Pascal GPUs each connected by RoCE-capable 25 Gbit/s network.
  Horovod achieves 90% scaling efficiency for both Inception V3 and ResNet-101, and 68%
  scaling efficiency for VGG-16"; the README of early 2018 (32 servers, 128 GPUs): 90 %,
  90 % and 79 %. Per-GPU batch 64 (the benchmark command in docs/benchmarks.rst).
* Single-GPU throughput: TensorFlow's benchmark page (tensorflow/docs_src/performance/benchmarks.md,
  May 2017), NVIDIA DGX-1, Tesla P100, synthetic data, batch 64 per GPU: InceptionV3
  142 images/s, VGG16 154 images/s. ResNet-101 is not on that page, so its Horovod points
  are left out (no published single-device throughput to start from).
* Parameters: keras.io/api/applications: InceptionV3 23.9 M, VGG16 138.4 M.
* Tarantella's ResNet-50 on V100 over InfiniBand (57x on 96 GPUs) could not be checked
  against any text available here (its documentation's figures are images), so it is not used.
"""

from __future__ import annotations

from dataclasses import dataclass

from rapydli.experiments.planning.network import Network
from rapydli.experiments.planning.perfmodel import RingModel
from rapydli.experiments.planning.stepmodel import exposed_allreduce

#: Within this relative error of the published speedup, a prediction is "within the model".
TOLERANCE = 0.15
BACKWARD_SHARE = 2 / 3
FUSION_BYTES = 64 * (1 << 20)
LATENCY_S = 5e-6
#: Pieces the gradients are produced in over backward (evenly).
PIECES = 256


@dataclass(frozen=True)
class PublishedPoint:
    """One published scaling figure and what the model needs to predict it.

    Attributes
    ----------
    model, devices, efficiency
        The network trained, the devices, and the published scaling efficiency (speedup / devices).
    throughput
        Published samples/s of one device at ``batch`` per device.
    parameters
        Trained parameters (fp32 gradients of ``4 * parameters`` bytes).
    gbit_per_s
        The link bandwidth between nodes.
    source
        Where the efficiency and the throughput were published.
    """

    model: str
    devices: int
    efficiency: float
    throughput: float
    batch: int
    parameters: float
    gbit_per_s: float
    source: str

    @property
    def speedup(self) -> float:
        """The published speedup over one device."""
        return self.efficiency * self.devices


_HOROVOD = "Horovod README / docs/benchmarks.rst (Sergeev & Del Balso 2018); P100 throughput: TensorFlow benchmarks page (2017)"
POINTS = (
    PublishedPoint("Inception V3", 128, 0.90, 142.0, 64, 23.9e6, 25.0, _HOROVOD),
    PublishedPoint("Inception V3", 512, 0.90, 142.0, 64, 23.9e6, 25.0, _HOROVOD),
    PublishedPoint("VGG-16", 128, 0.79, 154.0, 64, 138.4e6, 25.0, _HOROVOD),
    PublishedPoint("VGG-16", 512, 0.68, 154.0, 64, 138.4e6, 25.0, _HOROVOD),
)


def network_of(gbit_per_s: float, alpha: float = LATENCY_S) -> Network:
    """A network of ``gbit_per_s`` links and message latency ``alpha`` (every kind of communication alike)."""
    return Network.from_ring(
        RingModel(alpha=alpha, beta=8.0 / (gbit_per_s * 1e9), source=f"{gbit_per_s:g} Gbit/s, α = {alpha * 1e6:g} µs")
    )


def predicted_speedup(point: PublishedPoint, devices: int, alpha: float = LATENCY_S) -> float:
    """Speedup over one device on ``devices`` devices, from ``point``'s throughput, model and network."""
    compute = point.batch / point.throughput
    backward = BACKWARD_SHARE * compute
    forward = compute - backward
    piece = 4.0 * point.parameters / PIECES
    ready = [(forward + backward * (i + 1) / PIECES, int(piece)) for i in range(PIECES)]
    exposed = exposed_allreduce(ready, compute, network_of(point.gbit_per_s, alpha), devices, FUSION_BYTES)
    return devices * compute / (compute + exposed)


def check(points: tuple[PublishedPoint, ...] = POINTS) -> list[dict[str, object]]:
    """One row per point: published and predicted speedup, relative error, and whether it is within :data:`TOLERANCE`."""
    rows: list[dict[str, object]] = []
    for point in points:
        predicted = predicted_speedup(point, point.devices)
        error = (predicted - point.speedup) / point.speedup
        rows.append(
            {
                "model": point.model,
                "gpus": point.devices,
                "published_efficiency": point.efficiency,
                "published_speedup": point.speedup,
                "predicted_speedup": predicted,
                "error": error,
                "within": abs(error) <= TOLERANCE,
                "source": point.source,
            }
        )
    return rows


def curves(points: tuple[PublishedPoint, ...] = POINTS, most: int = 512) -> dict[str, tuple[list[int], list[float]]]:
    """Predicted speedup of each model at 1, 2, 4, ... ``most`` devices (for the figure)."""
    counts = [2**i for i in range(most.bit_length()) if 2**i <= most]
    first = {p.model: p for p in points}
    return {name: (counts, [predicted_speedup(point, n) for n in counts]) for name, point in first.items()}

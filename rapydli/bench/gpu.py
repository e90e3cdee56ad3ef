"""``rapydli bench gpu --json PATH``: the GPU path against the library, on one CUDA device.

Two parts, each with its peer measured in the same run, in interleaved rounds (every
variant once per round, the order rotating), reported as the median with the range of
the rounds:

1. The convolution layers of the RaPyDLI background tables (AlexNet, OverFeat) at the
   batch whose forward is about ``--gflop`` GFLOP: forward GFLOP/s (effective: the direct
   convolution's flop count over the time; cuDNN's FFT and Winograd algorithms do less
   arithmetic, so a figure can exceed the chip's float32 peak) of cuDNN as torch
   runs it by default (float32 through TF32 where torch allows it), cuDNN in strict
   float32 (TF32 off), cuDNN channels-last, the best Triton configuration the tuner
   found (IEEE float32) and the tuner's choice among them; ratios are per round.
2. Training steps per second of the small ResNet (``rapydli.zoo.models.resnet_mini``)
   on the GPU: float32, bf16 autocast and channels-last.

Timing waits for the GPU (``torch.cuda.synchronize``) around each timed block of calls.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import click
import torch
import torch.nn.functional as F

from rapydli.bench.report import emit
from rapydli.errors import ConfigError
from rapydli.spread import Spread, paired, rounds_text

#: the background tables' layers (names of :data:`rapydli.bench.conv.LAYERS`)
BACKGROUND = ("alexnet.conv1", "alexnet.conv2", "alexnet.conv3", "alexnet.conv5",
              "overfeat.conv1", "overfeat.conv2", "overfeat.conv3")  # fmt: skip
TUNED_CANDIDATES = ("torch_nchw", "torch_channels_last", "triton_igemm")


@contextlib.contextmanager
def tf32(allowed: bool) -> Iterator[None]:
    """cuDNN and cuBLAS float32 through TF32 (``allowed``) or strict float32 inside the block."""
    before = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = allowed
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = before


def _synchronize() -> None:
    """Wait for the GPU's queued kernels (nothing to wait for without one)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def interleaved(variants: dict[str, Callable[[], Any]], rounds: int, calls: int) -> dict[str, list[float]]:
    """Ms per call of each variant in each round: ``calls`` calls timed together, variants rotating within rounds."""
    names = list(variants)
    for name in names:  # warm-up: cuDNN's algorithm search, Triton's compilation, the allocator
        for _ in range(2):
            variants[name]()
    _synchronize()
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(rounds):
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
            _synchronize()
            start = time.perf_counter()
            for _ in range(calls):
                variants[name]()
            _synchronize()
            times[name].append((time.perf_counter() - start) * 1e3 / calls)
    return times


def layer_rows(
    names: tuple[str, ...], gflop: float, preset: str, rounds: int, calls: int, device: str = "cuda"
) -> list[dict[str, Any]]:
    """One row per layer: GFLOP/s of each variant (median and range of the rounds), the tuner's choice and the ratios."""
    from rapydli.autotune.candidates import get
    from rapydli.autotune.conv import tune_conv2d
    from rapydli.bench.conv import layer_shape

    rows = []
    torch.backends.cudnn.benchmark = True
    for name in names:
        shape = layer_shape(name, gflop)
        result = tune_conv2d(
            shape, device, "inference", candidates=list(TUNED_CANDIDATES), preset=preset, cache=False, repetitions=5
        )
        triton = result.best_of(lambda c: c.candidate == "triton_igemm")
        gen = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(shape.n, shape.c, shape.h, shape.w, device=device, generator=gen)
        w = torch.randn(shape.weight_shape, device=device, generator=gen)
        x_cl, w_cl = x.contiguous(memory_format=torch.channels_last), w.contiguous(memory_format=torch.channels_last)

        def cudnn(x: torch.Tensor = x, w: torch.Tensor = w, s: Any = shape) -> Any:
            return F.conv2d(x, w, None, s.stride, s.pad)

        def cudnn_fp32(x: torch.Tensor = x, w: torch.Tensor = w, s: Any = shape) -> Any:
            with tf32(False):
                return F.conv2d(x, w, None, s.stride, s.pad)

        def cudnn_cl(x: torch.Tensor = x_cl, w: torch.Tensor = w_cl, s: Any = shape) -> Any:
            return F.conv2d(x, w, None, s.stride, s.pad)

        variants: dict[str, Callable[[], Any]] = {
            "cudnn": cudnn,
            "cudnn_fp32": cudnn_fp32,
            "cudnn_channels_last": cudnn_cl,
        }
        if triton is not None:
            variants["triton"] = _forward_of(get("triton_igemm").instance(shape, triton.config.param_dict), x, w)
        chosen = result.best.config
        variants["tuned"] = _forward_of(get(chosen.candidate).instance(shape, chosen.param_dict), x, w)
        with torch.no_grad():
            ms = interleaved(variants, rounds, calls)
        gflops = {k: Spread.of([shape.flops / (t / 1e3) / 1e9 for t in v]) for k, v in ms.items()}
        row: dict[str, Any] = {
            "layer": name,
            "shape": shape.text,
            "tuned_choice": str(chosen),
            "triton_choice": str(triton.config) if triton is not None else None,
        }
        for k, spread in gflops.items():
            row[f"{k}_gflops"] = spread.median
            row[f"{k}_gflops_range"] = f"{spread.low:.4g}-{spread.high:.4g}"
        for k in ("tuned", "triton"):
            if k in ms:
                ratio = paired(ms["cudnn"], ms[k])  # speed ratio: cuDNN's ms over this one's, per round
                row[f"{k}_vs_cudnn"] = ratio.median
                row[f"{k}_vs_cudnn_rounds"] = rounds_text(ratio)
                row[f"{k}_vs_cudnn_verdict"] = {"above 1": "faster", "below 1": "slower"}.get(
                    ratio.verdict(), "not distinguishable"
                )
        if "triton" in ms:
            strict = paired(ms["cudnn_fp32"], ms["triton"])
            row["triton_vs_cudnn_fp32"] = strict.median
            row["triton_vs_cudnn_fp32_rounds"] = rounds_text(strict)
        rows.append(row)
    return rows


def _forward_of(inst: Any, x: torch.Tensor, w: torch.Tensor) -> Callable[[], Any]:
    """A call of ``inst``'s forward on ``x`` and ``w``, already in its layout."""
    x, w = inst.to_layout(x), inst.to_layout(w)
    return lambda: inst.forward(x, w)


def step_rows(batch: int, width: int, rounds: int, calls: int, device: str = "cuda") -> list[dict[str, Any]]:
    """Training steps per second of the small ResNet on the GPU: float32, bf16 autocast, channels-last."""
    from rapydli.zoo.models import resnet_mini

    torch.backends.cudnn.benchmark = True
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(batch, 3, 32, 32, device=device, generator=gen)
    y = torch.randint(0, 10, (batch,), device=device, generator=gen)
    variants: dict[str, Callable[[], Any]] = {}
    for name, memory, precision in (
        ("fp32", torch.contiguous_format, None),
        ("bf16", torch.contiguous_format, torch.bfloat16),
        ("channels_last", torch.channels_last, None),
    ):
        torch.manual_seed(0)
        model = resnet_mini(width=width).to(device).to(memory_format=memory)  # type: ignore[call-overload]  # torch's stub omits memory_format
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        inputs = x.contiguous(memory_format=memory)

        def step(model: Any = model, opt: Any = opt, inputs: torch.Tensor = inputs, precision: Any = precision) -> None:
            opt.zero_grad(set_to_none=True)
            with torch.autocast(device, dtype=precision or torch.float32, enabled=precision is not None):
                loss = F.cross_entropy(model(inputs), y)
            loss.backward()
            opt.step()

        variants[name] = step
    ms = interleaved(variants, rounds, calls)
    rows = []
    for name, per_call in ms.items():
        rate = Spread.of([1e3 / t for t in per_call])
        ratio = paired(ms["fp32"], per_call)
        rows.append(
            {
                "model": f"resnet_mini(width={width})",
                "batch": batch,
                "variant": name,
                "steps_per_s": rate.median,
                "steps_per_s_range": f"{rate.low:.4g}-{rate.high:.4g}",
                "images_per_s": rate.median * batch,
                "speedup_vs_fp32": ratio.median,
                "speedup_rounds": rounds_text(ratio),
                "rounds": rate.n,
            }
        )
    return rows


def run(
    gflop: float = 20.0,
    preset: str = "small",
    rounds: int = 7,
    calls: int = 30,
    batch: int = 256,
    width: int = 64,
    layers: tuple[str, ...] = BACKGROUND,
    device: str = "cuda",
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Both parts; returns the rows and the summary (see the module docstring).

    ``device="cpu"`` runs the same program on the CPU (no Triton there): a rehearsal of
    the benchmark, not a GPU figure.
    """
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("rapydli bench gpu needs a CUDA GPU, and torch.cuda.is_available() is False here")
    conv = layer_rows(layers, gflop, preset, rounds, calls, device)
    steps = step_rows(batch, width, rounds, calls, device)
    tuned = Spread.of([r["tuned_vs_cudnn"] for r in conv])
    triton = [r["triton_vs_cudnn"] for r in conv if "triton_vs_cudnn" in r]
    summary = {
        "device": torch.cuda.get_device_name() if device == "cuda" else device,
        "layers": len(conv),
        "tuned_vs_cudnn_median_over_layers": tuned.median,
        "tuned_vs_cudnn_range_over_layers": f"{tuned.low:.3g}-{tuned.high:.3g}",
        # per layer, from its rounds: faster or slower only when every round says so
        "tuned_vs_cudnn_layers": {
            v: sum(r["tuned_vs_cudnn_verdict"] == v for r in conv) for v in ("faster", "slower", "not distinguishable")
        },
        "triton_vs_cudnn_median_over_layers": statistics.median(triton) if triton else None,
        **{f"resnet_steps_per_s_{r['variant']}": r["steps_per_s"] for r in steps},
    }
    return conv + steps, summary


@click.command("gpu")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help="write rows + summary as JSON")
@click.option("--gflop", type=float, default=20.0, show_default=True, help="forward GFLOP per layer measurement")
@click.option(
    "--preset",
    type=click.Choice(["tiny", "small", "default", "full"]),
    default="small",
    show_default=True,
    help="Triton configurations the tuner tries",
)
@click.option("--rounds", type=click.IntRange(min=3), default=7, show_default=True, help="interleaved rounds")
@click.option("--quick", is_flag=True, help="two layers, a smaller ResNet batch (a smoke run)")
def command(json_path: str | None, gflop: float, preset: str, rounds: int, quick: bool) -> None:
    """Tuned convolutions (Triton against cuDNN) and training steps on one CUDA GPU."""
    layers = BACKGROUND[1:3] if quick else BACKGROUND
    rows, summary = run(gflop=gflop, preset=preset, rounds=rounds, batch=64 if quick else 256, layers=layers)
    emit("gpu", rows, summary, json_path)


if __name__ == "__main__":
    command()

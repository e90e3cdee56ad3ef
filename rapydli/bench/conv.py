"""``rapydli bench conv --json PATH``: tuned convolutions against the library, per layer and per model.

Four parts, each with its peer measured in the same run:

1. Layers of AlexNet, Overfeat and ResNet-50 (batch chosen so one forward is about
   ``--gflop`` GFLOP, well under a second): GFLOP/s of ``F.conv2d`` (NCHW, oneDNN),
   ``F.conv2d`` channels-last, im2col+GEMM, the best generated C kernel, and the tuned
   choice (forward; the tuner's own measurements).
2. Training step (forward, backward, SGD step) of the small ResNet (``rapydli.zoo.models``)
   and of a ResNet-50-style bottleneck stack: default model, whole model channels-last,
   and ``autotune_model`` (train mode), timed in interleaved rounds; speedups are the
   median of the per-round ratios, with their quartiles and the load average around them.
3. Tuning time of three layers on 2 engines against 1, at 1 thread per timed run and at
   all cores per timed run. Counted: building (compiling the generated kernels from an
   empty kernel cache), validating, timing, round trips and the result cache. Not counted:
   starting the engines and their first imports (one warm 2-engine cluster serves both;
   "1 engine" is its rank 0 alone).

Targets (issue 6): tuned training step >= 1.2x the default on the conv-heavy models and
never slower; tuned choice >= 0.98x the best library variant on every layer; best
generated kernel >= 0.5x oneDNN on at least half of the layers; tuning with 2 engines
<= 0.65x the time with 1. Targets (issue 19): ResNet-18-shaped cold tuning <= 120 s, its tuned
step >= 1.0x always and >= 1.1x the untuned one; warm start < 1 s.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import torch
import torch.nn.functional as F
from torch import nn

from rapydli.autotune.cache import Cache
from rapydli.autotune.conv import tune_conv2d
from rapydli.autotune.problem import ConvShape
from rapydli.autotune.search import Config
from rapydli.bench.report import emit, machine_info
from rapydli.settings import HOME, home_at

LIBRARY = ("torch_nchw", "torch_channels_last", "im2col_gemm", "gemm_1x1")  # gemm_1x1: 1x1 layers only

# name -> (C, H, W, K, R, S, stride, pad) at batch 1
LAYERS: dict[str, tuple[int, ...]] = {
    "alexnet.conv1": (3, 224, 224, 64, 11, 11, 4, 2),
    "alexnet.conv2": (64, 27, 27, 192, 5, 5, 1, 2),
    "alexnet.conv3": (192, 13, 13, 384, 3, 3, 1, 1),
    "alexnet.conv5": (256, 13, 13, 256, 3, 3, 1, 1),
    "overfeat.conv1": (3, 231, 231, 96, 11, 11, 4, 0),
    "overfeat.conv2": (96, 24, 24, 256, 5, 5, 1, 0),
    "overfeat.conv3": (256, 12, 12, 512, 3, 3, 1, 1),
    "resnet50.conv1": (3, 224, 224, 64, 7, 7, 2, 3),
    "resnet50.res2_1x1a": (256, 56, 56, 64, 1, 1, 1, 0),
    "resnet50.res2_3x3": (64, 56, 56, 64, 3, 3, 1, 1),
    "resnet50.res3_3x3": (128, 28, 28, 128, 3, 3, 1, 1),
    "resnet50.res4_3x3": (256, 14, 14, 256, 3, 3, 1, 1),
    "resnet50.res4_1x1b": (256, 14, 14, 1024, 1, 1, 1, 0),
    "resnet50.res5_3x3": (512, 7, 7, 512, 3, 3, 1, 1),
}
QUICK = ("alexnet.conv2", "resnet50.res2_3x3", "resnet50.res4_1x1b")
PARTS = ("layers", "models", "engines", "resnet18")

STEP_TARGET, LIBRARY_TARGET, GENERATED_TARGET, ENGINES_TARGET = 1.2, 0.98, 0.5, 0.65
R18_TUNE_S, R18_STEP, R18_WARM_S = 120.0, 1.1, 1.0


def layer_shape(name: str, gflop: float) -> ConvShape:
    """The layer at the batch whose forward is about ``gflop`` GFLOP (1..64)."""
    c, h, w, k, r, s, stride, pad = LAYERS[name]
    one = ConvShape(1, c, h, w, k, r, s, stride, pad)
    return one.with_batch(max(1, min(64, round(gflop * 1e9 / one.flops))))


class Bottleneck(nn.Module):
    """ResNet-50's bottleneck: 1x1 reduce, 3x3, 1x1 expand, with a residual connection."""

    def __init__(self, channels: int, mid: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(channels, mid, 1, bias=False),
            nn.BatchNorm2d(mid),
            nn.ReLU(),
            nn.Conv2d(mid, mid, 3, padding=1, bias=False),
            nn.BatchNorm2d(mid),
            nn.ReLU(),
            nn.Conv2d(mid, channels, 1, bias=False),
            nn.BatchNorm2d(channels),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.body(x))


def bottleneck_stack(channels: int = 256, mid: int = 64, blocks: int = 3, num_classes: int = 10) -> nn.Module:
    """A ResNet-50-style stack: a 3x3 stem to ``channels``, ``blocks`` bottlenecks, a linear head."""
    return nn.Sequential(
        nn.Conv2d(3, channels, 3, padding=1, bias=False),
        nn.BatchNorm2d(channels),
        nn.ReLU(),
        *[Bottleneck(channels, mid) for _ in range(blocks)],
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(channels, num_classes),
    )


def compare_training_steps(
    models: dict[str, nn.Module], x: torch.Tensor, y: torch.Tensor, reps: int
) -> dict[str, list[float]]:
    """Ms of one training step (forward, cross-entropy, backward, SGD step) of each model, per round.

    Models are timed in ``reps`` interleaved rounds after 3 warm-up rounds, the order rotating
    every round, so a drifting machine load and the position in a round hit them alike; round
    ``i`` of every model was measured within the same fraction of a second, so ratios are
    best taken per round (see :func:`paired`).
    """
    opts = {name: torch.optim.SGD(m.parameters(), lr=1e-3) for name, m in models.items()}
    inputs = {
        name: x.contiguous(memory_format=torch.channels_last) if name == "channels_last" else x for name in models
    }
    names = list(models)
    times: dict[str, list[float]] = {name: [] for name in models}
    for round_ in range(reps + 3):
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
            models[name].train()
            start = time.perf_counter()
            opts[name].zero_grad(set_to_none=True)
            F.cross_entropy(models[name](inputs[name]), y).backward()
            opts[name].step()
            if round_ >= 3:
                times[name].append((time.perf_counter() - start) * 1e3)
    return times


def paired(base: list[float], other: list[float]) -> tuple[float, float, float]:
    """Median, 25th and 75th percentile of the per-round speedups ``base[i] / other[i]``."""
    q1, median, q3 = statistics.quantiles([b / o for b, o in zip(base, other)], n=4, method="inclusive")
    return median, q1, q3


def _of_candidate(name: str) -> Callable[[Config], bool]:
    """A predicate: whether a configuration is of candidate ``name``."""
    return lambda cfg: cfg.candidate == name


def layer_rows(names: tuple[str, ...], gflop: float, preset: str, cache: Cache) -> list[dict[str, Any]]:
    rows = []
    for name in names:
        shape = layer_shape(name, gflop)
        result = tune_conv2d(shape, "cpu", "inference", preset=preset, cache=cache, repetitions=5)
        flops = shape.flops

        def gflops(m: Any, flops: int = flops) -> float | None:
            return flops / m.median / 1e9 if m is not None else None

        best = {c: result.best_of(_of_candidate(c)) for c in (*LIBRARY, "c_direct")}
        best_library = max(gflops(best[c]) or 0.0 for c in LIBRARY)
        onednn = max(gflops(best["torch_nchw"]) or 0.0, gflops(best["torch_channels_last"]) or 0.0)
        tuned = gflops(result.best)
        assert tuned is not None  # result.best is a measurement
        generated = gflops(best["c_direct"])
        rows.append(
            {
                "layer": name,
                "shape": shape.text,
                "nchw_gflops": gflops(best["torch_nchw"]),
                "channels_last_gflops": gflops(best["torch_channels_last"]),
                "im2col_gflops": gflops(best["im2col_gemm"]),
                "gemm_1x1_gflops": gflops(best["gemm_1x1"]),
                "generated_gflops": generated,
                "tuned_gflops": tuned,
                "tuned_choice": str(result.best.config),
                "tuned_vs_best_library": tuned / best_library if best_library else None,
                "generated_vs_onednn": (generated / onednn) if generated and onednn else None,
                "best_generated": str(best["c_direct"].config) if best["c_direct"] else None,
            }
        )
    return rows


def model_rows(batch: int, preset: str, cache: Cache, reps: int) -> list[dict[str, Any]]:
    from rapydli.autotune.model import autotune_model
    from rapydli.zoo.models import resnet_mini

    rows = []
    models = {
        "resnet_mini": (lambda: resnet_mini(width=32), (batch, 3, 32, 32)),
        "bottleneck_stack": (lambda: bottleneck_stack(), (max(1, batch // 4), 3, 28, 28)),
    }
    for name, (build, in_shape) in models.items():
        torch.manual_seed(0)
        model = build()
        x = torch.randn(*in_shape)
        y = torch.randint(0, 10, (in_shape[0],))
        started = time.perf_counter()
        tuned_model, report = autotune_model(model, x, "train", preset=preset, cache=cache, repetitions=3)
        tune_s = time.perf_counter() - started
        torch.manual_seed(0)
        cl_model = build().to(memory_format=torch.channels_last)  # type: ignore[call-overload]  # torch's stub omits memory_format
        load = os.getloadavg()[0]
        ms = compare_training_steps({"default": model, "channels_last": cl_model, "tuned": tuned_model}, x, y, reps)
        speedup, low, high = paired(ms["default"], ms["tuned"])
        rows.append(
            {
                "model": name,
                "input": "x".join(map(str, in_shape)),
                "rounds": reps,
                **{f"{k}_ms": statistics.median(v) for k, v in ms.items()},
                "speedup": speedup,
                "speedup_iqr": f"{low:.3f}-{high:.3f}",
                "channels_last_speedup": paired(ms["default"], ms["channels_last"])[0],
                "tuned_vs_channels_last": paired(ms["channels_last"], ms["tuned"])[0],
                "load_avg": f"{load:.2f}-{os.getloadavg()[0]:.2f}",
                "tune_s": tune_s,
                "whole_model_choice": report.plan.chosen,
                "whole_model_check_ms": " ".join(
                    f"{k.removeprefix('measured_')}={v:.1f}"
                    for k, v in report.estimates_ms.items()
                    if k.startswith("measured_")
                ),
                "plan": ", ".join(
                    f"{k} x{v}"
                    for k, v in Counter(
                        "+".join(dict.fromkeys(c.candidate for c in choice.configs.values())) + f"/{choice.layout}"
                        for choice in report.plan.layers.values()
                    ).most_common()
                ),
            }
        )
    return rows


def resnet18_rows(batch: int, budget_s: float, preset: str, reps: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The ResNet-18-shaped model tuned cold within ``budget_s``, its step against the untuned one, a warm start.

    Returns one summary row and the per-layer-shape rows of the tuning. Both caches (results
    and compiled kernels) start empty: ``RAPYDLI_HOME`` points at a fresh directory meanwhile.
    """
    from rapydli.autotune.model import autotune_model
    from rapydli.zoo.models import resnet18_like

    with tempfile.TemporaryDirectory(prefix="rapydli-bench-r18-") as home, home_at(home):
        torch.manual_seed(0)
        model = resnet18_like()
        x, y = torch.randn(batch, 3, 32, 32), torch.randint(0, 10, (batch,))
        cache = Cache(os.path.join(home, "tune.db"))
        load_before = os.getloadavg()[0]
        started = time.perf_counter()
        tuned, report = autotune_model(model, x, "train", budget_s=budget_s, preset=preset, cache=cache)
        tune_s = time.perf_counter() - started
        load_tuning = f"{load_before:.2f}-{os.getloadavg()[0]:.2f}"
        started = time.perf_counter()
        warm_model, warm = autotune_model(
            model, x, "train", budget_s=budget_s, preset=preset, cache=cache, progress=False
        )
        warm_s = time.perf_counter() - started
        load = os.getloadavg()[0]
        ms = compare_training_steps({"default": model, "tuned": tuned}, x, y, reps)
    speedup, low, high = paired(ms["default"], ms["tuned"])
    row = {
        "model": "resnet18_like",
        "input": f"{batch}x3x32x32",
        "budget_s": budget_s,
        "tune_s": tune_s,
        "load_tuning": load_tuning,
        "skipped_layers": len(report.skipped),
        "measured": report.measured,
        **{f"time_{k}_s": v for k, v in report.time_s.items()},
        "default_ms": statistics.median(ms["default"]),
        "tuned_ms": statistics.median(ms["tuned"]),
        "speedup": speedup,
        "speedup_iqr": f"{low:.3f}-{high:.3f}",
        "load_steps": f"{load:.2f}-{os.getloadavg()[0]:.2f}",
        "whole_model_choice": report.plan.chosen,
        "plan_is_default": "nothing faster" in report.summary,
        "whole_model_check_ms": " ".join(
            f"{k.removeprefix('measured_')}={v:.1f}"
            for k, v in report.estimates_ms.items()
            if k.startswith("measured_")
        ),
        "warm_s": warm_s,
        "warm_from_cache": warm.from_cache,
        "warm_same_plan": warm.plan.layers == report.plan.layers,
        "summary": report.summary,
    }
    del warm_model
    layers = [{k: v for k, v in r.items() if k != "names"} for r in report.layers.to_dict(orient="records")]
    return row, layers


class _FirstEngine:
    """Rank 0 of a cluster alone: the 1-engine side of the tuning-time comparison."""

    def __init__(self, cluster: Any) -> None:
        self.cluster = cluster

    def view(self, targets: list[int] | None = None) -> Any:
        return self.cluster.view(targets=[0] if targets is None else targets)


def _set_home(home: str) -> None:
    """Point this engine's ``RAPYDLI_HOME`` at ``home`` (its caches start empty there)."""
    os.environ[HOME] = home


def _winner(result: Any) -> str:
    """The winning configuration and how much slower the runner-up was (a near tie can flip between runs)."""
    times = sorted(m.median for m in result.measurements if m.ok)
    margin = f" (+{(times[1] / times[0] - 1) * 100:.0f}%)" if len(times) > 1 else ""
    return f"{result.best.config}{margin}"


def tuning_times(names: tuple[str, ...], gflop: float, preset: str) -> list[dict[str, Any]]:
    """Seconds to tune ``names`` on 1 and on 2 engines of one warm cluster, at 1 thread and all cores per timing.

    Each tuning starts from empty kernel and result caches (compiles included); the
    cluster start and the engines' first imports are not counted (a warm-up tuning
    runs first). The winners are reported with the runner-up's margin, so a reader can
    check they do not depend on the engine count beyond near ties.
    """
    from rapydli.autotune.runner import ParallelRunner
    from rapydli.cluster import Cluster

    cores = len(os.sched_getaffinity(0))
    rows = []
    with tempfile.TemporaryDirectory(prefix="rapydli-bench-conv-") as tmp, Cluster(n=2) as cluster:

        def tune_all(
            engines: Any, threads: int, home: str, layers: tuple[str, ...], g: float
        ) -> tuple[float, list[str]]:
            cluster.view().apply_sync(_set_home, home)
            runner, cache = ParallelRunner(engines), Cache(os.path.join(home, "tune.db"))
            started = time.perf_counter()
            results = [
                tune_conv2d(
                    layer_shape(name, g),
                    "cpu",
                    "inference",
                    runner=runner,
                    preset=preset,
                    cache=cache,
                    repetitions=3,
                    threads=threads,
                )
                for name in layers
            ]
            return time.perf_counter() - started, [_winner(r) for r in results]

        tune_all(cluster, 1, os.path.join(tmp, "warm-up"), names[:1], 0.01)
        for threads in sorted({1, cores}):
            one, best_one = tune_all(_FirstEngine(cluster), threads, os.path.join(tmp, f"1-{threads}"), names, gflop)
            two, best_two = tune_all(cluster, threads, os.path.join(tmp, f"2-{threads}"), names, gflop)
            for engines, seconds, best in ((1, one, best_one), (2, two, best_two)):
                rows.append(
                    {
                        "threads_per_timing": threads,
                        "engines": engines,
                        "tune_s": seconds,
                        "ratio": seconds / one,
                        "winners": ", ".join(best),
                    }
                )
    return rows


def no_room(row: dict[str, Any], layers: list[dict[str, Any]]) -> str:
    """Why the ResNet-18-shaped tuning did not pay: the per-layer best/default ratios and the whole-model check."""
    ratios = sorted(r["speedup"] for r in layers if r["speedup"] and r["speedup"] == r["speedup"])
    spread = (
        f"{ratios[0]:.2f}-{ratios[-1]:.2f}x (median {statistics.median(ratios):.2f}x)" if ratios else "none measured"
    )
    check = row["whole_model_check_ms"] or "not run (every layer kept the library default)"
    lead = (
        "oneDNN left no room: the plan is the library default"
        if row["plan_is_default"]
        else "the per-layer gains did not add up to it in the whole step"
    )
    return f"{lead}; per-layer best/default {spread} over {len(layers)} shapes; whole-model check (ms): {check}"


def verdict(ok: bool) -> str:
    return "met" if ok else "NOT met"


@click.command("conv")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help="write rows + summary as JSON")
@click.option("--quick", is_flag=True, help=f"only {len(QUICK)} layers, smaller models (a smoke run)")
@click.option("--gflop", type=float, default=2.0, show_default=True, help="forward GFLOP per layer measurement")
@click.option("--preset", type=click.Choice(["tiny", "small", "default", "full"]), default="small", show_default=True)
@click.option("--batch", type=int, default=32, show_default=True, help="batch of the small ResNet")
@click.option(
    "--reps",
    type=click.IntRange(min=2),
    default=15,
    show_default=True,
    help="interleaved rounds of timed training steps per model (median and quartiles reported)",
)
@click.option(
    "--part", "parts", type=click.Choice(PARTS), multiple=True, help="run only these parts (repeatable; default: all)"
)
@click.option(
    "--budget-s",
    type=click.FloatRange(min=0, min_open=True),
    default=60.0,
    show_default=True,
    help="tuning budget of the resnet18 part",
)
@click.option(
    "--layer",
    "layer_names",
    type=click.Choice(tuple(LAYERS)),
    multiple=True,
    help="only these layers (repeatable; default: all, or the quick ones with --quick)",
)
def command(
    json_path: str | None,
    quick: bool,
    gflop: float,
    preset: str,
    batch: int,
    reps: int,
    parts: tuple[str, ...],
    budget_s: float,
    layer_names: tuple[str, ...],
) -> None:
    """Convolution GFLOP/s per layer, training steps with and without autotune_model, tuning time."""
    parts = parts or PARTS
    names = layer_names or (QUICK if quick else tuple(LAYERS))
    if quick:
        gflop, batch, reps = min(gflop, 0.5), min(batch, 8), min(reps, 5)
    with tempfile.TemporaryDirectory(prefix="rapydli-bench-conv-cache-") as tmp:
        cache = Cache(os.path.join(tmp, "tune.db"))  # fresh results: the tuner measures in this run
        layers = layer_rows(names, gflop, preset, cache) if "layers" in parts else []
        models = model_rows(batch, preset, cache, reps) if "models" in parts else []
    engine_rows = tuning_times(QUICK[:2] if quick else QUICK, gflop, preset) if "engines" in parts else []
    r18, r18_layers = resnet18_rows(8, budget_s, "default", reps) if "resnet18" in parts else (None, [])

    summary: dict[str, Any] = {}
    tables = [
        (f"conv: {title}", part)
        for title, part in (
            ("layers (forward GFLOP/s)", layers),
            ("training step (ms)", models),
            ("tuning time, 1 vs 2 engines", engine_rows),
            ("resnet18-shaped, per layer shape (ms per layer)", r18_layers),
            ("resnet18-shaped, cold tuning and training step", [r18] if r18 else []),
        )
        if part
    ]
    if layers:
        library_ok = all((r["tuned_vs_best_library"] or 0) >= LIBRARY_TARGET for r in layers)
        good = [r["layer"] for r in layers if (r["generated_vs_onednn"] or 0) >= GENERATED_TARGET]
        summary[f"target tuned choice >= {LIBRARY_TARGET}x best library on every layer"] = verdict(library_ok)
        summary[f"best generated >= {GENERATED_TARGET}x oneDNN on >= half the layers"] = (
            f"{verdict(len(good) * 2 >= len(layers))} ({len(good)}/{len(layers)}: {', '.join(good) or 'none'})"
        )
    if models:
        summary["tuned step speedup (per model; median of per-round ratios, quartiles, load average)"] = ", ".join(
            f"{r['model']} {r['speedup']:.2f}x ({r['speedup_iqr']}, load {r['load_avg']})" for r in models
        )
        summary[f"target tuned step >= {STEP_TARGET}x on conv-heavy models"] = verdict(
            all(r["speedup"] >= STEP_TARGET for r in models)
        )
        summary["target tuned step never slower (>= 1.0x)"] = verdict(all(r["speedup"] >= 1.0 for r in models))
    for r in engine_rows:
        if r["engines"] == 2:
            t = r["threads_per_timing"]
            summary[f"target tuning time 2 engines <= {ENGINES_TARGET}x 1 engine, {t} thread(s) per timed run"] = (
                f"{verdict(r['ratio'] <= ENGINES_TARGET)} ({r['ratio']:.2f}x)"
            )
    if engine_rows:
        summary["tuning time counts"] = (
            "compiles from an empty kernel cache, validation, timing, round trips, "
            "result cache; not the engine start (one warm 2-engine cluster; "
            "1 engine = its rank 0)"
        )
    if r18:
        summary["resnet18: cold tuning"] = (
            f"{r18['tune_s']:.1f} s (budget {r18['budget_s']:g} s, load "
            f"{r18['load_tuning']}); {r18['skipped_layers']} layers skipped by the budget"
        )
        summary[f"target resnet18 cold tuning <= {R18_TUNE_S:g} s"] = verdict(r18["tune_s"] <= R18_TUNE_S)
        noise = "; the plan is the library default: the ratio is noise" if r18["plan_is_default"] else ""
        summary["resnet18: tuned step speedup"] = (
            f"{r18['speedup']:.2f}x ({r18['speedup_iqr']}, load "
            f"{r18['load_steps']}; {r18['whole_model_choice']}{noise})"
        )
        summary["target resnet18 tuned step >= 1.0x"] = verdict(r18["speedup"] >= 1.0)
        summary[f"target resnet18 tuned step >= {R18_STEP}x"] = verdict(
            r18["speedup"] >= R18_STEP and not r18["plan_is_default"]
        )
        if r18["plan_is_default"] or r18["speedup"] < R18_STEP:
            summary[f"why resnet18 < {R18_STEP}x"] = no_room(r18, r18_layers)
        summary[f"target resnet18 warm start < {R18_WARM_S:g} s"] = (
            f"{verdict(r18['warm_s'] < R18_WARM_S and r18['warm_from_cache'])} ({r18['warm_s']:.2f} s)"
        )
    rows = (
        [{"part": "layer", **r} for r in layers]
        + [{"part": "model", **r} for r in models]
        + [{"part": "tuning", **r} for r in engine_rows]
        + [{"part": "resnet18_layer", **r} for r in r18_layers]
        + ([{"part": "resnet18", **r18}] if r18 else [])
    )
    for i, (title, part) in enumerate(tables):
        emit(title, part, summary if i == len(tables) - 1 else {}, None)
    if json_path:
        path = Path(json_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        payload = {"benchmark": "conv", "machine": machine_info(), "rows": rows, "summary": summary}
        path.write_text(json.dumps(payload, indent=2, default=str))
        print(f"wrote {path}")

"""Code the pipeline tests run on real MPI ranks (imported by the ranks' scripts)."""

from __future__ import annotations

import copy
import json
import os

import torch
from mpi4py import MPI
from torch import nn
from torch.nn import functional as F

from rapydli.comm import Communicator, GradientSynchronizer
from rapydli.parallel import split
from rapydli.parallel.executor import PipelineExecutor
from rapydli.parallel.layout import Layout


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy (the Trainer's default for logits)."""
    return F.cross_entropy(logits, targets)


def residual_mlp(dtype: torch.dtype, width: int = 16, depth: int = 5) -> nn.Sequential:
    """A deterministic residual MLP of ``depth + 2`` blocks (no batch-dependent layers)."""

    class Residual(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(width, width)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + torch.tanh(self.fc(x))

    torch.manual_seed(0)
    layers = [nn.Linear(8, width)] + [Residual() for _ in range(depth)] + [nn.Linear(width, 5)]
    return nn.Sequential(*layers).to(dtype)


def executor_equivalence(stages: int, schedule: str, microbatches: int, batch: int, dtype: str, steps: int = 3) -> None:
    """Pipelined (x data-parallel) SGD for ``steps`` == one process on the global batch, per parameter."""
    torch.set_num_threads(1)
    world = MPI.COMM_WORLD
    dt = getattr(torch, dtype)
    grid = Layout(world.Get_size(), stages).grid(world)
    reference = residual_mlp(dt)
    model = copy.deepcopy(reference)
    g = torch.Generator().manual_seed(1)
    global_batch = batch * grid.layout.data_parallel
    xs = torch.randn(steps, global_batch, 8, generator=g).to(dt)
    ys = torch.randint(0, 5, (steps, global_batch), generator=g)

    bounds = split.decide(model, "auto" if stages == 3 else ["3"], stages, xs[0, :batch], world)
    stage, _ = split.stage_module(model, bounds, grid.stage)
    sync = None
    if grid.layout.data_parallel > 1:
        sync = GradientSynchronizer(stage, Communicator(grid.data, algorithm="mpi"), bucket_mb=0.001)
        sync.broadcast_parameters()
    executor = PipelineExecutor(stage, grid.pipeline, schedule, microbatches, loss_fn, sync=sync)
    opt = torch.optim.SGD(stage.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    mine = slice(grid.replica * batch, (grid.replica + 1) * batch)
    for s in range(steps):
        opt.zero_grad()
        loss = executor.train_step(xs[s, mine], ys[s, mine])
        if sync is not None:
            sync.wait()
        opt.step()
        ref_opt.zero_grad()
        ref_loss = F.cross_entropy(reference(xs[s]), ys[s])
        ref_value = float(ref_loss.detach())
        ref_loss.backward()
        ref_opt.step()
        if grid.layout.data_parallel == 1:
            assert abs(loss - ref_value) <= 1e-6 * abs(ref_value), (loss, ref_value)
    tolerance = 1e-10 if dt == torch.float64 else 1e-5
    ref_stage, _ = split.stage_module(reference, bounds, grid.stage)
    worst = 0.0
    for p, q in zip(stage.parameters(), ref_stage.parameters()):
        worst = max(worst, float((p - q).detach().abs().max() / q.detach().abs().max()))
    assert worst <= tolerance, (
        f"rank {world.Get_rank()} stage {grid.stage}: relative difference {worst:.3g} > {tolerance}"
    )
    worst_all = world.allreduce(worst, op=MPI.MAX)
    if world.Get_rank() == 0:
        print(
            json.dumps({"case": [stages, schedule, microbatches, batch, dtype], "bounds": bounds, "worst": worst_all})
        )
    grid.free()


def failing_stage(stages: int, schedule: str) -> None:
    """The last stage raises in its second backward; the job must end, naming stage and action."""
    torch.set_num_threads(1)
    world = MPI.COMM_WORLD
    grid = Layout(world.Get_size(), stages).grid(world)
    model = residual_mlp(torch.float64)
    bounds = split.boundaries(model, [str(3 + i) for i in range(stages - 1)], stages)
    stage, _ = split.stage_module(model, bounds, grid.stage)
    calls = {"n": 0}

    def bad_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == 2:
            raise ValueError("loss blew up")
        return loss_fn(logits, targets)

    executor = PipelineExecutor(stage, grid.pipeline, schedule, 4, bad_loss)
    x, y = torch.randn(8, 8, dtype=torch.float64), torch.randint(0, 5, (8,))
    executor.train_step(x, y)


def interrupted_stages() -> None:
    """Each rank is interrupted (SIGINT) while waiting for its neighbour; it prints what it was in."""
    import signal
    import sys
    import threading

    torch.set_num_threads(1)
    world = MPI.COMM_WORLD
    grid = Layout(world.Get_size(), 2).grid(world)
    model = residual_mlp(torch.float64)
    stage, _ = split.stage_module(model, split.boundaries(model, ["3"], 2), grid.stage)

    def never(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        raise AssertionError("stage 1 never gets an activation: stage 0 is stopped before it sends")

    executor = PipelineExecutor(stage, grid.pipeline, "1f1b", 2, never)
    if grid.stage == 0:  # stage 0 hangs in its first forward's send: never sends, waits for a gradient
        executor.actions = [a for a in executor.actions if a.kind != "send_activation"]
    threading.Timer(1.0, lambda: signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)).start()
    try:
        executor.train_step(torch.randn(4, 8, dtype=torch.float64), torch.randint(0, 5, (4,)))
    except KeyboardInterrupt as exc:
        print(f"rank {world.Get_rank()}: {exc}", flush=True)
    sys.stdout.flush()
    os._exit(0)  # requests to the silent neighbour are still posted: leave without finalising MPI


def run_cases(cases_json: str) -> None:
    """Run every case of a JSON list of :func:`executor_equivalence` argument lists."""
    for case in json.loads(cases_json):
        executor_equivalence(*case)


if __name__ == "__main__":
    run_cases(os.environ["PIPELINE_CASES"])


def worst_error(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """A custom metric: the batch mean of each sample's largest absolute error."""
    return (outputs - targets).abs().amax(-1).mean()


def trainer_run(config: dict, steps_before: int | None = None, task: str = "classify") -> None:
    """Trainer with ``config`` on every rank; rank 0 prints each stage's parameters as JSON.

    With ``steps_before``: first train to that step with checkpoints, then resume to
    ``max_steps`` in a second Trainer (the run "interrupted" in between). ``task``:
    ``"classify"`` (5 classes, the default loss and metrics) or ``"regress"`` (5 outputs,
    ``loss_fn=nn.MSELoss()``, metrics ``mae`` and :func:`worst_error`).
    """
    from torch.utils.data import TensorDataset

    from rapydli.trainer.config import TrainConfig
    from rapydli.trainer.loop import Trainer

    torch.set_num_threads(1)
    world = MPI.COMM_WORLD
    g = torch.Generator().manual_seed(3)
    code: dict = {}
    if task == "regress":
        train = TensorDataset(torch.randn(96, 8, generator=g), torch.randn(96, 5, generator=g))
        val = TensorDataset(torch.randn(20, 8, generator=g), torch.randn(20, 5, generator=g))
        code = {"loss_fn": nn.MSELoss(), "metrics": ["mae", worst_error]}
    else:
        train = TensorDataset(torch.randn(96, 8, generator=g), torch.randint(0, 5, (96,), generator=g))
        val = TensorDataset(torch.randn(20, 8, generator=g), torch.randint(0, 5, (20,), generator=g))
    cfg = TrainConfig.from_dict(config)
    if steps_before is not None:
        first = Trainer(
            residual_mlp(torch.float32),
            None,
            train,
            val,
            cfg.replace(max_steps=steps_before, checkpoint_every=1),
            **code,
        )
        first.fit()
        first.close()
        cfg = cfg.replace(resume=True)
    trainer = Trainer(residual_mlp(torch.float32), None, train, val, cfg, **code)
    history = trainer.fit()
    names = getattr(trainer.pipeline, "names", None)
    params = {}
    blocks = split.pipeline_blocks(trainer.model) if names is None else list(zip(names, trainer.model))
    for name, block in blocks:
        for pname, p in block.named_parameters():
            params[f"{name}.{pname}"] = p.detach().double().reshape(-1).tolist()
    gathered = world.gather(params, root=0)
    trainer.close()
    if world.Get_rank() == 0:
        merged: dict = {}
        for part in gathered:
            for key, value in part.items():
                merged.setdefault(key, value)
        losses = [row["loss"] for row in history if row["kind"] == "train"]
        evals = [row for row in history if row["kind"] == "eval"]
        metrics = {
            key: [row.get(key) for row in evals]
            for key in sorted({k for row in evals for k in row if k.startswith("val_")})
        }
        print(
            json.dumps(
                {
                    "params": merged,
                    "losses": losses,
                    "val": metrics["val_loss"],
                    "metrics": metrics,
                    "step": trainer.step,
                }
            )
        )

"""What to train: the model, the data, the loss, the optimizer and the metrics, resolved and checked once.

The front door (``rd.train``, ``rd.sweep``, ``rd.scaling_study``, ``rd.plan_parallel``, the
panels) turns what the user passed into one :class:`RunSpec` with :meth:`RunSpec.of`:
``"module:qualname"`` strings are imported, ``loss_fn``/``optimizer_fn``/``metrics`` are
checked (:func:`rapydli.trainer.outputs.check_training_code`), and a bad value is one
:class:`~rapydli.errors.ConfigError` before any process starts. Jobs, sweeps, scaling
studies and the planner then take the spec whole; the engines get its callables as
:func:`rapydli.trainer.task.engine_task` takes them.

Examples
--------
>>> spec = RunSpec.of("rapydli.zoo.models:mlp", "rapydli.zoo.datasets:digits", metrics=["accuracy"])
>>> spec.model_fn.__name__, spec.name, spec.params()["model_fn"]
('mlp', 'mlp', 'rapydli.zoo.models:mlp')
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rapydli.experiments.store.refs import resolve_callable
from rapydli.experiments.store.sources import code_params, describe

#: What every front door takes as ``model_fn``: ``model_fn() -> nn.Module``, or its ``"module:qualname"``.
ModelSource = Callable[[], Any] | str
#: What every front door takes as ``data_fn``: ``data_fn() -> (train_dataset, val_dataset)``, or its ``"module:qualname"``.
DataSource = Callable[[], Any] | str
#: A ``loss_fn`` as :mod:`rapydli.objective` takes it.
LossFn = Callable[..., Any]
#: An ``optimizer_fn(parameters) -> torch.optim.Optimizer`` as :mod:`rapydli.trainer.optim` takes it.
OptimizerFn = Callable[..., Any]


@dataclass(frozen=True)
class RunSpec:
    """One description of what to train.

    Attributes
    ----------
    model_fn
        ``model_fn() -> nn.Module`` (resolved: a callable).
    data_fn
        ``data_fn() -> (train_dataset, val_dataset)`` (resolved: a callable).
    loss_fn, optimizer_fn, metrics
        As ``rd.train`` takes them (:mod:`rapydli.objective`, :mod:`rapydli.trainer.optim`);
        ``None``: the defaults.
    model_ref, data_ref
        The ``"module:qualname"`` strings ``model_fn``/``data_fn`` were given as, if they were
        (recorded as given).
    """

    model_fn: Callable[[], Any]
    data_fn: Callable[[], Any]
    loss_fn: Callable[..., Any] | None = None
    optimizer_fn: Callable[..., Any] | None = None
    metrics: Any = None
    model_ref: str | None = None
    data_ref: str | None = None

    @classmethod
    def of(
        cls,
        model_fn: ModelSource | RunSpec,
        data_fn: DataSource | None = None,
        loss_fn: LossFn | None = None,
        optimizer_fn: OptimizerFn | None = None,
        metrics: Any = None,
    ) -> RunSpec:
        """Resolve and check what the user passed (a :class:`RunSpec` is returned as it is).

        Raises
        ------
        ConfigError
            A ``model_fn``/``data_fn`` that is neither a callable nor an importable
            ``"module:qualname"``, or a ``loss_fn``/``optimizer_fn``/``metrics`` that cannot work;
            a :class:`RunSpec` given with any of the others (it carries its own).
        """
        if isinstance(model_fn, RunSpec):
            given = {"data_fn": data_fn, "loss_fn": loss_fn, "optimizer_fn": optimizer_fn, "metrics": metrics}
            extra = [name for name, value in given.items() if value is not None]
            if extra:
                from rapydli.errors import ConfigError

                raise ConfigError(
                    f"a RunSpec carries its own data_fn, loss_fn, optimizer_fn and metrics: {', '.join(extra)} given beside it"
                )
            return model_fn
        from rapydli.trainer.outputs import check_training_code

        model, data = resolve_callable(model_fn, "model_fn"), resolve_callable(data_fn, "data_fn")  # type: ignore[arg-type]
        check_training_code(loss_fn, optimizer_fn, metrics)
        return cls(
            model,
            data,
            loss_fn,
            optimizer_fn,
            metrics,
            model_fn if isinstance(model_fn, str) else None,
            data_fn if isinstance(data_fn, str) else None,
        )

    @property
    def code(self) -> dict[str, Any]:
        """``{"loss_fn", "optimizer_fn", "metrics"}``: the keywords the engine task and the Trainer take."""
        return {"loss_fn": self.loss_fn, "optimizer_fn": self.optimizer_fn, "metrics": self.metrics}

    @property
    def name(self) -> str:
        """The model function's name (a run's default name)."""
        return str(getattr(self.model_fn, "__name__", "model"))

    def params(self) -> dict[str, Any]:
        """What a recorded run says it trained: ``model_fn``, ``data_fn``, the code's descriptions and notebook sources."""
        return {
            "model_fn": self.model_ref or describe(self.model_fn),
            "data_fn": self.data_ref or describe(self.data_fn),
            **code_params(self.model_fn, self.data_fn, self.code),
        }

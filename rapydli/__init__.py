"""RaPyDLI: rapid prototyping of distributed deep learning from Jupyter.

Connect a notebook to MPI engines, train data-parallel with native allreduce, sweep,
measure scaling and record every run::

    import rapydli as rd

    with rd.Cluster(n=2) as cluster:
        result = rd.train(model_fn, data_fn, rd.TrainConfig(epochs=1), cluster=cluster)

Names are imported lazily, so ``import rapydli`` stays fast and an engine does not pull
front-end code (plotly, widgets, optuna) it never uses. In a notebook's kernel (not an
engine) it sets plotly up so every figure shown carries its PNG beside the interactive
figure: the notebook shows its figures wherever it is read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rapydli.errors import (
    ClusterError,
    ConfigError,
    DataError,
    NotFoundError,
    RankFailure,
    RapydliError,
    StoreError,
    UserCodeError,
)
from rapydli.lazy import LazyExports
from rapydli.version import __version__

# public name -> module that defines it
_LAZY: dict[str, str] = {
    "Cluster": "rapydli.cluster",
    "TrainConfig": "rapydli.trainer.config",
    "RunResult": "rapydli.experiments.run",
    "train": "rapydli.notebook",
    "load": "rapydli.notebook",
    "scaling_study": "rapydli.notebook",
    "ScalingResult": "rapydli.experiments.scaling",
    "plan_parallel": "rapydli.notebook",
    "ParallelPlan": "rapydli.experiments.planning.planner",
    "sweep": "rapydli.notebook",
    "SweepResult": "rapydli.experiments.sweep.sweep",
    "loguniform": "rapydli.experiments.sweep.space",
    "uniform": "rapydli.experiments.sweep.space",
    "choice": "rapydli.experiments.sweep.space",
    "intrange": "rapydli.experiments.sweep.space",
    "record": "rapydli.notebook",
    "runs": "rapydli.experiments.store.runview",
    "run": "rapydli.experiments.store.runview",
    "batch": "rapydli.experiments.batch.batch",
    "verify_layout": "rapydli.experiments.verify",
    "LayoutCheck": "rapydli.experiments.verify",
}
_SUBPACKAGES = {"widgets", "data", "comm", "autotune", "cluster", "experiments", "trainer", "zoo"}

__all__ = [
    "ClusterError",
    "ConfigError",
    "DataError",
    "NotFoundError",
    "RankFailure",
    "RapydliError",
    "StoreError",
    "UserCodeError",
    "__version__",
    "load_ipython_extension",
    *sorted(_LAZY),
]


_exports = LazyExports(__name__, _LAZY, globals(), subpackages=_SUBPACKAGES, also=__all__)


def __getattr__(name: str) -> Any:
    return _exports.attribute(name)


def __dir__() -> list[str]:
    return _exports.names()


def load_ipython_extension(ipython: Any) -> None:
    """Register the ``%rapydli`` and ``%%distributed`` magics (``%load_ext rapydli``)."""
    from rapydli.magics import load_ipython_extension as _load

    _load(ipython)


def unload_ipython_extension(ipython: Any) -> None:
    """Stop the notebook's cluster when the extension is unloaded."""
    from rapydli.magics import unload_ipython_extension as _unload

    _unload(ipython)


def _figures_travel() -> None:
    """In a notebook's kernel, every plotly figure shown from now on carries its PNG (:func:`rapydli.widgets.display.static_figures`)."""
    from rapydli.widgets.display import in_notebook_kernel, static_figures

    if in_notebook_kernel():
        static_figures()


_figures_travel()

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from rapydli.cluster import Cluster
    from rapydli.experiments.batch.batch import batch
    from rapydli.experiments.planning.planner import ParallelPlan
    from rapydli.experiments.run import RunResult
    from rapydli.experiments.scaling import ScalingResult
    from rapydli.experiments.store.runview import run, runs
    from rapydli.experiments.sweep.space import choice, intrange, loguniform, uniform
    from rapydli.experiments.sweep.sweep import SweepResult
    from rapydli.experiments.verify import LayoutCheck, verify_layout
    from rapydli.notebook import plan_parallel, record, scaling_study, sweep, train
    from rapydli.trainer.config import TrainConfig

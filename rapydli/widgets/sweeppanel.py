"""``rd.widgets.SweepPanel``: start and stop a sweep from widgets and watch its trials live."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from rapydli.errors import RapydliError
from rapydli.trainer.config import TrainConfig

if TYPE_CHECKING:  # pragma: no cover
    from rapydli.cluster import Cluster
    from rapydli.experiments.spec import DataSource, ModelSource
    from rapydli.experiments.sweep.sweep import SweepResult


class SweepPanel:
    """Trials/parallel controls, Run and Stop buttons, and the sweep's live table and figure.

    Parameters
    ----------
    model_fn, data_fn, config, space, cluster
        As for :func:`rapydli.experiments.sweep.sweep.sweep`.
    **options
        Other :func:`~rapydli.experiments.sweep.sweep.sweep` arguments (``workers_per_trial``,
        ``pruner``, ``metric``, ``sampler``, ``seed``, ``enqueue``, ...).

    Run starts the sweep in a background thread (the kernel stays free); Stop ends it
    (no new trials; running ones stop after their step). :attr:`result` holds the
    :class:`SweepResult` once it ended.
    """

    def __init__(
        self,
        model_fn: ModelSource,
        data_fn: DataSource,
        config: TrainConfig,
        space: Mapping[str, Any],
        cluster: Cluster,
        trials: int = 8,
        **options: Any,
    ) -> None:
        import ipywidgets as widgets

        from rapydli.widgets.sweepview import SweepView

        self.model_fn, self.data_fn, self.config, self.space, self.cluster = model_fn, data_fn, config, space, cluster
        self.options = options
        self.trials = widgets.BoundedIntText(value=trials, min=1, max=10_000, description="trials")
        workers = options.get("workers_per_trial", 1)
        self.parallel = widgets.BoundedIntText(
            value=max(1, cluster.n // workers), min=1, max=max(1, cluster.n), description="parallel"
        )
        self.run_button = widgets.Button(description="Run sweep", button_style="success", icon="play")
        self.stop_button = widgets.Button(description="Stop", button_style="danger", icon="stop", disabled=True)
        self.message = widgets.HTML()
        self.view = SweepView(options.get("metric", "val_loss"), list(space), live=True)
        self.run_button.on_click(lambda _: self.run())
        self.stop_button.on_click(lambda _: self.stop())
        self.widget = widgets.VBox(
            [widgets.HBox([self.trials, self.parallel, self.run_button, self.stop_button]), self.message, self.view.box]
        )
        self.result: SweepResult | None = None
        self._sweep: Any = None
        self._thread: threading.Thread | None = None

    def _ipython_display_(self) -> None:  # pragma: no cover - notebook display
        from IPython.display import display

        display(self.widget)

    def run(self) -> bool:
        """Start the sweep (what Run does); False if the arguments are invalid (shown)."""
        from rapydli.experiments.sweep.sweep import Sweep

        if self.running:
            return False
        try:
            self._sweep = Sweep(
                self.model_fn,
                self.data_fn,
                self.config,
                self.space,
                self.trials.value,
                cluster=self.cluster,
                parallel=self.parallel.value,
                view=self.view,
                **self.options,
            )
        except RapydliError as exc:
            self.message.value = f"<pre style='color:#b00020'>{exc}</pre>"
            return False
        self.view.live_again()
        self.message.value = "running ..."
        self.run_button.disabled, self.stop_button.disabled = True, False
        self._thread = threading.Thread(target=self._run, name="rapydli-sweep", daemon=True)
        self._thread.start()
        return True

    def _run(self) -> None:
        try:
            self.result = self._sweep.run()
            states = self.result.table["state"].value_counts().to_dict()
            self.message.value = f"done: {states}; best {self.result.best_params}"
        except Exception as exc:  # noqa: BLE001 - shown in the panel
            self.message.value = f"<pre style='color:#b00020'>{type(exc).__name__}: {exc}</pre>"
        self.run_button.disabled, self.stop_button.disabled = False, True

    def stop(self) -> None:
        """Stop the sweep (what Stop does)."""
        if self._sweep is not None:
            self._sweep.stop()

    def wait(self, timeout: float | None = None) -> SweepResult | None:
        """Block until the sweep ended; its result."""
        if self._thread is not None:
            self._thread.join(timeout)
        return self.result

    @property
    def running(self) -> bool:
        """True while the sweep runs."""
        return self._thread is not None and self._thread.is_alive()

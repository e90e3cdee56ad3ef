"""``rd.widgets.HyperparameterPanel``: tweak a TrainConfig with widgets, train, watch, stop.

Controls are generated from :func:`rapydli.trainer.config.fields_spec` (log sliders for
log-scaled floats such as the learning rate, dropdowns for choices, checkboxes for
flags, bounded boxes for integers); a workers slider picks how many engines (the first
``k``) train. Train submits a :class:`~rapydli.experiments.job.TrainingJob` and
polls it from a background thread, so the kernel stays free and Stop can be clicked;
Stop asks every rank to stop after its step; the job interrupts them if they have not
stopped :data:`~rapydli.experiments.job.STOP_GRACE_S` later.
An invalid combination (``ConfigError``) is shown in the panel.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rapydli.errors import RapydliError
from rapydli.experiments.job import STOP_GRACE_S
from rapydli.trainer.config import FieldSpec, TrainConfig, fields_spec
from rapydli.widgets.display import FigureSlot, in_kernel
from rapydli.widgets.live import LivePlot

if TYPE_CHECKING:  # pragma: no cover
    from rapydli.cluster import Cluster
    from rapydli.experiments.job import TrainingJob
    from rapydli.experiments.spec import DataSource, LossFn, ModelSource, OptimizerFn

#: Fields that get a control by default (the rest keep the config's value).
DEFAULT_FIELDS = (
    "lr", "optimizer", "momentum", "weight_decay", "lr_schedule", "warmup_steps", "batch_size",
    "epochs", "max_steps", "eval_every", "grad_clip", "precision", "allreduce", "bucket_mb", "overlap", "seed",
)  # fmt: skip
POLL_S = 0.05


def control_for(spec: FieldSpec, value: Any) -> Any:
    """An ipywidget for one config field (optional numbers: 0 means ``None``)."""
    import ipywidgets as widgets

    style = {"description_width": "110px"}
    common = {"description": spec.name, "tooltip": spec.help, "style": style}
    if spec.choices is not None:
        return widgets.Dropdown(options=list(spec.choices), value=value, **common)
    if spec.type == "bool":
        return widgets.Checkbox(value=bool(value), indent=False, **common)
    if spec.type == "float" and spec.log and not spec.optional and spec.low is not None and spec.high is not None:
        centre = value if value else (spec.default or 1.0)
        low = max(math.log10(centre) - 3, math.log10(spec.low) if spec.low > 0 else -12)
        high = min(math.log10(centre) + 3, math.log10(spec.high))
        return widgets.FloatLogSlider(
            value=centre, base=10, min=low, max=high, step=0.1, readout_format=".2e", **common
        )
    if spec.type == "float":
        high = spec.high if spec.high is not None else 1e9
        return widgets.BoundedFloatText(
            value=value or 0.0, min=0.0 if spec.optional else (spec.low or 0.0), max=high, **common
        )
    if spec.type == "int":
        high = int(min(spec.high if spec.high is not None else 10**9, 10**9))
        low = 0 if spec.optional else int(spec.low or 0)
        return widgets.BoundedIntText(value=value or 0, min=low, max=high, **common)
    return widgets.Text(value="" if value is None else str(value), **common)


def value_of(spec: FieldSpec, control: Any) -> Any:
    """The config value a control holds (0 / '' of an optional field is ``None``)."""
    value = control.value
    if spec.optional and value in (0, 0.0, ""):
        return None
    return value


class HyperparameterPanel:
    """Widgets for a :class:`TrainConfig`, Train/Stop buttons, a live plot and a table of runs.

    Parameters
    ----------
    model_fn, data_fn
        As for ``rd.train``.
    config
        Starting values of the controls.
    cluster
        The cluster; ``None``: the one running in this kernel, else one of ``config.workers``
        engines started on the first Train and stopped by :meth:`close`.
    fields
        TrainConfig fields to show (default :data:`DEFAULT_FIELDS`).
    loss_fn, optimizer_fn, metrics
        As for ``rd.train`` (checked here), used by every run the panel starts.

    Attributes
    ----------
    controls
        ``{field: widget}``; ``workers`` is the workers slider.
    train_button, stop_button, message, table, widget
        The buttons, the message area (errors), the runs table (HTML) and the whole box.
    status
        The message area's text (plain).
    runs
        One dict per run started from the panel: its parameters and final metrics.
    job
        The running (or last) :class:`TrainingJob`.
    """

    def __init__(
        self,
        model_fn: ModelSource,
        data_fn: DataSource,
        config: TrainConfig | None = None,
        cluster: Cluster | None = None,
        fields: Sequence[str] = DEFAULT_FIELDS,
        *,
        loss_fn: LossFn | None = None,
        optimizer_fn: OptimizerFn | None = None,
        metrics: Any = None,
    ) -> None:
        import ipywidgets as widgets

        from rapydli.experiments.spec import RunSpec

        self.spec = RunSpec.of(
            model_fn, data_fn, loss_fn, optimizer_fn, metrics
        )  # resolved and checked once; every Train runs it
        self.config = config or TrainConfig()
        from rapydli.cluster import current

        self.cluster = cluster if cluster is not None else current()
        self._own_cluster = False
        self.specs = {spec.name: spec for spec in fields_spec() if spec.name in fields}
        values = self.config.to_dict()
        self.controls: dict[str, Any] = {name: control_for(spec, values[name]) for name, spec in self.specs.items()}
        size = self.cluster.n if self.cluster is not None else self.config.ranks_to_start()
        self.controls["workers"] = widgets.IntSlider(
            value=size, min=1, max=size, description="workers", style={"description_width": "110px"}
        )
        self.train_button = widgets.Button(description="Train", button_style="success", icon="play")
        self.stop_button = widgets.Button(description="Stop", button_style="danger", icon="stop", disabled=True)
        self.message = widgets.HTML()
        self.status = ""
        self.table = widgets.HTML()
        self.plot = LivePlot(title="", live=True)
        self.train_button.on_click(lambda _: self.train())
        self.stop_button.on_click(lambda _: self.stop())
        self.runs: list[dict[str, Any]] = []
        self.job: TrainingJob | None = None
        self._thread: threading.Thread | None = None
        grid = widgets.GridBox(
            list(self.controls.values()), layout=widgets.Layout(grid_template_columns="repeat(3, 330px)")
        )
        buttons = widgets.HBox([self.train_button, self.stop_button])
        self.figure_slot = FigureSlot()  # the plot redrawn while a run goes on, settled (with its PNG) after
        self.plot.target = self.figure_slot
        self.figure_slot.redraw(self.plot.figure)
        self.widget = widgets.VBox([grid, buttons, self.message, self.figure_slot.output, self.table])

    def _ipython_display_(self) -> None:  # pragma: no cover - notebook display
        from IPython.display import display

        display(self.widget)

    # -- actions ----------------------------------------------------------------------------
    def current_config(self) -> TrainConfig:
        """The TrainConfig the controls describe (raises ConfigError for invalid values)."""
        changes = {name: value_of(spec, self.controls[name]) for name, spec in self.specs.items()}
        return self.config.replace(**changes)

    def train(self) -> TrainingJob | None:
        """Start a run with the controls' values (what Train does); None if it could not start."""
        from rapydli.experiments.job import Recording, TrainingJob

        if self.running:
            self._say("a run is in progress: Stop it first", error=True)
            return None
        try:
            config = self.current_config()
            workers = self.controls["workers"].value
            if self.cluster is None:
                from rapydli.cluster import choose_cluster, ready

                self.cluster, self._own_cluster = choose_cluster(
                    None, n=self.config.ranks_to_start(), need=workers, start=False
                )
                state = self.cluster.status()["state"]
                verb = (
                    "starting"
                    if self._own_cluster or state in ("stopped", "failed")
                    else "using the running cluster of"
                )
                self._say(f"{verb} {self.cluster.n} engines ...")
                ready(self.cluster, say=self._say)
            self.plot = self._fresh_plot()
            self.job = TrainingJob(
                self.cluster,
                self.spec,
                config,
                list(range(workers)),
                callbacks=[self.plot],
                recording=Recording(name="panel"),
            ).start()
        except RapydliError as exc:  # invalid combinations and cluster problems are shown, not raised
            self._say(str(exc), error=True)
            return None
        self._say(f"training on {workers} worker(s) ...")
        self.train_button.disabled, self.stop_button.disabled = True, False
        self._thread = threading.Thread(
            target=self._follow, args=(self.job, config, workers), name="rapydli-panel", daemon=True
        )
        self._thread.start()
        return self.job

    def stop(self) -> None:
        """Ask the running job to stop on every rank (what Stop does)."""
        if self.running and self.job is not None:
            self.job.request_stop()
            self._say("stopping after the current step ...")

    def wait(self, timeout: float | None = None) -> None:
        """Block until the running job has ended and the panel is updated."""
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def running(self) -> bool:
        """True while a run started from the panel is going on."""
        return self._thread is not None and self._thread.is_alive()

    def close(self) -> None:
        """Stop a running job; stop the cluster the panel started."""
        self.stop()
        self.wait(STOP_GRACE_S + 10)
        if self._own_cluster and self.cluster is not None:
            self.cluster.stop()
            self.cluster = None

    # -- the background thread ---------------------------------------------------------------
    def _follow(self, job: TrainingJob, config: TrainConfig, workers: int) -> None:
        try:
            while not job.poll(POLL_S):
                self.plot.tick()
        except Exception as exc:  # noqa: BLE001 - shown in the panel; the thread must not die silently
            self._say(f"{type(exc).__name__}: {exc}", error=True)
        self.plot.close()  # settled in the slot: plotly's JSON and its PNG
        final = job.final_metrics()
        changed = {k: v for k, v in config.to_dict().items() if k in self.specs}
        self.runs.append(
            {
                "run": len(self.runs) + 1,
                "state": job.state,
                "workers": workers,
                **changed,
                **{k: final.get(k) for k in ("steps", "loss", "val_loss", "val_accuracy", "samples_per_s")},
                "run_id": job.run_id,
            }
        )
        self._render_table()
        if job.state == "failed":
            self._say(job.error, error=True)
        else:
            self._say(f"run {len(self.runs)} {job.state} after {final.get('steps', 0):.0f} steps")
        self.train_button.disabled, self.stop_button.disabled = False, True

    # -- display ------------------------------------------------------------------------------
    def _fresh_plot(self) -> LivePlot:
        plot = LivePlot(title=f"run {len(self.runs) + 1}", live=True)
        plot.target = self.figure_slot
        self.figure_slot.redraw(plot.figure)
        return plot

    def _render_table(self) -> None:
        import pandas as pd

        self.table.value = pd.DataFrame(self.runs).to_html(index=False, float_format=lambda v: f"{v:.4g}", na_rep="")

    def _say(self, text: str, error: bool = False) -> None:
        import html

        self.status = text
        colour = "#b00020" if error else "#333"
        self.message.value = f"<pre style='color:{colour}; white-space:pre-wrap'>{html.escape(text)}</pre>"

    def show_static(self) -> None:
        """In a notebook run headless: display the last plot and the runs table as static output."""
        if in_kernel():
            from IPython.display import HTML, display

            display(self.plot.static())
            display(HTML(self.table.value))

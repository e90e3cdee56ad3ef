"""The Jupyter kernels that run notebooks headless (``make demo``, tests, batches): encrypted.

A kernel that jupyter_client starts over TCP without CurveZMQ keys warns on its stderr
("Kernel is running over TCP without encryption ...") and is indeed open to anyone on
the machine who can reach its ports. :class:`EncryptedKernelManager` provisions the
keys (``transport_encryption="required"``, when pyzmq has CurveZMQ), so the kernel runs
encrypted and says nothing; its kernels draw plotly figures with their PNG
(:func:`~rapydli.widgets.display.static_figures` runs first in them, as ``import rapydli``
does in any notebook's kernel), so every figure of the executed notebook shows outside
JupyterLab too, also in a notebook that does not import RaPyDLI.
:class:`RapydliEngine` is papermill's own engine with that manager, saving only the state
of the widgets the notebook still shows; it is registered as papermill engine ``rapydli``
(``papermill --engine rapydli``).

Examples
--------
>>> import papermill  # doctest: +SKIP
>>> papermill.execute_notebook("in.ipynb", "out.ipynb", kernel_manager_class=KERNEL_MANAGER)  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

import zmq
from jupyter_client.manager import AsyncKernelManager
from papermill.engines import NBClientEngine

#: The dotted name papermill/nbclient take as ``kernel_manager_class``.
KERNEL_MANAGER = "rapydli.experiments.batch.jupyter_kernels.EncryptedKernelManager"


class EncryptedKernelManager(AsyncKernelManager):
    """jupyter_client's kernel manager with CurveZMQ transport encryption on (when pyzmq has it)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if zmq.has("curve"):
            self.transport_encryption = "required"

    async def start_kernel(self, **kw: Any) -> None:  # type: ignore[override]
        """Start the kernel with figures that carry their PNG (a plotly renderer the user set is kept),
        without the imports a headless kernel never uses (:mod:`rapydli.experiments.batch.headless`)."""
        from rapydli.experiments.batch.headless import SKIP_LINE

        figures = "__import__('rapydli.widgets.display', fromlist=['static_figures']).static_figures()"
        # SKIP_LINE: a headless kernel takes 3-5 s less to its first figure
        extra = [*(kw.pop("extra_arguments", None) or []), f"--IPKernelApp.exec_lines={SKIP_LINE}; {figures}"]
        await super().start_kernel(extra_arguments=extra, **kw)

    async def _async_interrupt_kernel(self) -> None:
        """Interrupt the kernel, except as the first act of a shutdown.

        jupyter_client's shutdown sends SIGINT before its ``shutdown_request``; a kernel still
        handling a message then (on a loaded machine, the last output's) printed
        "KeyboardInterrupt caught in kernel" into the run's output. The request alone ends an
        idle kernel, and one that does not end is still terminated, then killed, as before.
        """
        if self.shutting_down:
            return
        await super()._async_interrupt_kernel()


#: Seconds a batch run waits for a cell's outputs to arrive after the kernel answered the cell (nbclient's ``iopub_timeout``).
IOPUB_TIMEOUT_S = 120


class RapydliEngine(NBClientEngine):
    """papermill's nbclient engine, with kernels started by :class:`EncryptedKernelManager`; the
    executed notebook keeps the state of the widgets it shows only
    (:func:`~rapydli.experiments.batch.saved_widgets.shown_widget_state`: a live plot closed into a static
    figure leaves nothing)."""

    @classmethod
    def execute_managed_notebook(cls, nb_man: Any, kernel_name: str, **kwargs: Any) -> Any:
        from rapydli.experiments.batch.saved_widgets import shown_widget_state

        kwargs.setdefault("kernel_manager_class", KERNEL_MANAGER)
        # nbclient waits 4 s by default for a cell's outputs after its reply, then goes on without them (a warning in its
        # log): on a loaded machine a cell's print before a plotly figure was lost that way. Wait for them, and fail the
        # cell rather than drop them.
        kwargs.setdefault("iopub_timeout", IOPUB_TIMEOUT_S)
        kwargs.setdefault("raise_on_iopub_timeout", True)
        try:
            return super().execute_managed_notebook(nb_man, kernel_name, **kwargs)
        finally:  # also for a failed run: papermill saves the notebook after this returns
            shown_widget_state(nb_man.nb)

"""The Jupyter kernels that run notebooks headless (``make demo``, tests, batches): encrypted.

A kernel that jupyter_client starts over TCP without CurveZMQ keys warns on its stderr
("Kernel is running over TCP without encryption ...") and is indeed open to anyone on
the machine who can reach its ports. :class:`EncryptedKernelManager` provisions the
keys (``transport_encryption="auto"``, when pyzmq has CurveZMQ), so a kernel whose kernelspec
declares CurveZMQ (ipykernel's does) runs encrypted and says nothing; one that does not (an
older ipykernel's spec, another language's kernel) still runs, unencrypted, as Jupyter runs
it. Its kernels draw plotly figures with their PNG (:func:`~rapydli.widgets.display.static_figures` runs first in them, as ``import rapydli``
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
    """jupyter_client's kernel manager with CurveZMQ transport encryption on where pyzmq and the kernelspec have it."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if zmq.has("curve"):
            self.transport_encryption = "auto"  # "required" refused every kernelspec that does not declare curve

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


#: What jupyter_client raises when the kernel process ended before it answered its first message: no cell ran yet.
KERNEL_DIED_AT_START = "Kernel died before replying to kernel_info"

#: Kernels a run starts before it gives up on one that dies at once (jupyter_client draws each kernel's ports as
#: free ones in its own process: two processes starting kernels at the same moment can draw the same port, and the
#: later kernel then exits on "Address already in use" before it answers).
KERNEL_STARTS = 3

#: Seconds a batch run waits for a cell's outputs to arrive after the kernel answered the cell (nbclient's ``iopub_timeout``).
IOPUB_TIMEOUT_S = 120


class RapydliEngine(NBClientEngine):
    """papermill's nbclient engine, with kernels started by :class:`EncryptedKernelManager`; the
    executed notebook keeps the state of the widgets it shows only
    (:func:`~rapydli.experiments.batch.saved_widgets.shown_widget_state`: a live plot closed into a static
    figure leaves nothing). A kernel that dies before it answers its first message is started again, up to
    :data:`KERNEL_STARTS` kernels in all (no cell has run on it)."""

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
            for start in range(1, KERNEL_STARTS + 1):
                try:
                    return super().execute_managed_notebook(nb_man, kernel_name, **kwargs)
                except RuntimeError as exc:  # a kernel that died before its first answer ran no cell: start another
                    if str(exc) != KERNEL_DIED_AT_START or start == KERNEL_STARTS:
                        raise
            raise AssertionError("unreachable")
        finally:  # also for a failed run: papermill saves the notebook after this returns
            shown_widget_state(nb_man.nb)

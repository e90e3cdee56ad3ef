"""The Jupyter kernels that run notebooks headless (``make demo``, tests, batches): encrypted.

A kernel that jupyter_client starts over TCP without CurveZMQ keys warns on its stderr
("Kernel is running over TCP without encryption ...") and is indeed open to anyone on
the machine who can reach its ports. :class:`EncryptedKernelManager` provisions the
keys (``transport_encryption="required"``, when pyzmq has CurveZMQ), so the kernel runs
encrypted and says nothing. :class:`RapydliEngine` is papermill's own engine with that
manager; it is registered as papermill engine ``rapydli`` (``papermill --engine rapydli``).

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


class RapydliEngine(NBClientEngine):
    """papermill's nbclient engine, with kernels started by :class:`EncryptedKernelManager`."""

    @classmethod
    def execute_managed_notebook(cls, nb_man: Any, kernel_name: str, **kwargs: Any) -> Any:
        kwargs.setdefault("kernel_manager_class", KERNEL_MANAGER)
        return super().execute_managed_notebook(nb_man, kernel_name, **kwargs)

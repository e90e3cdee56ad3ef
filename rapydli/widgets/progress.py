"""A tqdm notebook progress bar whose saved output shows how it ended.

tqdm's notebook bar is an ipywidgets widget; a notebook viewer without the widget's state
(nbconvert, GitHub, a notebook saved by papermill) shows the display's ``text/plain``
fallback instead, which tqdm writes once, when the bar is displayed: ``train:   0%|``.
:class:`NotebookProgress` displays the same widget under a display id and, when the bar
closes, updates that display with the bar's final text (``train: 100%|...| 40/40``).

Examples
--------
>>> bar = NotebookProgress(total=40, desc="train", unit="step")  # doctest: +SKIP
>>> bar.update(40); bar.close()  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

from IPython.display import display
from tqdm.notebook import tqdm as tqdm_notebook


class NotebookProgress(tqdm_notebook):
    """``tqdm.notebook.tqdm`` (same arguments) whose text fallback is rewritten on :meth:`close`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **{**kwargs, "display": False})
        self._handle: Any = None
        if not self.disable:
            self._handle = display(self._bundle(), raw=True, display_id=True)

    def text(self) -> str:
        """The bar as text, as tqdm's widget shows it in a plain-text view."""
        return self.container.__repr__(pretty=True)

    def _bundle(self) -> dict[str, Any]:
        view = {"version_major": 2, "version_minor": 0, "model_id": self.container.model_id}
        return {"application/vnd.jupyter.widget-view+json": view, "text/plain": self.text()}

    def close(self) -> None:
        """Close the bar (as tqdm) and leave its final state in the saved output."""
        super().close()
        if self._handle is not None:
            self._handle.update(self._bundle(), raw=True)
            self._handle = None

"""A notebook as a reader without JupyterLab sees it: nbconvert's HTML, opened in Chromium with the network off."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

PLOTLY = "application/vnd.plotly.v1+json"
#: The most an executed tour notebook may weigh: small enough to commit, open on GitHub and attach
#: to a paper (a live plot's saved widget state alone was ~5 MB of JavaScript).
TOUR_NOTEBOOK_BYTES = 1_000_000


def figure_outputs(nb: Any) -> list[dict[str, Any]]:
    """The outputs of ``nb`` that are plotly figures (what the notebook drew)."""
    return [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if PLOTLY in o.get("data", {})]


def visible_figures(nb: Any) -> tuple[int, int]:
    """(figures the notebook drew, figures visible in its nbconvert HTML opened offline in Chromium).

    A figure is visible when its image loaded (``naturalWidth`` > 0) and takes room on the page. Every
    request off the page's own file is refused: no CDN, no MathJax. (-1 visible without Chromium, unless
    ``RAPYDLI_REQUIRE_BROWSER=1``, which fails.)"""
    from lab_browser import CHROMIUM, chromium
    from nbconvert import HTMLExporter

    drawn = len(figure_outputs(nb))
    if not CHROMIUM.exists():
        assert os.environ.get("RAPYDLI_REQUIRE_BROWSER") != "1", f"{CHROMIUM} is missing"
        return drawn, -1
    page, _ = HTMLExporter().from_notebook_node(nb)
    with tempfile.TemporaryDirectory(prefix="offline-html-") as folder:
        html = Path(folder) / "notebook.html"
        html.write_text(page)
        with chromium(Path(folder) / "chromium") as browser:
            context = browser.new_context(viewport={"width": 1200, "height": 900})
            context.route(
                lambda url: not url.startswith("file:") and not url.startswith("data:"), lambda route: route.abort()
            )
            tab = context.new_page()
            tab.set_default_timeout(120_000)
            tab.goto(html.as_uri(), wait_until="load")
            visible = tab.evaluate(
                "[...document.querySelectorAll('.jp-OutputArea-output img, .output_png img')]"
                ".filter(i => i.complete && i.naturalWidth > 0 && i.getBoundingClientRect().width > 100).length"
            )
            context.close()
    return drawn, int(visible)


def sharing_problems(path: Path) -> list[str]:
    """What keeps the executed notebook at ``path`` from being shared as it is (none: ``[]``).

    The checks every executed tour notebook passes, in ``make tour`` and in the tests alike:
    at most :data:`TOUR_NOTEBOOK_BYTES`; every figure carrying its PNG; every figure
    visible in its nbconvert HTML opened offline (:func:`visible_figures`).
    """
    import nbformat

    size = path.stat().st_size
    if size > TOUR_NOTEBOOK_BYTES:
        return [f"{size / 2**20:.2f} MiB, over the {TOUR_NOTEBOOK_BYTES / 2**20:.2f} MiB a shared notebook may weigh"]
    nb = nbformat.read(path, as_version=4)
    problems = []
    bare = [o for o in figure_outputs(nb) if "image/png" not in o["data"]]
    if bare:
        problems.append(f"{len(bare)} figure(s) without a PNG")
    drawn, visible = visible_figures(nb)
    if visible not in (drawn, -1):
        problems.append(f"{visible} of {drawn} figures visible in nbconvert's HTML offline")
    return problems

"""A real JupyterLab and Debian's Chromium for the panel's browser tests (``tests/test_lab_*.py``).

:func:`running_lab` starts ``jupyter lab`` on 127.0.0.1 with a token, every per-user folder
(Jupyter, IPython, caches) and ``RAPYDLI_HOME`` in a temporary folder, and stops it (and
the clusters it started) afterwards; :func:`lab_page` opens it in a page of
:func:`chromium`, driven by Playwright. Screenshots go to the lab's ``shots`` folder (printed). Without
``/usr/bin/chromium`` the test modules skip themselves (:func:`require_chromium`), unless
``RAPYDLI_REQUIRE_BROWSER=1`` (set by ``.ci/run``), where that is a failure. No browser is
ever downloaded.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil
import pytest

CHROMIUM = Path(os.environ.get("RAPYDLI_CHROMIUM", "/usr/bin/chromium"))
CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip
TOKEN = "rapydli-test-token"


def require_chromium() -> None:
    """Skip the calling test module when Chromium is missing (fail under ``RAPYDLI_REQUIRE_BROWSER=1``)."""
    if CHROMIUM.exists():
        return
    if os.environ.get("RAPYDLI_REQUIRE_BROWSER") == "1":
        pytest.fail(f"RAPYDLI_REQUIRE_BROWSER=1 but {CHROMIUM} is missing (apt-get install chromium)", pytrace=False)
    pytest.skip(
        f"{CHROMIUM} is not installed (apt-get install chromium); browser tests skipped", allow_module_level=True
    )


def lab_env(base: Path) -> dict[str, str]:
    """This process's environment with ``RAPYDLI_HOME`` and every per-user folder under ``base``."""
    return {
        **os.environ,
        "RAPYDLI_HOME": str(base / "rapydli-home"),
        "JUPYTER_CONFIG_DIR": str(base / "jupyter-config"),
        "JUPYTER_DATA_DIR": str(base / "data"),
        "JUPYTER_RUNTIME_DIR": str(base / "runtime"),
        "JUPYTERLAB_WORKSPACES_DIR": str(base / "workspaces"),
        "IPYTHONDIR": str(base / "ipython"),
        "XDG_CACHE_HOME": str(base / "cache"),
        "XDG_CONFIG_HOME": str(base / "xdg-config"),
    }


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def running_lab(base: Path, env: dict[str, str]) -> Iterator[dict[str, Any]]:
    """A running ``jupyter lab`` for ``env`` (see :func:`lab_env`), serving ``base/root``.

    Yields ``url``, ``token``, ``proc`` (its psutil process), ``env``, ``shots`` (the
    screenshot folder) and ``root``. On exit the server is stopped (it stops its own
    clusters) and so is every other cluster of its ``RAPYDLI_HOME``.
    """
    root_dir, config, shots = base / "root", Path(env["JUPYTER_CONFIG_DIR"]), base / "screenshots"
    root_dir.mkdir(exist_ok=True)
    shots.mkdir(exist_ok=True)
    (config / "labconfig").mkdir(parents=True, exist_ok=True)
    # No "would you like news?" toast over the page.
    (config / "labconfig" / "page_config.json").write_text(
        json.dumps({"disabledExtensions": {"@jupyterlab/apputils-extension:announcements": True}})
    )
    port = _free_port()
    log = (base / "lab.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root", "--ip", "127.0.0.1", f"--port={port}",
         f"--ServerApp.token={TOKEN}", f"--ServerApp.root_dir={root_dir}", "--ServerApp.port_retries=0"],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            with urllib.request.urlopen(f"{url}/rapydli/api/version?token={TOKEN}", timeout=5) as response:
                assert json.load(response)["api"] == 1
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"jupyter lab did not start:\n{(base / 'lab.log').read_text()}")
            time.sleep(0.5)
    print(f"\nscreenshots: {shots}")
    try:
        yield {
            "url": url,
            "token": TOKEN,
            "proc": psutil.Process(proc.pid),
            "env": env,
            "shots": shots,
            "root": root_dir,
            "log": base / "lab.log",
        }
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the server stops its clusters on shutdown
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        log.close()
        subprocess.run(
            [sys.executable, "-m", "rapydli", "cluster", "stop", "--all"],
            check=False,
            env=env,
            capture_output=True,
            timeout=120,
        )


@contextmanager
def chromium(base: Path) -> Iterator[Any]:
    """Chromium driven by Playwright, its profile and caches under ``base``. One a process:
    Playwright's sync API runs one at a time, so every lab of a test module shares it."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=str(CHROMIUM),
            args=CHROMIUM_FLAGS,
            headless=True,
            env={
                "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
                "HOME": str(base),
                "XDG_CACHE_HOME": str(base / "cache"),
                "XDG_CONFIG_HOME": str(base / "config"),
            },
        )
        try:
            yield browser
        finally:
            browser.close()


@contextmanager
def lab_page(browser: Any, lab: dict[str, Any]) -> Iterator[Any]:
    """A page of ``browser`` showing the lab at 1400x900, once JupyterLab's main area is up."""
    from playwright.sync_api import expect

    context = browser.new_context(viewport={"width": 1400, "height": 900}, accept_downloads=True)
    tab = context.new_page()
    tab.set_default_timeout(60_000)
    tab.goto(f"{lab['url']}/lab?token={lab['token']}")
    expect(tab.locator("#jp-main-dock-panel")).to_be_visible(timeout=120_000)
    try:
        yield tab
    finally:
        context.close()


def api_get(lab: dict[str, Any], path: str) -> Any:
    """``GET /rapydli/api/<path>`` of the lab, as JSON."""
    with urllib.request.urlopen(f"{lab['url']}/rapydli/api/{path}?token={lab['token']}", timeout=30) as response:
        return json.load(response)


def shot(page: Any, lab: dict[str, Any], name: str, element: Any = None) -> None:
    """Save a screenshot (of the page, or of one element) into the lab's screenshot folder."""
    (element or page).screenshot(path=str(lab["shots"] / f"{name}.png"))


def open_panel(page: Any) -> Any:
    """The RaPyDLI side panel, opened from its side-bar tab when it is not showing."""
    from playwright.sync_api import expect

    panel = page.get_by_role("region", name="RaPyDLI", exact=True)
    if not panel.is_visible():
        page.locator('.jp-SideBar .lm-TabBar-tab[data-id="rapydli-panel"]').click()
    expect(panel).to_be_visible()
    return panel


def family_row(panel: Any, run_id: str) -> Any:
    """The run list's row of ``run_id``."""
    return panel.locator(f'tr[data-run-id="{run_id}"]')

"""configure() and the launch dashboard in real frontends: JupyterLab 4 and Notebook 7,
driven through Debian's chromium, rendering ipywidgets' own widgets (no extension of ours).

Each app runs on loopback with a token, in temporary Jupyter directories, and executes
examples/01_quickstart.ipynb. Screenshots go to artifacts/. Without chromium the tests
are skipped, unless NOTEBOOK_LAUNCHER_BROWSER_TESTS=1 (as in CI), where they fail.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(420)

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "artifacts"
EXAMPLE = ROOT / "examples" / "01_quickstart.ipynb"
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
]
PANEL = ".notebook-launcher-configure"
DASHBOARD = ".notebook-launcher-dashboard"
RECORD = ".nl-record"
# Where each app opens a notebook, and its module to start it with.
APPS = {"jupyterlab": ("jupyterlab", "lab/tree/{name}?reset&token={token}"),
        "notebook7": ("notebook", "notebooks/{name}?token={token}")}  # fmt: skip


def _missing(what: str) -> None:
    if os.environ.get("NOTEBOOK_LAUNCHER_BROWSER_TESTS") == "1":
        pytest.fail(what)
    pytest.skip(what)


@dataclass
class App:
    name: str
    url: str
    token: str
    root_dir: Path

    def notebook_url(self, notebook: str) -> str:
        return self.url + APPS[self.name][1].format(name=notebook, token=self.token)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_until_up(app: App, process: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"{app.name} exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{app.url}api/status?token={app.token}", timeout=2) as reply:
                if reply.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    pytest.fail(f"{app.name} did not answer at {app.url} within 90 s:\n{log.read_text()[-3000:]}")


@pytest.fixture(scope="module", params=sorted(APPS))
def app(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[App]:
    if not CHROMIUM.exists():
        _missing(f"{CHROMIUM} is missing: apt-get install -y chromium")
    name = request.param
    base = tmp_path_factory.mktemp(name)
    dirs = {d: base / d for d in ("root", "config", "data", "runtime", "settings", "user-settings", "workspaces")}
    for path in dirs.values():
        path.mkdir()
    (dirs["settings"] / "overrides.json").write_text(
        json.dumps({
            "@jupyterlab/apputils-extension:notification": {"fetchNews": "false"},
            # Every cell stays in the page: windowing would drop the ones scrolled away.
            "@jupyterlab/notebook-extension:tracker": {"windowingMode": "none"},
        })
    )
    shutil.copy(EXAMPLE, dirs["root"] / EXAMPLE.name)
    env = {
        **os.environ,
        "JUPYTER_CONFIG_DIR": str(dirs["config"]),
        "JUPYTER_DATA_DIR": str(dirs["data"]),
        "JUPYTER_RUNTIME_DIR": str(dirs["runtime"]),
        "JUPYTERLAB_SETTINGS_DIR": str(dirs["user-settings"]),
        "JUPYTERLAB_WORKSPACES_DIR": str(dirs["workspaces"]),
        "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
    }
    port, token = _free_port(), secrets.token_hex(16)
    running = App(name, f"http://127.0.0.1:{port}/", token, dirs["root"])
    log = base / "server.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [
                sys.executable, "-m", APPS[name][0],
                "--no-browser", "--allow-root", "--expose-app-in-browser",
                "--ip=127.0.0.1", f"--port={port}",
                f"--IdentityProvider.token={token}",
                f"--ServerApp.root_dir={dirs['root']}",
                f"--LabServerApp.app_settings_dir={dirs['settings']}",
            ],
            env=env, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        _wait_until_up(running, process, log)
        yield running
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture(scope="module")
def browser(app: App) -> Iterator[object]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


@pytest.fixture(scope="module")
def page(browser: object, app: App) -> Iterator[object]:
    """The example notebook, opened and run top to bottom (not waited for)."""
    context = browser.new_context(viewport={"width": 1400, "height": 1000})  # type: ignore[attr-defined]
    page = context.new_page()
    page.set_default_timeout(60_000)
    page.goto(app.notebook_url(EXAMPLE.name))
    page.locator(".jp-Notebook").wait_for()
    page.wait_for_function(
        "() => window.jupyterapp.shell.currentWidget?.sessionContext?.session?.kernel?.status === 'idle'",
        timeout=120_000,
    )
    # Not awaited: the command's promise settles only when every cell has run.
    page.evaluate("() => { void window.jupyterapp.commands.execute('notebook:run-all-cells'); }")
    yield page
    _screenshot(page, f"widgets-{app.name}-last")
    context.close()


def _screenshot(target: object, name: str) -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    target.screenshot(path=str(path))  # type: ignore[attr-defined]
    return path


def test_the_panel_renders_and_disables_an_impossible_choice_with_its_reason(page: object, app: App) -> None:
    from playwright.sync_api import expect

    panel = page.locator(PANEL)  # type: ignore[attr-defined]
    expect(panel).to_be_visible(timeout=120_000)
    expect(panel).to_contain_text("CPU")
    fp8 = panel.get_by_role("button", name="fp8", exact=True)
    expect(fp8).to_be_disabled()
    expect(fp8).to_have_attribute("title", "fp8 needs a Hopper-class NVIDIA GPU; this machine runs ranks on CPU")
    expect(panel.get_by_role("button", name="bf16", exact=True)).to_be_enabled()
    expect(panel).to_contain_text("fp8 is unavailable: fp8 needs a Hopper-class NVIDIA GPU; this machine runs ranks on CPU")
    expect(panel).to_contain_text("Next notebook_launcher() call:")
    _screenshot(panel, f"widgets-{app.name}-configure")


def test_the_dashboard_ends_as_a_record_with_every_rank_done_and_the_loss_plot(page: object, app: App) -> None:
    from playwright.sync_api import expect

    record = page.locator(RECORD).first  # type: ignore[attr-defined]
    expect(record).to_be_visible(timeout=180_000)
    expect(record.locator("tr.nl-rank")).to_have_count(2)
    expect(record.locator("tr.nl-done")).to_have_count(2)
    expect(record).to_contain_text("finished after")
    expect(record).to_contain_text("training: 40/40")
    # The final picture: every step of both ranks (01 logs 40 steps on each rank).
    expect(record).to_contain_text("80 points drawn of 80 logged")
    hover = record.locator("svg .nl-point circle title")
    assert hover.count() == 80
    assert "step 39, rank 1, loss = " in hover.all_text_contents()[-1]
    _screenshot(record, f"widgets-{app.name}-dashboard")
    # The widgets gave way to the record: nothing is left to say "model not found".
    assert page.get_by_text("Error displaying widget").count() == 0  # type: ignore[attr-defined]
    # The raw output of each rank is in the cell's own lines.
    expect(page.locator(".jp-OutputArea-output").filter(has_text="[rank1]: rank 1 epoch 4: last batch loss")).to_have_count(1)  # type: ignore[attr-defined]


def test_a_failing_rank_stays_highlighted_with_its_error_inside_the_output_area(page: object, app: App) -> None:
    from playwright.sync_api import expect

    failed = page.locator(f"{RECORD} tr.nl-failed")  # type: ignore[attr-defined]
    expect(failed).to_have_count(1, timeout=180_000)
    expect(failed).to_contain_text("ValueError: learning rate 10.0 is too large for rank 1")
    expect(page.locator(f"{RECORD} tr.nl-stopped")).to_have_count(1)  # type: ignore[attr-defined]
    error = failed.get_by_text("ValueError: learning rate 10.0 is too large for rank 1")
    area = page.locator(".jp-OutputArea-output").filter(has=failed).first  # type: ignore[attr-defined]
    inside(error.bounding_box(), area.bounding_box())
    _screenshot(page.locator(RECORD).last, f"widgets-{app.name}-failed")  # type: ignore[attr-defined]


def inside(box: dict | None, area: dict | None) -> None:
    assert box is not None and area is not None
    assert box["x"] >= area["x"] and box["x"] + box["width"] <= area["x"] + area["width"] + 1, (box, area)

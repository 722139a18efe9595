"""The dashboard in JupyterLab 4 and Notebook 7 through chromium: hover on the live plot,
a failed rank's error inside the output area, the record left when the launch ends, and
that record after the notebook is saved, its kernel shut down and the page opened again.
Screenshots go to docs/ (the dashboard page shows them) and artifacts/."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import nbformat
import pytest

from tests.browser.conftest import KERNEL_IDLE, ROOT, App, screenshot

pytestmark = pytest.mark.timeout(600)
DOCS = ROOT / "docs"
NAME = "dashboard_record.ipynb"
DASHBOARD = ".notebook-launcher-dashboard"
RECORD = ".nl-record"
ERROR = "ValueError: rank 1 diverged: loss is nan"

SOURCE = """
import os, time
from notebook_launcher import notebook_launcher

def train(gate):
    from tqdm import tqdm
    from notebook_launcher import Accelerator
    accelerator = Accelerator()
    for step in range(30):
        accelerator.log({"loss": 1.0 / (step + 1), "accuracy": step / 30, "learning_rate": 0.1,
                         "grad_norm": 1.0 + step % 3, "tokens_per_second": 1000.0 + step,
                         "epoch": step // 10}, step=step)
    for _ in tqdm(range(3), desc="a rather long description of what this bar counts"):
        pass
    while not os.path.exists(gate):
        time.sleep(0.05)
    if accelerator.process_index == 1:
        raise ValueError("\\x1b[31mrank 1 diverged: loss is nan\\x1b[0m")

try:
    notebook_launcher(train, args=({gate!r},), num_processes=2)
except ValueError:
    print("caught")
"""


def _open(page: object, app: App) -> None:
    page.goto(app.notebook_url(NAME))  # type: ignore[attr-defined]
    page.locator(".jp-Notebook").wait_for()  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def gate(app: App) -> Path:
    return app.root_dir / "gate"


@pytest.fixture(scope="module")
def console(app: App) -> list[str]:
    return []


@pytest.fixture(scope="module")
def page(browser: object, app: App, gate: Path, console: list[str]) -> Iterator[object]:
    notebook = nbformat.v4.new_notebook(
        cells=[nbformat.v4.new_code_cell(SOURCE.replace("{gate!r}", repr(str(gate))))]
    )
    notebook.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    nbformat.write(notebook, app.root_dir / NAME)
    context = browser.new_context(viewport={"width": 1280, "height": 1000})  # type: ignore[attr-defined]
    page = context.new_page()
    page.on("console", lambda message: console.append(f"{message.type}: {message.text}"))
    page.set_default_timeout(60_000)
    _open(page, app)
    page.wait_for_function(KERNEL_IDLE, timeout=120_000)
    page.evaluate("() => { void window.jupyterapp.commands.execute('notebook:run-all-cells'); }")
    yield page
    gate.touch()
    context.close()


def test_hovering_the_live_plot_shows_step_rank_and_value(
    page: object, app: App, gate: Path
) -> None:
    from playwright.sync_api import expect

    live = page.locator(DASHBOARD)  # type: ignore[attr-defined]
    # The ranks wait at the gate: the launch is live until the test opens it.
    page.wait_for_function(  # type: ignore[attr-defined]
        """() => [...document.querySelectorAll('.notebook-launcher-dashboard svg .nl-point circle title')]
                 .some(t => t.textContent === 'step 29, rank 1, loss = 0.0333333')""",
        timeout=180_000,
    )
    expect(live.locator("tr.nl-running")).to_have_count(2)
    live.locator("svg .nl-point circle").last.hover()
    assert not gate.exists()
    screenshot(live, f"dashboard-{app.name}-live")
    live.screenshot(path=str(DOCS / f"dashboard-live-{app.name}.png"))


def test_the_failed_ranks_error_is_seen_first_inside_the_output_area(
    page: object, app: App, gate: Path
) -> None:
    from playwright.sync_api import expect

    gate.touch()
    record = page.locator(RECORD)  # type: ignore[attr-defined]
    failed = record.locator("tr.nl-failed")
    expect(failed).to_have_count(1, timeout=180_000)
    error = failed.get_by_text(ERROR)
    expect(error).to_be_visible()
    area = page.locator(".jp-OutputArea-output").filter(has=failed).first  # type: ignore[attr-defined]
    box, frame = error.bounding_box(), area.bounding_box()
    assert box is not None and frame is not None
    assert frame["x"] <= box["x"] and box["x"] + box["width"] <= frame["x"] + frame["width"] + 1, (
        box,
        frame,
    )
    assert "[31m" not in record.inner_text()
    expect(page.get_by_text("caught", exact=True)).to_be_visible()  # type: ignore[attr-defined]
    assert page.get_by_text("Error displaying widget").count() == 0  # type: ignore[attr-defined]
    record.screenshot(path=str(DOCS / f"dashboard-record-{app.name}.png"))


def test_the_saved_notebook_reopened_without_its_kernel_still_shows_the_record(
    page: object, app: App
) -> None:
    from playwright.sync_api import expect

    expect(page.locator(RECORD)).to_be_visible(timeout=180_000)  # type: ignore[attr-defined]
    page.wait_for_function(KERNEL_IDLE, timeout=120_000)  # type: ignore[attr-defined]
    page.evaluate("() => window.jupyterapp.commands.execute('docmanager:save')")  # type: ignore[attr-defined]
    saved = app.root_dir / NAME
    deadline = time.monotonic() + 60
    while "nl-record" not in saved.read_text():
        assert time.monotonic() < deadline, "the notebook was not saved"
        time.sleep(0.2)
    assert "application/vnd.jupyter.widget-view+json" not in saved.read_text()
    app.server.shut_down_kernels()
    _open(page, app)
    record = page.locator(RECORD)  # type: ignore[attr-defined]
    expect(record).to_be_visible()
    expect(record.locator("tr.nl-failed")).to_contain_text(ERROR)
    titles = record.locator("svg .nl-point circle title").all_text_contents()
    assert "step 29, rank 1, loss = 0.0333333" in titles
    assert page.get_by_text("model not found").count() == 0  # type: ignore[attr-defined]
    assert page.get_by_text("Error displaying widget").count() == 0  # type: ignore[attr-defined]
    record.screenshot(path=str(DOCS / f"dashboard-reopened-{app.name}.png"))


def test_the_sidebar_loads_without_a_console_error_and_opens(
    page: object, app: App, console: list[str]
) -> None:
    from playwright.sync_api import expect

    # JupyterLab times each plugin's activation and warns past a bound: on a busy machine the
    # whole page is slow to start, which says nothing of the plugin (its activate() only adds
    # widgets and a command).
    slow_page = re.compile(r"is taking too long to activate|took [\d.]+ ?ms to activate")
    assert not [
        line
        for line in console
        if ("ILabShell" in line or "notebook-launcher" in line.lower())
        and not slow_page.search(line)
    ], console
    page.evaluate("() => window.jupyterapp.commands.execute('notebook-launcher:open-sidebar')")  # type: ignore[attr-defined]
    sidebar = page.locator("#notebook-launcher-sidebar")  # type: ignore[attr-defined]
    expect(sidebar).to_be_visible()
    expect(sidebar).to_contain_text("Launch defaults")
    screenshot(page, f"sidebar-{app.name}")

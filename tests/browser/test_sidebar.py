"""The "Distributed" sidebar in a real JupyterLab, driven through Debian's chromium.

The shared server and browser come from tests/browser/conftest.py; screenshots go to
artifacts/.
"""

from __future__ import annotations

import json
import os
import re
import time
import urllib.request
from collections.abc import Iterator

import nbformat
import pytest

from notebook_launcher import defaults as launch_defaults
from notebook_launcher.hardware import available_cpu_count
from tests.browser.conftest import KERNEL_IDLE, JupyterServer, screenshot

pytestmark = pytest.mark.timeout(240)

SIDEBAR_TAB = 'li[data-id="notebook-launcher-sidebar"]'
SIDEBAR = "#notebook-launcher-sidebar"


@pytest.fixture(scope="module")
def lab(jupyter_server: JupyterServer, module_folder: str) -> Iterator[JupyterServer]:
    """The shared server; the defaults these tests save are removed when they end, so that
    the other browser tests launch with the package's own defaults."""
    yield jupyter_server
    (jupyter_server.config_dir / "notebook_launcher" / "defaults.json").unlink(missing_ok=True)


@pytest.fixture
def page(browser: object, lab: JupyterServer, request: pytest.FixtureRequest) -> Iterator[object]:
    context = browser.new_context(viewport={"width": 1400, "height": 900})  # type: ignore[attr-defined]
    page = context.new_page()
    page.set_default_timeout(30_000)
    failed_before = request.session.testsfailed
    yield page
    if request.session.testsfailed > failed_before:  # what the page showed when it failed
        screenshot(page, f"failed-{request.node.name}")
    context.close()


def _open_sidebar(page: object, lab: JupyterServer, path: str = "lab") -> object:
    page.goto(lab.page_url(path))  # type: ignore[attr-defined]
    page.locator(SIDEBAR_TAB).click()  # type: ignore[attr-defined]
    sidebar = page.locator(SIDEBAR)  # type: ignore[attr-defined]
    sidebar.get_by_text("CPU cores").wait_for()
    return sidebar


def test_sidebar_shows_hardware_and_saves_the_chosen_defaults(
    page: object, lab: JupyterServer
) -> None:
    from playwright.sync_api import expect

    path = lab.config_dir / "notebook_launcher" / "defaults.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text('{"mixed_precision": "fp32"}')  # hand-edited and wrong

    sidebar = _open_sidebar(page, lab)
    expect(sidebar.locator("dd").nth(1)).to_have_text(str(available_cpu_count()))  # type: ignore[attr-defined]
    expect(sidebar).to_contain_text("Python")  # type: ignore[arg-type]
    expect(sidebar).to_contain_text("torch")  # type: ignore[arg-type]
    # The broken file is reported, not silently dropped.
    expect(sidebar.get_by_role("alert")).to_contain_text(  # type: ignore[attr-defined]
        f"Ignoring the launch defaults file {path}: mixed_precision must be one of"
    )
    # Impossible choices are disabled, with the reason shown.
    precision = sidebar.get_by_label("Mixed precision")  # type: ignore[attr-defined]
    expect(precision.locator('option[value="fp8"]')).to_be_disabled()
    expect(precision.locator('option[value="bf16"]')).to_be_enabled()
    expect(precision.locator('option[value="fp16"]')).to_be_enabled()  # torch runs it on CPU
    expect(sidebar).to_contain_text(  # type: ignore[arg-type]
        "fp8: fp8 needs a Hopper-class NVIDIA GPU; this machine runs ranks on CPU"
    )
    screenshot(page, "sidebar-1-hardware")

    sidebar.get_by_label("Processes").select_option("2")  # type: ignore[attr-defined]
    precision.select_option("bf16")
    sidebar.get_by_label("Start method").select_option("fork")  # type: ignore[attr-defined]
    sidebar.get_by_role("button", name="Save defaults").click()  # type: ignore[attr-defined]
    expect(sidebar.get_by_role("status")).to_have_text("Saved.")  # type: ignore[attr-defined]
    expect(sidebar.locator(".jp-NotebookLauncher-description")).to_have_text(
        "2 x CPU ranks, bf16, fork"
    )  # type: ignore[attr-defined]
    expect(sidebar.get_by_role("alert")).to_have_count(0)  # type: ignore[attr-defined]
    screenshot(page, "sidebar-2-saved")

    assert json.loads(path.read_text()) == {
        "num_processes": 2,
        "mixed_precision": "bf16",
        "start_method": "fork",
    }
    os.environ["JUPYTER_CONFIG_DIR"], saved_env = (
        str(lab.config_dir),
        os.environ.get("JUPYTER_CONFIG_DIR"),
    )
    try:
        assert launch_defaults.load_defaults() == launch_defaults.LaunchDefaults(2, "bf16", "fork")
    finally:
        if saved_env is None:
            del os.environ["JUPYTER_CONFIG_DIR"]
        else:
            os.environ["JUPYTER_CONFIG_DIR"] = saved_env

    # A reload shows what was saved.
    sidebar = _open_sidebar(page, lab)
    expect(sidebar.get_by_label("Mixed precision")).to_have_value("bf16")  # type: ignore[attr-defined]
    expect(sidebar.get_by_label("Processes")).to_have_value("2")  # type: ignore[attr-defined]


LAUNCH_CELL = """\
import os, time
from notebook_launcher import notebook_launcher

def train():
    print("WORLD_SIZE", os.environ["WORLD_SIZE"], "precision", os.environ["ACCELERATE_MIXED_PRECISION"], flush=True)
    time.sleep({sleep})

notebook_launcher(train{arguments})
"""


def _wait_for_idle_kernel(page: object) -> None:
    page.locator(".jp-Notebook").wait_for()  # type: ignore[attr-defined]
    page.wait_for_function(KERNEL_IDLE, timeout=90_000)  # type: ignore[attr-defined]


def _run_notebook_in_lab(page: object, lab: JupyterServer, name: str, *sources: str) -> object:
    """Open a notebook of these cells next to the sidebar and start running it (without waiting)."""
    notebook = nbformat.v4.new_notebook(
        cells=[nbformat.v4.new_code_cell(source) for source in sources]
    )
    notebook.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    nbformat.write(notebook, lab.root_dir / name)
    sidebar = _open_sidebar(page, lab, f"lab/tree/{name}")
    _wait_for_idle_kernel(page)
    # Not awaited: the command's promise settles only when the cell has finished.
    page.evaluate("() => { void window.jupyterapp.commands.execute('notebook:run-all-cells'); }")  # type: ignore[attr-defined]
    return sidebar


def _save_defaults_through_the_server(lab: JupyterServer, chosen: dict[str, object]) -> None:
    request = urllib.request.Request(
        f"{lab.url}notebook-launcher/defaults",
        data=json.dumps(chosen).encode(),
        method="POST",
        headers={"Authorization": f"token {lab.token}"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        assert response.status == 200


def test_a_running_launch_is_listed_and_stopped_from_the_sidebar(
    page: object, lab: JupyterServer
) -> None:
    from playwright.sync_api import expect

    source = LAUNCH_CELL.format(
        sleep=120, arguments=', num_processes=2, mixed_precision="bf16", start_method="fork"'
    )
    sidebar = _run_notebook_in_lab(page, lab, "launch.ipynb", source)
    output = page.locator(".jp-OutputArea-output")  # type: ignore[attr-defined]
    row = sidebar.locator(".jp-NotebookLauncher-launch")  # type: ignore[attr-defined]
    expect(row).to_contain_text("launch.ipynb", timeout=60_000)
    expect(row).to_contain_text("2 x CPU ranks, bf16, fork")
    expect(row).to_contain_text("running since")
    expect(output.first).to_contain_text("WORLD_SIZE 2 precision bf16", timeout=30_000)
    screenshot(page, "sidebar-3-running-launch")

    started = time.monotonic()
    row.get_by_role("button", name="Stop").click()
    expect(output.last).to_contain_text(
        "LaunchStoppedError: the launch was stopped from the JupyterLab sidebar; every rank was stopped.",
        timeout=30_000,
    )
    assert time.monotonic() - started < 30  # the ranks' 120 s sleep was cut short
    expect(sidebar).to_contain_text("No launch is running.", timeout=15_000)  # type: ignore[arg-type]
    expect(sidebar.get_by_role("alert")).to_have_count(0)  # type: ignore[attr-defined]
    screenshot(page, "sidebar-4-stopped")


def test_the_sidebar_says_where_each_rank_of_a_session_is(page: object, lab: JupyterServer) -> None:
    from playwright.sync_api import expect

    sidebar = _run_notebook_in_lab(
        page, lab, "session.ipynb",
        "%load_ext notebook_launcher\n%distributed start -n 2 --hardware cpu",
        "%%distributed\nimport time\nprint('napping', flush=True)\ntime.sleep(600 if rank == 0 else 0)",
    )  # fmt: skip
    row = sidebar.locator(".jp-NotebookLauncher-launch")  # type: ignore[attr-defined]
    ranks = row.locator(".jp-NotebookLauncher-launch-ranks li")
    try:
        expect(row).to_contain_text("Session: 2 x CPU ranks", timeout=60_000)
        output = page.locator(".jp-OutputArea-output")  # type: ignore[attr-defined]
        expect(output.last).to_contain_text("[rank1]: napping", timeout=60_000)
        row.get_by_role("button", name=re.compile("Where are the ranks")).click()
        expect(ranks).to_have_text(
            [
                re.compile(r"rank 0: cell \d+, line 4, in time\.sleep"),
                "rank 1: idle, waiting for the next cell",
            ],
            timeout=30_000,
        )
        where = ranks.first.inner_text()
        expect(row).to_contain_text(re.compile(r"as of \d+ s ago"))
        expect(row.get_by_role("button", name=re.compile("Where are the ranks"))).to_be_enabled()
        screenshot(page, "sidebar-7-where-the-ranks-are")
    finally:
        row.get_by_role("button", name="Stop").click()
        expect(sidebar).to_contain_text("No launch is running.", timeout=30_000)  # type: ignore[arg-type]
    # The cell named is the one the notebook numbers so, now that it has ended.
    prompt = page.locator(".jp-Cell .jp-InputPrompt").nth(1)  # type: ignore[attr-defined]
    expect(prompt).not_to_have_text("[*]:", timeout=30_000)
    assert where.startswith(f"rank 0: cell {prompt.inner_text().strip()[1:-2]}, "), (
        where,
        prompt.inner_text(),
    )


def test_a_launch_without_arguments_uses_the_saved_defaults(
    page: object, lab: JupyterServer
) -> None:
    from playwright.sync_api import expect

    _save_defaults_through_the_server(
        lab, {"num_processes": 2, "mixed_precision": "bf16", "start_method": "fork"}
    )
    sidebar = _run_notebook_in_lab(
        page, lab, "defaults.ipynb", LAUNCH_CELL.format(sleep=120, arguments="")
    )
    row = sidebar.locator(".jp-NotebookLauncher-launch")  # type: ignore[attr-defined]
    expect(row).to_contain_text("defaults.ipynb", timeout=60_000)
    output = page.locator(".jp-OutputArea-output")  # type: ignore[attr-defined]
    try:
        expect(output.first).to_contain_text("WORLD_SIZE 2 precision bf16", timeout=15_000)
        expect(row).to_contain_text("2 x CPU ranks, bf16, fork", timeout=5_000)
        screenshot(page, "sidebar-6-saved-defaults-used")
    finally:
        row.get_by_role("button", name="Stop").click()
        expect(sidebar).to_contain_text("No launch is running.", timeout=30_000)  # type: ignore[arg-type]


def test_server_errors_are_shown_in_the_sidebar(page: object, lab: JupyterServer) -> None:
    from playwright.sync_api import expect

    sidebar = _open_sidebar(page, lab)
    # The launch ended meanwhile (or never existed): the server's 404 reason reaches the user.
    page.route(  # type: ignore[attr-defined]
        re.compile(r"/notebook-launcher/launches(\?|$)"),  # the client adds a cache-busting query
        lambda route: route.fulfill(
            status=200,
            content_type="application/json",
            body=json.dumps({
                "launches": [{
                    "launch_id": "gone01", "kernel_id": None, "kernel_pid": 1, "notebook": "old.ipynb",
                    "num_processes": 2, "accelerator": "cpu", "mixed_precision": "no",
                    "start_method": "spawn", "state": "running", "started_at": time.time(),
                    "rank_pids": [],
                }],
                "now": time.time(),
            }),
        ),
    )  # fmt: skip
    row = sidebar.locator(".jp-NotebookLauncher-launch")  # type: ignore[attr-defined]
    expect(row).to_contain_text("old.ipynb", timeout=15_000)
    row.get_by_role("button", name="Stop").click()
    expect(sidebar.get_by_role("alert")).to_have_text(  # type: ignore[attr-defined]
        "Could not stop the launch: No running launch has the id 'gone01'; it may have finished "
        "already. The list of launches shows the ones running now."
    )
    screenshot(page, "sidebar-5-error")


def test_the_sidebar_follows_defaults_saved_by_configure_without_a_reload(
    page: object, lab: JupyterServer
) -> None:
    from playwright.sync_api import expect

    sidebar = _run_notebook_in_lab(
        page, lab, "configure_save.ipynb",
        "from notebook_launcher import configure\n"
        "configure(num_processes=1, mixed_precision='fp16', start_method='spawn', save=True)\n",
    )  # fmt: skip
    expect(sidebar.get_by_label("Processes")).to_have_value("1", timeout=60_000)  # type: ignore[attr-defined]
    expect(sidebar.get_by_label("Mixed precision")).to_have_value("fp16")  # type: ignore[attr-defined]
    expect(sidebar.get_by_label("Start method")).to_have_value("spawn")  # type: ignore[attr-defined]
    expect(sidebar.get_by_role("status")).to_have_text("Updated: the saved defaults changed.")  # type: ignore[attr-defined]
    screenshot(page, "sidebar-followed-configure")

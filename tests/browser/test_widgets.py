"""configure() and the launch dashboard in real frontends: JupyterLab 4 and Notebook 7,
driven through Debian's chromium, rendering ipywidgets' own widgets (no extension of ours).

Each frontend of the shared server (tests/browser/conftest.py) executes
examples/01_quickstart.ipynb. Screenshots go to artifacts/.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest

from tests.browser.conftest import KERNEL_IDLE, ROOT, App, screenshot

pytestmark = pytest.mark.timeout(420)

EXAMPLE = ROOT / "examples" / "01_quickstart.ipynb"
PANEL = ".notebook-launcher-configure"
DASHBOARD = ".notebook-launcher-dashboard"
RECORD = ".nl-record"


@pytest.fixture(scope="module")
def page(browser: object, app: App) -> Iterator[object]:
    """The example notebook, opened and run top to bottom (not waited for)."""
    shutil.copy(EXAMPLE, app.root_dir / EXAMPLE.name)
    context = browser.new_context(viewport={"width": 1400, "height": 1000})  # type: ignore[attr-defined]
    page = context.new_page()
    page.set_default_timeout(60_000)
    page.goto(app.notebook_url(EXAMPLE.name))
    page.locator(".jp-Notebook").wait_for()
    page.wait_for_function(KERNEL_IDLE, timeout=120_000)
    # Not awaited: the command's promise settles only when every cell has run.
    page.evaluate("() => { void window.jupyterapp.commands.execute('notebook:run-all-cells'); }")
    yield page
    screenshot(page, f"widgets-{app.name}-last")
    context.close()


def test_the_panel_renders_and_disables_an_impossible_choice_with_its_reason(
    page: object, app: App
) -> None:
    from playwright.sync_api import expect

    panel = page.locator(PANEL)  # type: ignore[attr-defined]
    expect(panel).to_be_visible(timeout=120_000)
    expect(panel).to_contain_text("CPU")
    fp8 = panel.get_by_role("button", name="fp8", exact=True)
    expect(fp8).to_be_disabled()
    expect(fp8).to_have_attribute(
        "title", "fp8 needs a Hopper-class NVIDIA GPU; this machine runs ranks on CPU"
    )
    expect(panel.get_by_role("button", name="bf16", exact=True)).to_be_enabled()
    expect(panel).to_contain_text(
        "fp8 is unavailable: fp8 needs a Hopper-class NVIDIA GPU; this machine runs ranks on CPU"
    )
    expect(panel).to_contain_text("Next notebook_launcher() call:")
    screenshot(panel, f"widgets-{app.name}-configure")


def test_the_dashboard_ends_as_a_record_with_every_rank_done_and_the_loss_plot(
    page: object, app: App
) -> None:
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
    screenshot(record, f"widgets-{app.name}-dashboard")
    # The widgets gave way to the record: nothing is left to say "model not found".
    assert page.get_by_text("Error displaying widget").count() == 0  # type: ignore[attr-defined]
    # The raw output of each rank is in the cell's own lines.
    expect(
        page.locator(".jp-OutputArea-output").filter(
            has_text="[rank1]: rank 1 epoch 4: last batch loss"
        )
    ).to_have_count(1)  # type: ignore[attr-defined]


def test_a_failing_rank_stays_highlighted_with_its_error_inside_the_output_area(
    page: object, app: App
) -> None:
    from playwright.sync_api import expect

    failed = page.locator(f"{RECORD} tr.nl-failed")  # type: ignore[attr-defined]
    expect(failed).to_have_count(1, timeout=180_000)
    expect(failed).to_contain_text("ValueError: learning rate 10.0 is too large for rank 1")
    expect(page.locator(f"{RECORD} tr.nl-stopped")).to_have_count(1)  # type: ignore[attr-defined]
    error = failed.get_by_text("ValueError: learning rate 10.0 is too large for rank 1")
    area = page.locator(".jp-OutputArea-output").filter(has=failed).first  # type: ignore[attr-defined]
    inside(error.bounding_box(), area.bounding_box())
    screenshot(page.locator(RECORD).last, f"widgets-{app.name}-failed")  # type: ignore[attr-defined]


def inside(box: dict | None, area: dict | None) -> None:
    assert box is not None and area is not None
    assert box["x"] >= area["x"] and box["x"] + box["width"] <= area["x"] + area["width"] + 1, (
        box,
        area,
    )

"""Run by test_classic_notebook.py in a process of its own (Playwright's sync API cannot
share a process with the other browser tests' browser): serve ``folder`` with the classic
Notebook of ``python``'s environment, run the notebook there in chromium, and screenshot the
configure() panel and the live dashboard into ``folder``. Prints one JSON line of findings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from playwright.sync_api import expect, sync_playwright

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.support.ports import free_port


def main(python: str, folder: str) -> None:
    port, token = free_port(), "classic-notebook-check"
    server = subprocess.Popen(
        [python, "-m", "notebook", "--no-browser", "--allow-root", "--ip=127.0.0.1",
         f"--port={port}", f"--NotebookApp.token={token}", f"--notebook-dir={folder}"],
        env=dict(os.environ, JUPYTER_RUNTIME_DIR=str(Path(folder) / "runtime")),
        stdout=open(Path(folder) / "server.log", "w"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    found: dict[str, object] = {}
    try:
        deadline = time.monotonic() + 300
        while True:  # the server answers once it listens
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/api?token={token}", timeout=5)
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise
                time.sleep(0.2)
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(
                executable_path="/usr/bin/chromium",
                args=["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                      "--disable-component-update", "--no-first-run"],
            )  # fmt: skip
            page = browser.new_page(viewport={"width": 1200, "height": 1000})
            page.goto(f"http://127.0.0.1:{port}/notebooks/dashboard.ipynb?token={token}")
            page.wait_for_function(
                "document.querySelector('#kernel_indicator_icon')"
                ".classList.contains('kernel_idle_icon')",
                timeout=300_000,
            )
            page.evaluate("Jupyter.notebook.execute_all_cells()")
            panel = page.locator(".notebook-launcher-configure").first
            expect(panel).to_be_visible(timeout=300_000)
            expect(panel).to_contain_text("Start method")
            panel.screenshot(path=str(Path(folder) / "configure-classic.png"))
            board = page.locator(".notebook-launcher-dashboard").first
            expect(board).to_be_visible(timeout=300_000)
            expect(board.locator("svg").first).to_be_visible(timeout=300_000)  # the live plot
            expect(board).to_contain_text("running")
            board.screenshot(path=str(Path(folder) / "dashboard-live-classic-notebook.png"))
            found["live"] = board.inner_text()
            # Then the record replaces the widgets, and no widget failed to show.
            page.wait_for_function(
                "!document.querySelector('.notebook-launcher-dashboard')", timeout=300_000
            )
            # Found by its text, as a reader finds it: in the classic Notebook's page the
            # record's class names were not found (the notebook shows "Not Trusted" here).
            record = page.locator(".output_subarea").filter(has_text="finished after").first
            expect(record).to_be_visible(timeout=300_000)
            found["record"] = record.inner_text()
            found["widget errors"] = page.get_by_text("Error displaying widget").count()
            browser.close()
    finally:
        server.terminate()
        server.wait(60)
    print(json.dumps(found))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

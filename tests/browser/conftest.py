"""One Jupyter server and one chromium for every browser test.

The server is JupyterLab's, which also serves Notebook 7's pages (its server extension is
enabled by its install), on loopback with a token, in temporary Jupyter directories; the lab
extension is the one built into notebook_launcher/labextension, first on the search path as
`pip install` would place it. Each test module works in a folder of its own under the
server's root and shuts its kernels down when it ends; under pytest-xdist they all run in
one worker (tests/conftest.py groups them). Both live as long as this folder's tests (package
scope), so that the tests that run after them in that worker see neither the server's
processes nor Playwright's running event loop. Screenshots go to artifacts/.

Without chromium or the built extension the tests are skipped, unless
NOTEBOOK_LAUNCHER_BROWSER_TESTS=1 (as in CI), where they fail instead.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import notebook_launcher
from tests.support.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "artifacts"
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
]
LABEXTENSION = "notebook-launcher-labextension"
BUILT = Path(notebook_launcher.__file__).parent / "labextension"
# Where each frontend opens a notebook (a path relative to the server's root).
FRONTENDS = {"jupyterlab": "lab/tree/{path}?reset&token={token}",
             "notebook7": "notebooks/{path}?token={token}"}  # fmt: skip
KERNEL_IDLE = "() => window.jupyterapp.shell.currentWidget?.sessionContext?.session?.kernel?.status === 'idle'"


def missing(what: str) -> None:
    if os.environ.get("NOTEBOOK_LAUNCHER_BROWSER_TESTS") == "1":
        pytest.fail(what)
    pytest.skip(what)


@dataclass
class JupyterServer:
    url: str
    token: str
    root_dir: Path
    config_dir: Path
    env: dict[str, str]

    def page_url(self, path: str = "lab") -> str:
        return f"{self.url}{path}?reset&token={self.token}"

    def kernels(self) -> list[dict]:
        with urllib.request.urlopen(
            f"{self.url}api/kernels?token={self.token}", timeout=10
        ) as reply:
            return json.loads(reply.read())

    def shut_down_kernels(self) -> None:
        for kernel in self.kernels():
            request = urllib.request.Request(
                f"{self.url}api/kernels/{kernel['id']}?token={self.token}", method="DELETE"
            )
            urllib.request.urlopen(request, timeout=30).close()


@dataclass
class App:
    """One frontend of the shared server, working in a folder of its own."""

    name: str
    server: JupyterServer
    folder: str

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def token(self) -> str:
        return self.server.token

    @property
    def root_dir(self) -> Path:
        return self.server.root_dir / self.folder

    def notebook_url(self, notebook: str) -> str:
        return self.url + FRONTENDS[self.name].format(
            path=f"{self.folder}/{notebook}", token=self.token
        )


def _wait_until_up(url: str, token: str, process: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(
                f"the Jupyter server exited with {process.returncode}:\n{log.read_text()[-3000:]}"
            )
        try:
            with urllib.request.urlopen(f"{url}api/status?token={token}", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    pytest.fail(
        f"the Jupyter server did not answer at {url} within 180 s:\n{log.read_text()[-3000:]}"
    )


@pytest.fixture(scope="package")
def jupyter_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[JupyterServer]:
    if not CHROMIUM.exists():
        missing(f"{CHROMIUM} is missing: apt-get install -y chromium")
    if not (BUILT / "package.json").exists():
        missing(
            f"the lab extension is not built ({BUILT}): run `jlpm install && jlpm build:prod` in extension/"
        )
    base = tmp_path_factory.mktemp("jupyter")
    names = (
        "root",
        "config",
        "data",
        "runtime",
        "share",
        "settings",
        "user-settings",
        "workspaces",
    )
    dirs = {name: base / name for name in names}
    for path in dirs.values():
        path.mkdir()
    (dirs["share"] / "labextensions").mkdir()
    (dirs["share"] / "labextensions" / LABEXTENSION).symlink_to(BUILT, target_is_directory=True)
    (dirs["settings"] / "overrides.json").write_text(
        json.dumps({
            "@jupyterlab/apputils-extension:notification": {"fetchNews": "false"},
            # Every cell stays in the page: windowing would drop the ones scrolled away.
            "@jupyterlab/notebook-extension:tracker": {"windowingMode": "none"},
        })
    )  # fmt: skip
    (dirs["config"] / "jupyter_server_config.json").write_text(
        json.dumps({"ServerApp": {"jpserver_extensions": {"notebook_launcher.server": True}}})
    )
    env = {
        **os.environ,
        "JUPYTER_CONFIG_DIR": str(dirs["config"]),
        "JUPYTER_DATA_DIR": str(dirs["data"]),
        "JUPYTER_RUNTIME_DIR": str(dirs["runtime"]),
        "JUPYTER_PATH": str(dirs["share"]),
        "JUPYTERLAB_SETTINGS_DIR": str(dirs["user-settings"]),
        "JUPYTERLAB_WORKSPACES_DIR": str(dirs["workspaces"]),
        "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
    }
    port, token = free_port(), secrets.token_hex(16)
    log = base / "server.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [
                sys.executable, "-m", "jupyterlab",
                "--no-browser", "--allow-root", "--expose-app-in-browser",
                "--ip=127.0.0.1", f"--port={port}",
                f"--IdentityProvider.token={token}",
                f"--ServerApp.root_dir={dirs['root']}",
                f"--LabServerApp.app_settings_dir={dirs['settings']}",
                f"--LabApp.app_settings_dir={dirs['settings']}",
                "--JupyterNotebookApp.expose_app_in_browser=True",
            ],
            env=env, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}/"
    try:
        _wait_until_up(url, token, process, log)
        yield JupyterServer(url, token, dirs["root"], dirs["config"], env)
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture(scope="module")
def module_folder(jupyter_server: JupyterServer, request: pytest.FixtureRequest) -> Iterator[str]:
    """A folder of the server's root for this module; its kernels are shut down at its end."""
    name = request.module.__name__.rsplit(".", 1)[-1]
    (jupyter_server.root_dir / name).mkdir(exist_ok=True)
    yield name
    jupyter_server.shut_down_kernels()


@pytest.fixture(scope="module", params=sorted(FRONTENDS))
def app(
    jupyter_server: JupyterServer, module_folder: str, request: pytest.FixtureRequest
) -> Iterator[App]:
    """Each frontend in turn, in a folder of its own; its kernels are shut down after it."""
    folder = f"{module_folder}/{request.param}"
    (jupyter_server.root_dir / folder).mkdir(parents=True, exist_ok=True)
    yield App(request.param, jupyter_server, folder)
    jupyter_server.shut_down_kernels()


@pytest.fixture(scope="package")
def browser(jupyter_server: JupyterServer) -> Iterator[object]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


def screenshot(target: object, name: str) -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    target.screenshot(path=str(path))  # type: ignore[attr-defined]
    return path

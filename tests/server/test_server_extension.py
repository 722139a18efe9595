"""How Jupyter finds the extensions: entry points, the config file, a cheap import."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from notebook_launcher import server

ROOT = Path(__file__).resolve().parents[2]


def test_the_labextension_path_names_the_built_extension() -> None:
    package = json.loads((ROOT / "extension" / "package.json").read_text())
    [entry] = server._jupyter_labextension_paths()
    assert entry["dest"] == package["name"] == server.LABEXTENSION_NAME
    assert Path(entry["src"]) == Path(server.__file__).resolve().parent.parent / "labextension"
    assert package["jupyterlab"]["outputDir"] == "../notebook_launcher/labextension"


def test_the_config_file_enables_the_module_the_extension_points_name() -> None:
    config = json.loads(
        (ROOT / "jupyter-config" / "server-config" / "notebook_launcher.json").read_text()
    )
    enabled = config["ServerApp"]["jpserver_extensions"]
    assert enabled == {"notebook_launcher.server": True}
    assert server._jupyter_server_extension_points() == [{"module": "notebook_launcher.server"}]
    assert callable(server._load_jupyter_server_extension)


def test_importing_the_extension_module_does_not_import_the_server() -> None:
    code = (
        "import sys, notebook_launcher.server as s; s._jupyter_labextension_paths(); "
        "print(sorted(m for m in ('tornado', 'jupyter_server', 'notebook_launcher.server.handlers') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert out.stdout.strip() == "[]"

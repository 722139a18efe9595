"""Execute a notebook in a real Jupyter kernel and print what each cell showed.

python examples/run_notebook.py examples/01_quickstart.ipynb
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebook", type=Path)
    parser.add_argument("--timeout", type=int, default=600, help="seconds per cell")
    options = parser.parse_args()
    notebook = nbformat.read(options.notebook, as_version=4)
    started = time.monotonic()
    NotebookClient(
        notebook,
        timeout=options.timeout,
        kernel_name="python3",
        resources={"metadata": {"path": str(options.notebook.parent)}},
    ).execute()
    for index, cell in enumerate(notebook.cells):
        if cell.cell_type != "code":
            continue
        print(f"--- cell {index} ---")
        for output in cell.get("outputs", []):
            if output.output_type == "stream":
                sys.stdout.write(output.text)
            elif "data" in output and "text/plain" in output.data:
                print(output.data["text/plain"])
    print(
        f"--- {options.notebook} ran in a Jupyter kernel in {time.monotonic() - started:.1f}s ---"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Tracebacks from the ranks name a cell by the number the notebook shows on it.

Run as nbclient (and so nbconvert and the course's build) runs a notebook, in a real kernel
of whichever IPython this environment has: the suite run in the environments pinned like
Colab's and Kaggle's (IPython 7.34) and in others (IPython 8, 9) covers each version.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from notebook_launcher.cell_names import cell_number, name_cells

pytestmark = pytest.mark.kernel

CELLS = [
    "padding = 1",  # [1]: the numbers differ from the cells' positions from here on
    "%load_ext notebook_launcher\n%distributed start -n 2 --hardware cpu",  # [2]
    # [3]: a function defined in the kernel, run by a session cell and by a launch
    "import os\n\n\ndef fails_on_rank_one():\n    if os.environ['RANK'] == '1':\n"
    "        raise ValueError('from the helper')\n    return 0",
    "%%distributed\nx = 1\nif rank == 1:\n    raise ValueError('in the cell')",  # [4]
    "%%distributed\nfails_on_rank_one()",  # [5]
    "from notebook_launcher import notebook_launcher\n"  # [6]
    "notebook_launcher(fails_on_rank_one, num_processes=2, start_method='fork', dashboard=False)",
    "%distributed stop",  # [7]
]


def _plain(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", text)


@pytest.fixture(scope="module")
def executed():
    nbformat = pytest.importorskip("nbformat")
    pytest.importorskip("nbclient")
    from tests.support.kernel_driver import execute_notebook

    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in CELLS])
    execute_notebook(notebook, str(Path.cwd()), timeout=600, allow_errors=True)
    return notebook


def _rank_traceback(cell) -> str:
    errors = [o for o in cell.outputs if o.output_type == "error"]
    assert len(errors) == 1, cell.outputs
    shown = _plain(errors[0]["evalue"])
    return shown[shown.index("Traceback from rank 1:") :]


def test_a_session_cells_traceback_names_its_own_cell(executed):
    cell = executed.cells[3]
    assert cell.execution_count == 4
    assert 'File "In[4]", line 4, in <module>' in _rank_traceback(cell)


def test_a_session_cell_that_calls_an_earlier_cells_function_names_its_own_cell(executed):
    # The function itself travels by value with cloudpickle, which names every such code
    # object's file "<dynamic-code>": no cell can be told from it.
    cell = executed.cells[4]
    assert cell.execution_count == 5
    shown = _rank_traceback(cell)
    assert 'File "In[5]", line 2, in <module>' in shown
    assert "ipykernel_" not in shown and "ipython-input" not in shown


def test_a_launched_function_is_named_by_its_cell(executed):
    cell = executed.cells[5]
    assert cell.execution_count == 6
    shown = _rank_traceback(cell)
    assert 'File "In[3]", line 6, in fails_on_rank_one' in shown, shown
    assert "ipykernel_" not in shown and "ipython-input" not in shown


class _Compiler:
    """IPython 7's: no format_code_name; names made from the cell and its number."""

    def get_code_name(self, raw: str, transformed: str, number: int) -> str:
        return f"<ipython-input-{number}-{abs(hash(transformed)) % 10**6}>"


class _History:
    input_hist_raw = ("", "a = 1", "b = 2", "a = 1")
    input_hist_parsed = ("", "a = 1\n", "b = 2\n", "a = 1\n")


class _Shell:
    compile = _Compiler()
    history_manager = _History()


def test_without_format_code_name_each_stored_cell_is_named_again_latest_first():
    shell = _Shell()
    assert cell_number(shell, _Compiler().get_code_name("b = 2", "b = 2\n", 2)) == 2
    assert cell_number(shell, _Compiler().get_code_name("a = 1", "a = 1\n", 3)) == 3
    assert cell_number(shell, "/work/train.py") is None


def test_outside_a_kernel_a_traceback_is_left_as_it_is():
    text = 'Traceback (most recent call last):\n  File "/tmp/ipykernel_1/2.py", line 3, in f\n'
    assert name_cells(text) == text

"""Which dashboard a launch gets: widgets in a kernel, text elsewhere, none when off."""

from __future__ import annotations

import pytest

from notebook_launcher import notebook_launcher
from notebook_launcher.errors import LaunchConfigError
from notebook_launcher.widgets.frontend import choose_view


@pytest.mark.parametrize(
    ("dashboard", "shell", "has_ipywidgets", "view"),
    [
        ("auto", "kernel", True, "widgets"),
        ("auto", "kernel", False, "text"),
        ("auto", "terminal", True, "text"),
        ("auto", "none", True, "text"),
        (True, "kernel", True, "widgets"),
        (True, "none", False, "text"),
        (False, "kernel", True, None),
        (False, "none", True, None),
    ],
)
def test_the_view_follows_the_setting_and_where_the_code_runs(
    dashboard, shell, has_ipywidgets, view
):
    assert choose_view(dashboard, shell, has_ipywidgets) == view


@pytest.mark.parametrize("wrong", ["on", "widgets", 1, 0, None, 1.0])
def test_an_unknown_dashboard_setting_is_refused_with_the_choices(wrong):
    with pytest.raises(
        LaunchConfigError, match=rf"dashboard={wrong!r} is not a dashboard setting; use 'auto'"
    ):
        choose_view(wrong, "kernel", True)


def test_asking_for_widgets_without_ipywidgets_in_a_notebook_says_how_to_get_them():
    with pytest.raises(
        LaunchConfigError, match=r"dashboard=True needs ipywidgets .* `pip install ipywidgets`"
    ):
        choose_view(True, "kernel", False)


def test_a_plain_interpreter_gets_the_text_dashboard():
    # In a fresh interpreter: other tests in this process may have made an IPython shell.
    import subprocess
    import sys

    code = (
        "from notebook_launcher.widgets import dashboard_observer\n"
        "from notebook_launcher.widgets.frontend import shell_kind\n"
        "from notebook_launcher.widgets.text import TextDashboard\n"
        "assert shell_kind() == 'none', shell_kind()\n"
        "assert isinstance(dashboard_observer('auto'), TextDashboard)\n"
        "assert dashboard_observer(False) is None\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_the_launcher_refuses_a_wrong_dashboard_before_starting_ranks():
    with pytest.raises(LaunchConfigError, match="dashboard='yes' is not a dashboard setting"):
        notebook_launcher(print, num_processes=1, dashboard="yes")


def test_the_package_and_its_widgets_import_without_torch_and_load_ipywidgets_lazily():
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['torch'] = None\n"  # as if torch were not installed
        "import notebook_launcher\n"
        "from notebook_launcher import configure\n"
        "import notebook_launcher.widgets.dashboard, notebook_launcher.widgets.panel\n"
        "print(sorted(m for m in ('ipywidgets', 'matplotlib') if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"

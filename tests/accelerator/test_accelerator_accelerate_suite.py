"""accelerate's own test_sync, test_script, test_ops and test_distributed_data_loop, with
our Accelerator, PartialState and collectives, on 2 CPU ranks.

The scripts come from the installed accelerate at test time; only the imports of the
names in accelerate_suite.OURS are changed to ours (accelerator_scripts/accelerate_suite.py).
Each script's main() also runs whole, as one case. Each case runs
with accelerate's own Accelerator and with ours, each in its own launch of
notebook_launcher; every case accelerate's Accelerator passes must pass with ours. The
per-case table is written to accelerate_suite.md in the test's temporary folder.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.accelerator import SCRIPTS, plain_process  # noqa: F401

sys.path.insert(0, str(SCRIPTS))
import accelerate_suite as suite

pytest.importorskip("accelerate")
pytestmark = pytest.mark.usefixtures("plain_process")


@pytest.fixture(scope="module")
def variants(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[tuple[str, str], Path]]:
    folder = tmp_path_factory.mktemp("accelerate_suite")
    outcomes: list[suite.Outcome] = []
    paths = suite.write_variants(folder)
    yield {**paths, ("outcomes", ""): outcomes}  # type: ignore[dict-item]
    table = suite.table(outcomes)
    (folder / "accelerate_suite.md").write_text(table + "\n")
    print(f"\naccelerate suite, 2 CPU ranks ({folder / 'accelerate_suite.md'}):\n{table}")


def _without_imports(source: str) -> str:
    tree = ast.parse(source)
    tree.body = [n for n in tree.body if not isinstance(n, (ast.Import, ast.ImportFrom))]
    return ast.dump(tree)


@pytest.mark.parametrize("script", suite.SCRIPTS)
def test_the_variant_differs_from_the_installed_script_only_in_those_imports(script: str) -> None:
    source = suite.installed_script(script).read_text()
    rewritten, redirected = suite.rewrite_imports(source, suite.OURS[script])
    assert _without_imports(rewritten) == _without_imports(source)
    assert redirected == set(suite.OURS[script])
    assert "from notebook_launcher.accelerator import" in rewritten


# Each runs accelerate's script twice (theirs, then ours) over 2 ranks for about 30 s.
_LONG_CASES = {
    "test_distributed_data_loop:main()",
    "test_distributed_data_loop:test_can_join_uneven_inputs()",
}


def _case_param(case: str) -> Any:
    if suite.case_id(case) not in _LONG_CASES:
        return case
    reason = "runs accelerate's data-loop script twice on 2 ranks, about 30 s"
    return pytest.param(case, marks=pytest.mark.slow(reason=reason))


@pytest.mark.timeout(900)  # two variants, each up to run_one's timeout and a retry
@pytest.mark.parametrize("case", [_case_param(c) for c in suite.cases()], ids=suite.case_id)
def test_each_case_accelerate_passes_passes_with_ours(
    variants: dict[tuple[str, str], Path],
    case: str,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    monkeypatch.chdir(tmp_path)  # process_execution_check writes a file in the working folder
    script, call = case.split(":", 1)
    outcomes: list[suite.Outcome] = variants[("outcomes", "")]  # type: ignore[assignment]
    setup = suite.SETUP[script]
    # accelerate's join on CPU ranks waits forever: its hang needs a short wait only.
    theirs = suite.run_one(
        variants[(script, "theirs")],
        call,
        setup=setup,
        timeout=suite.THEIR_HANG_TIMEOUT if case in suite.THEY_HANG else 150,
    )
    ours = suite.run_one(variants[(script, "ours")], call, setup=setup)
    outcomes += [
        suite.Outcome(case, "theirs", theirs.passed, theirs.error),
        suite.Outcome(case, "ours", ours.passed, ours.error),
    ]
    if case in suite.PRIVATE_REASONS:
        pytest.skip(f"tests accelerate's private internals: {suite.PRIVATE_REASONS[case]}")
    if case in suite.BEYOND_ACCELERATE:
        assert ours.passed, f"this core runs join_uneven_inputs on CPU ranks, yet: {ours.error}"
    if not theirs.passed:
        pytest.skip(f"accelerate's own Accelerator fails this case here: {theirs.error}")
    assert ours.passed, f"passes with accelerate's Accelerator, fails with ours: {ours.error}"

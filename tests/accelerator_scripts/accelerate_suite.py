"""accelerate's own distributed test scripts, run case by case against its Accelerator and ours.

The scripts are read from the INSTALLED accelerate (``accelerate/test_utils/scripts``), never
copied into this repository. The "ours" variant changes only the imports of ``OURS`` to
``notebook_launcher.accelerator``; everything else the scripts import (accelerate's
``AcceleratorState``, ``prepare_data_loader``, ``gather``, test models) stays accelerate's.
Each case runs in its own 2-rank launch, so a case that fails on one rank only cannot
leave the other rank waiting in a later case's collective.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import itertools
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

OURS = frozenset(
    {"Accelerator", "DataLoaderConfiguration", "GradientAccumulationPlugin", "DistributedType", "set_seed"}
)
SCRIPTS = ("test_sync", "test_script")

# Single-process cases (accelerate's main() runs them only when DistributedType.NO).
SINGLE_PROCESS_ONLY = frozenset({"test_sync:test_noop_sync()"})
# Cases that test accelerate's private singletons rather than Accelerator behaviour: they
# are run and recorded but not counted (see PRIVATE_REASONS).
PRIVATE_REASONS = {
    "test_script:test_reinstantiated_state()": (
        "calls accelerate's AcceleratorState._reset_state() (a private singleton reset) and "
        "expects the Accelerator made before it to fail in prepare() with accelerate's "
        "message about that reset; this core keeps its state per Accelerator, with no "
        "process-wide singleton to reset, so the earlier Accelerator keeps working"
    ),
}


def installed_script(name: str) -> Path:
    spec = importlib.util.find_spec("accelerate")
    if spec is None or spec.origin is None:
        raise RuntimeError("accelerate is not installed")
    return Path(spec.origin).parent / "test_utils" / "scripts" / f"{name}.py"


def _alias(alias: ast.alias) -> str:
    return alias.name if alias.asname is None else f"{alias.name} as {alias.asname}"


def rewrite_imports(source: str) -> tuple[str, set[str]]:
    """``source`` with the names in OURS imported from notebook_launcher.accelerator.

    Returns the new source and the names actually redirected.
    """
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    redirected: set[str] = set()
    imports = [
        node
        for node in tree.body
        if isinstance(node, ast.ImportFrom)
        and node.module is not None
        and node.module.split(".")[0] == "accelerate"
    ]
    for node in reversed(imports):  # bottom-up, so earlier line numbers stay valid
        ours = [a for a in node.names if a.name in OURS]
        if not ours:
            continue
        theirs = [a for a in node.names if a.name not in OURS]
        new = []
        if theirs:
            new.append(f"from {node.module} import {', '.join(map(_alias, theirs))}\n")
        new.append(f"from notebook_launcher.accelerator import {', '.join(map(_alias, ours))}\n")
        lines[node.lineno - 1 : node.end_lineno] = new
        redirected.update(a.name for a in ours)
    return "".join(lines), redirected


def write_variants(directory: Path) -> dict[tuple[str, str], Path]:
    """{(script, "theirs"|"ours"): path} of the variants, generated from the installed scripts."""
    paths: dict[tuple[str, str], Path] = {}
    for name in SCRIPTS:
        source = installed_script(name).read_text()
        rewritten, _ = rewrite_imports(source)
        for variant, text in (("theirs", source), ("ours", rewritten)):
            path = directory / f"accelerate_{name}_{variant}.py"
            path.write_text(text)
            paths[(name, variant)] = path
    return paths


def cases() -> list[str]:
    """Every case of the two scripts that applies to 2 CPU ranks, as ``script:call``."""
    flags = list(itertools.product([True, False], repeat=3))
    sync = [
        "test_dataloader_break()",
        "test_distributed_sync(Accelerator())",
        "test_distributed_sync_multiple_fwd(Accelerator())",
        *(f"test_gradient_accumulation({s}, {d}, {e})" for s, d, e in flags),
        *(f"test_gradient_accumulation_with_opt_and_scheduler({s}, {d}, {e})" for s, d, e in flags),
    ]
    script = [
        "init_state_check()",
        "process_execution_check()",
        "test_split_between_processes_list()",
        "test_split_between_processes_nested_dict()",
        "test_split_between_processes_tensor()",
        "test_split_between_processes_evenly()",
        "rng_sync_check()",
        "dl_preparation_check()",
        "central_dl_preparation_check()",
        "custom_sampler_check()",
        "check_seedable_sampler()",
        "check_seedable_sampler_with_data_seed()",
        "check_seedable_sampler_in_batch_sampler_shard()",
        "training_check(use_seedable_sampler=False)",
        "training_check(use_seedable_sampler=True)",
        "test_trigger()",
        "test_reinstantiated_state()",
    ]
    return [f"test_sync:{c}" for c in sync] + [f"test_script:{c}" for c in script]


def load(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module


def run_case(path: str, call: str) -> None:
    """In a rank: import the variant and run one case (an exception fails the launch).

    As the scripts' own ``main()`` does, the variant's ``Accelerator()`` is made first.
    Several cases then call accelerate's own helpers (``AcceleratorState()``, ``gather``,
    ``prepare_data_loader``, ``synchronize_rng_states``), which refuse to run until
    accelerate's process-wide state exists, and only accelerate's Accelerator creates it
    (``AcceleratorState()`` raises "Please make sure to properly initialize your
    accelerator"). So both variants also make one accelerate ``Accelerator()`` for those
    helpers; for the "theirs" variant that is the object main() made already. The case
    itself still uses the variant's Accelerator wherever the script names ``Accelerator``.
    """
    import accelerate

    module = load(Path(path))
    namespace = vars(module)
    eval("Accelerator()", namespace)
    accelerate.Accelerator()
    eval(call, namespace)


@dataclasses.dataclass
class Outcome:
    case: str
    variant: str
    passed: bool
    error: str = ""


def run_one(path: Path, call: str, timeout: float = 240) -> Outcome:
    """One case of one variant in a fresh 2-rank launch; a failure is retried once.

    The retry absorbs start-up trouble of a loaded machine (a rank's gloo connection
    refused while the machine is busy): a case only counts as failing when it fails twice.
    """
    import cloudpickle

    from notebook_launcher import notebook_launcher

    # The ranks get run_case by value, whatever the start method (this file is no package).
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    error = ""
    for _ in range(2):
        try:
            notebook_launcher(
                run_case,
                args=(str(path), call),
                num_processes=2,
                hardware="cpu",
                timeout=timeout,
                output="none",
            )
        except Exception as e:
            lines = str(e).strip().splitlines()
            error = _last_error_line(str(e)) or (lines[0] if lines else type(e).__name__)
        else:
            return Outcome(call, path.stem.rsplit("_", 1)[-1], True)
    return Outcome(call, path.stem.rsplit("_", 1)[-1], False, error)


def run_all(directory: Path, timeout: float = 240) -> list[Outcome]:
    """Every case under each variant, each in its own 2-rank launch of notebook_launcher."""
    paths = write_variants(directory)
    outcomes = []
    for case in cases():
        script, call = case.split(":", 1)
        for variant in ("theirs", "ours"):
            outcome = run_one(paths[(script, variant)], call, timeout)
            outcomes.append(dataclasses.replace(outcome, case=case))
    return outcomes


def _last_error_line(text: str) -> str:
    for line in reversed(text.strip().splitlines()):
        if "Error" in line or "assert" in line.lower():
            return line.strip()[:300]
    return ""


def table(outcomes: list[Outcome]) -> str:
    """A Markdown table: one row per case, accelerate's result beside ours."""
    by_case: dict[str, dict[str, Outcome]] = {}
    for o in outcomes:
        by_case.setdefault(o.case, {})[o.variant] = o
    rows = ["| case | accelerate's Accelerator | ours | note |", "|---|---|---|---|"]
    for case, result in by_case.items():
        note = PRIVATE_REASONS.get(case, "")
        for variant in ("theirs", "ours"):
            if variant in result and not result[variant].passed and not note:
                note += f"{variant}: {result[variant].error} "
        theirs, ours = (
            "pass" if v in result and result[v].passed else "FAIL" for v in ("theirs", "ours")
        )
        rows.append(f"| `{case}` | {theirs} | {ours} | {note.strip()} |")
    return "\n".join(rows)


def main(argv: list[str]) -> Any:
    directory = Path(argv[0]) if argv else Path.cwd()
    directory.mkdir(parents=True, exist_ok=True)
    outcomes = run_all(directory)
    print(table(outcomes))
    return outcomes


if __name__ == "__main__":
    main(sys.argv[1:])

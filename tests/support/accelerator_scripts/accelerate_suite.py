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

# Cases accelerate's Accelerator fails on CPU ranks (its join_uneven_inputs only warns
# outside GPUs, so its uneven DDP steps wait forever and its even_batches override is not
# applied) that this core must pass: its join runs over gloo too.
BEYOND_ACCELERATE = frozenset(
    {
        "test_distributed_data_loop:test_can_join_uneven_inputs()",
        "test_distributed_data_loop:test_join_can_override_even_batches()",
        "test_distributed_data_loop:test_join_can_override_for_mixed_type_dataloaders()",
        "test_distributed_data_loop:test_join_raises_warning_for_iterable_when_overriding_even_batches()",
        "test_distributed_data_loop:main()",
    }
)
# Of those, the cases where accelerate's ranks hang (uneven DDP steps): what they would
# show after the full wait, they show after a short one.
THEY_HANG = frozenset(
    {
        "test_distributed_data_loop:test_can_join_uneven_inputs()",
        "test_distributed_data_loop:main()",
    }
)
THEIR_HANG_TIMEOUT = 30.0
# Per script, the names the "ours" variant imports from notebook_launcher.accelerator.
OURS: dict[str, frozenset[str]] = {
    "test_sync": frozenset(
        {
            "Accelerator",
            "DataLoaderConfiguration",
            "GradientAccumulationPlugin",
            "DistributedType",
            "set_seed",
        }
    ),
    "test_script": frozenset(
        {"Accelerator", "DataLoaderConfiguration", "DistributedType", "set_seed"}
    ),
    "test_ops": frozenset(
        {
            "PartialState",
            "DistributedType",
            "DistributedOperationException",
            "broadcast",
            "copy_tensor_to_devices",
            "gather",
            "gather_object",
            "pad_across_processes",
            "reduce",
        }
    ),
    "test_distributed_data_loop": frozenset(
        {"Accelerator", "DataLoaderConfiguration", "DistributedType"}
    ),
}
SCRIPTS = tuple(OURS)
# What each case runs after, as the script's main() does first (statements, in the variant).
SETUP = {
    "test_sync": "Accelerator()",
    "test_script": "Accelerator()",
    "test_ops": "state = PartialState()",
    "test_distributed_data_loop": "accelerator = create_accelerator()",
}

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


def rewrite_imports(source: str, ours: frozenset[str]) -> tuple[str, set[str]]:
    """``source`` with the names in ``ours`` imported from notebook_launcher.accelerator.

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
        redirect = [a for a in node.names if a.name in ours]
        if not redirect:
            continue
        theirs = [a for a in node.names if a.name not in ours]
        new = []
        if theirs:
            new.append(f"from {node.module} import {', '.join(map(_alias, theirs))}\n")
        new.append(
            f"from notebook_launcher.accelerator import {', '.join(map(_alias, redirect))}\n"
        )
        lines[node.lineno - 1 : node.end_lineno] = new
        redirected.update(a.name for a in redirect)
    return "".join(lines), redirected


def write_variants(directory: Path) -> dict[tuple[str, str], Path]:
    """{(script, "theirs"|"ours"): path} of the variants, generated from the installed scripts."""
    paths: dict[tuple[str, str], Path] = {}
    for name in SCRIPTS:
        source = installed_script(name).read_text()
        rewritten, _ = rewrite_imports(source, OURS[name])
        for variant, text in (("theirs", source), ("ours", rewritten)):
            path = directory / f"accelerate_{name}_{variant}.py"
            path.write_text(text)
            paths[(name, variant)] = path
    return paths


DATA_LOOP_LOADERS = {
    "shuffle=False": "DataLoader(DummyDataset(), shuffle=False, batch_size=BATCH_SIZE, num_workers=NUM_WORKERS)",
    "shuffle=True": "DataLoader(DummyDataset(), shuffle=True, batch_size=BATCH_SIZE, num_workers=NUM_WORKERS)",
    "batch_sampler": (
        "DataLoader(DummyDataset(), batch_sampler=BatchSampler(RandomSampler(DummyDataset()), "
        "batch_size=BATCH_SIZE, drop_last=False), num_workers=NUM_WORKERS)"
    ),
    "sampler=BatchSampler": (
        "DataLoader(DummyDataset(), sampler=BatchSampler(RandomSampler(DummyDataset()), "
        "batch_size=BATCH_SIZE, drop_last=False), batch_size=None, collate_fn=default_collate, "
        "num_workers=NUM_WORKERS)"
    ),
}


LABELS = {
    "accelerator.state.distributed_type = DistributedType.FSDP; "
    "test_join_raises_warning_for_non_ddp_distributed(accelerator)": (
        "test_join_raises_warning_for_non_ddp_distributed(FSDP)"
    ),
    **{
        f"torch.manual_seed(accelerator.process_index); test_data_loader({loader}, accelerator)": (
            f"test_data_loader({label})"
        )
        for label, loader in DATA_LOOP_LOADERS.items()
    },
}


def case_id(case: str) -> str:
    """A short test id for a case (long statements get their label)."""
    script, call = case.split(":", 1)
    return f"{script}:{LABELS.get(call, call)}"


def cases() -> list[str]:
    """Every case of the scripts that applies to 2 CPU ranks, as ``script:call``.

    A call is a Python statement run in the variant's namespace after SETUP; ``main()`` runs
    a script's own main() whole.
    """
    flags = list(itertools.product([True, False], repeat=3))
    sync = [
        "test_dataloader_break()",
        "test_distributed_sync(Accelerator())",
        "test_distributed_sync_multiple_fwd(Accelerator())",
        *(f"test_gradient_accumulation({s}, {d}, {e})" for s, d, e in flags),
        *(f"test_gradient_accumulation_with_opt_and_scheduler({s}, {d}, {e})" for s, d, e in flags),
        "main()",
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
    ops = [
        *(
            f"{name}(state)"
            for name in (
                "test_gather",
                "test_gather_object",
                "test_gather_non_contiguous",
                "test_broadcast",
                "test_pad_across_processes",
                "test_reduce_sum",
                "test_reduce_mean",
                "test_reduce_max",
                "test_op_checker",
                "test_copy_tensor_to_devices",
            )
        ),
        "main()",
    ]
    loop = [
        "test_default_ensures_even_batch_sizes()",
        "test_can_disable_even_batches()",
        "test_can_join_uneven_inputs()",
        "test_join_can_override_even_batches()",
        "test_join_can_override_for_mixed_type_dataloaders()",
        "test_join_raises_warning_for_iterable_when_overriding_even_batches()",
        "accelerator.state.distributed_type = DistributedType.FSDP; "
        "test_join_raises_warning_for_non_ddp_distributed(accelerator)",
        "test_pickle_accelerator()",
        *(
            f"torch.manual_seed(accelerator.process_index); test_data_loader({loader}, accelerator)"
            for loader in DATA_LOOP_LOADERS.values()
        ),
        "test_stateful_dataloader(accelerator)",
        "test_stateful_dataloader_save_state(accelerator)",
        "main()",
    ]
    return (
        [f"test_sync:{c}" for c in sync]
        + [f"test_script:{c}" for c in script]
        + [f"test_ops:{c}" for c in ops]
        + [f"test_distributed_data_loop:{c}" for c in loop]
    )


def load(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module


def run_case(path: str, call: str, setup: str = "Accelerator()") -> None:
    """In a rank: import the variant and run one case (an exception fails the launch).

    As the scripts' own ``main()`` does, the variant's ``setup`` (its ``Accelerator()`` or
    ``PartialState()``) runs first. Several cases then call accelerate's own helpers
    (``AcceleratorState()``, ``gather``, ``prepare_data_loader``, ``synchronize_rng_states``),
    which refuse to run until accelerate's process-wide state exists, and only accelerate's
    Accelerator creates it (``AcceleratorState()`` raises "Please make sure to properly
    initialize your accelerator"). So both variants also make one accelerate
    ``Accelerator()`` for those helpers; for the "theirs" variant that is the object main()
    made already. The case itself still uses the variant's names wherever the script does.
    """
    import accelerate

    module = load(Path(path))
    namespace = vars(module)
    exec(setup, namespace)
    accelerate.Accelerator()
    exec(call, namespace)


@dataclasses.dataclass
class Outcome:
    case: str
    variant: str
    passed: bool
    error: str = ""


def run_one(path: Path, call: str, timeout: float = 150, setup: str = "Accelerator()") -> Outcome:
    """One case of one variant in a fresh 2-rank launch; a failure is retried once.

    The retry absorbs start-up trouble of a loaded machine (a rank's gloo connection
    refused while the machine is busy): a case only counts as failing when it fails twice.
    A case that runs past ``timeout`` (accelerate's join_uneven_inputs does nothing on CPU
    ranks, so its DDP steps wait forever) is not tried again.
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
                args=(str(path), call, setup),
                num_processes=2,
                hardware="cpu",
                timeout=timeout,
                output="none",
            )
        except Exception as e:
            lines = str(e).strip().splitlines()
            error = _last_error_line(str(e)) or (lines[0] if lines else type(e).__name__)
            if isinstance(e, TimeoutError):
                break  # a case that hangs hangs again: no second try
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
            outcome = run_one(paths[(script, variant)], call, timeout, SETUP[script])
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

"""Collectives and rank state on 2 real CPU ranks started by notebook_launcher.

What a user gets back from gather, reduce, gather_object and pad_across_processes when
ranks pass values that cannot be combined, accelerate's debug mode, and accelerate's own
``PartialState`` made inside a rank.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from notebook_launcher import notebook_launcher
from notebook_launcher.accelerator import DistributedOperationException
from tests.support.accelerator import plain_process  # noqa: F401

pytestmark = pytest.mark.usefixtures("plain_process")


def on_two_ranks(function: Any, *args: Any, **kwargs: Any) -> Any:
    return notebook_launcher(
        function,
        args=args,
        num_processes=2,
        hardware="cpu",
        output="none",
        return_all=True,
        **kwargs,
    )


def reduce_a_python_number() -> Any:
    from notebook_launcher.accelerator import Accelerator

    acc = Accelerator()
    return acc.reduce(torch.tensor(float(acc.process_index + 1)).item())


def gather_a_python_number() -> Any:
    from notebook_launcher.accelerator import Accelerator

    acc = Accelerator()
    return acc.gather(acc.process_index)


def gather_a_dict_with_a_number() -> Any:
    from notebook_launcher.accelerator import Accelerator

    acc = Accelerator()
    return acc.gather({"t": torch.ones(2), "n": acc.process_index})


def test_reduce_of_a_python_number_raises_instead_of_returning_the_ranks_own_value() -> None:
    with pytest.raises(
        TypeError, match=r"reduce takes tensors.*type float \(1\.0\)|type float \(2\.0\)"
    ):
        on_two_ranks(reduce_a_python_number)


def test_gather_of_a_python_number_raises_instead_of_returning_the_rank() -> None:
    with pytest.raises(TypeError, match=r"gather takes tensors.*type int \([01]\).*torch\.tensor"):
        on_two_ranks(gather_a_python_number)


def test_gather_of_a_dict_names_the_entry_that_is_not_a_tensor() -> None:
    with pytest.raises(TypeError, match=r"gather takes tensors.*type int \([01]\) at \['n'\]"):
        on_two_ranks(gather_a_dict_with_a_number)


def gather_objects() -> dict[str, Any]:
    from notebook_launcher.accelerator import Accelerator, operations

    acc = Accelerator()
    r = acc.process_index
    results: dict[str, Any] = {
        "tuple": operations.gather_object((r, "x")),
        "list": operations.gather_object([r]),
        "for_metrics": acc.gather_for_metrics(f"rank{r}", use_gather_object=True),
    }
    for name, value in (("dict", {"r": r}), ("int", r), ("str", "ab")):
        try:
            operations.gather_object(value)
        except TypeError as e:
            results[name] = str(e)
    return results


def test_gather_object_concatenates_tuples_as_accelerate_and_refuses_what_it_would_iterate() -> (
    None
):
    results = on_two_ranks(gather_objects)
    for got in results:
        assert got["tuple"] == [0, "x", 1, "x"]
        assert got["list"] == [0, 1]
        assert got["for_metrics"] == ["rank0", "rank1"]
        for name, kind in (("dict", "dict"), ("int", "int"), ("str", "str")):
            assert (
                "gather_object takes a list or tuple of picklable objects on each rank" in got[name]
            )
            assert f"value of type {kind}" in got[name]
            assert "gather_object([obj])" in got[name]


def pad_different_ranks(debug: str) -> None:
    from notebook_launcher.accelerator import Accelerator

    os.environ["ACCELERATE_DEBUG_MODE"] = debug
    acc = Accelerator()
    shape = (1, 5) if acc.process_index == 0 else (1, 1, 6)
    acc.pad_across_processes({"tensor": torch.zeros(shape)}, dim=0)


@pytest.mark.parametrize("debug", ["1", "0"])
def test_pad_across_processes_with_ranks_of_other_dimensions_raises_naming_each_shape(
    debug: str,
) -> None:
    with pytest.raises(
        DistributedOperationException,
        match=r"pad_across_processes needs tensors with the same number of dimensions on every "
        r"rank, but the ranks passed tensors of shapes rank 0: \[1, 5\]; rank 1: \[1, 1, 6\]",
    ) as caught:
        on_two_ranks(pad_different_ranks, debug)
    # The rank raised; it was not killed by the backend.
    failures = caught.value.failures  # type: ignore[attr-defined]
    assert all(f.signal_name is None for f in failures)
    assert {f.exception_type for f in failures} <= {
        "notebook_launcher.errors.DistributedOperationException"
    }


def debug_mode_checks() -> dict[str, Any]:
    from notebook_launcher.accelerator import Accelerator

    acc = Accelerator()
    results: dict[str, Any] = {"from_env": acc.state.debug}
    acc.state.debug = True
    if acc.process_index == 0:
        data = {"tensor": torch.zeros(1, 5)}
    else:
        data = {"tensor": torch.zeros(1, 2, 5)}
    for name in ("reduce", "broadcast", "gather"):
        try:
            getattr(acc, name)(data) if name != "broadcast" else _broadcast(data)
        except DistributedOperationException as e:
            results[name] = str(e)
    acc.state.debug = False
    results["off_again"] = acc.state.debug
    return results


def _broadcast(data: Any) -> Any:
    from notebook_launcher.accelerator import operations

    return operations.broadcast(data)


def test_debug_mode_from_the_environment_checks_shapes_before_reduce_and_broadcast() -> None:
    results = on_two_ranks(debug_mode_checks)
    os.environ.pop("ACCELERATE_DEBUG_MODE", None)
    for got in results:
        assert got["from_env"] is False
        assert got["off_again"] is False
        for name in ("reduce", "broadcast", "gather"):
            assert got[name].startswith(f"{name} needs tensors of the same shape and dtype")
            assert "rank 0: [1, 5]; rank 1: [1, 2, 5]" in got[name]


def debug_from_environment() -> bool:
    from notebook_launcher.accelerator import Accelerator

    return Accelerator().state.debug


def test_accelerate_debug_mode_variable_is_read_by_the_state() -> None:
    os.environ["ACCELERATE_DEBUG_MODE"] = "1"
    try:
        assert on_two_ranks(debug_from_environment) == [True, True]
    finally:
        del os.environ["ACCELERATE_DEBUG_MODE"]


def destroy_the_group() -> list[bool]:
    import torch.distributed as dist

    from notebook_launcher.accelerator import Accelerator, PartialState

    acc = Accelerator()
    seen = [dist.is_initialized()]
    acc.state.destroy_process_group()
    seen.append(dist.is_initialized())
    PartialState.destroy_process_group(acc.state)  # a second call is harmless
    return seen


def test_state_destroy_process_group_leaves_the_group() -> None:
    assert on_two_ranks(destroy_the_group) == [[True, False], [True, False]]


def accelerates_own_state() -> dict[str, Any]:
    from accelerate import Accelerator as HFAccelerator
    from accelerate import PartialState as HFPartialState
    from torch.utils.data import DataLoader

    state = HFPartialState()
    hf = HFAccelerator()
    loader = hf.prepare(DataLoader(list(range(8)), batch_size=2))
    return {
        "partial": (state.num_processes, state.process_index, state.distributed_type.value),
        "accelerator": (hf.num_processes, hf.process_index),
        "samples": [int(x) for batch in loader for x in batch],
    }


def test_accelerates_bare_partial_state_in_a_cpu_rank_sees_every_rank() -> None:
    pytest.importorskip("accelerate")
    results = on_two_ranks(accelerates_own_state)
    for rank, got in enumerate(results):
        assert got["partial"] == (2, rank, "MULTI_CPU")
        assert got["accelerator"] == (2, rank)
    # Each rank trains on its own half of the data, not the whole of it.
    assert sorted(results[0]["samples"] + results[1]["samples"]) == list(range(8))


def accelerate_state_after_import_in_kernel() -> tuple[int, str]:
    from accelerate import PartialState as HFPartialState

    state = HFPartialState()
    return state.num_processes, state.distributed_type.value


def test_accelerate_imported_in_the_kernel_before_a_fork_launch_also_sees_every_rank() -> None:
    pytest.importorskip("accelerate")
    import accelerate.state

    before = accelerate.state.PartialState.__init__
    results = on_two_ranks(accelerate_state_after_import_in_kernel, start_method="fork")
    assert results == [(2, "MULTI_CPU"), (2, "MULTI_CPU")]
    # The kernel's own accelerate is untouched.
    assert accelerate.state.PartialState.__init__ is before

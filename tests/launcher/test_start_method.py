from __future__ import annotations

import pytest

from notebook_launcher.errors import LaunchConfigError
from notebook_launcher.launcher.start_method import KernelState, choose_start_method

CLEAN = KernelState(
    fork_available=True,
    forkserver_available=True,
    cuda_initialized=False,
    process_group_initialized=False,
)


def state(**changes) -> KernelState:
    import dataclasses

    return dataclasses.replace(CLEAN, **changes)


def test_auto_forks_a_clean_linux_kernel():
    choice = choose_start_method("auto", CLEAN)
    assert choice.method == "fork"
    assert choice.fallback_reason is None


def test_auto_uses_the_forkserver_after_cuda_was_initialised_and_says_why():
    choice = choose_start_method("auto", state(cuda_initialized=True))
    assert choice.method == "forkserver"
    assert "CUDA was initialised in this kernel" in choice.fallback_reason


def test_auto_uses_the_forkserver_when_a_process_group_lives_in_the_kernel():
    choice = choose_start_method("auto", state(process_group_initialized=True))
    assert choice.method == "forkserver"
    assert "process group is initialised in this kernel" in choice.fallback_reason


def test_auto_uses_the_forkserver_where_fork_is_unsafe():
    choice = choose_start_method("auto", state(fork_available=False))
    assert choice.method == "forkserver"
    assert "fork is not safe on this platform" in choice.fallback_reason


def test_auto_spawns_where_there_is_neither_fork_nor_forkserver():
    choice = choose_start_method("auto", state(fork_available=False, forkserver_available=False))
    assert choice.method == "spawn"


@pytest.mark.parametrize("method", ["fork", "forkserver", "spawn"])
def test_an_explicit_safe_choice_is_kept(method):
    assert choose_start_method(method, CLEAN).method == method


def test_explicit_fork_after_cuda_init_is_refused_with_the_way_out():
    with pytest.raises(
        LaunchConfigError,
        match=r"start_method='fork' cannot be used: CUDA was initialised in this kernel.*"
        r"Use start_method='auto' or 'forkserver'.*no kernel restart is needed",
    ):
        choose_start_method("fork", state(cuda_initialized=True))


def test_forkserver_is_refused_where_the_platform_has_none():
    with pytest.raises(LaunchConfigError, match=r"start_method='forkserver' is not available"):
        choose_start_method("forkserver", state(forkserver_available=False))


def test_an_unknown_start_method_is_named():
    with pytest.raises(
        LaunchConfigError, match=r"start_method='thread' is not a start method; use one of 'auto'"
    ):
        choose_start_method("thread", CLEAN)


def test_detect_reads_this_process():
    detected = KernelState.detect()
    assert detected.fork_available
    assert not detected.cuda_initialized

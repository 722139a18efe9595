"""notebook_launcher(train) on faked TPU machines: torch_xla's multiprocessing (the fake one,
standing in for the chips) starts the ranks; the launcher's own code runs for real."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from notebook_launcher import (
    LaunchConfigError,
    LaunchTimeoutError,
    RankFailedError,
    notebook_launcher,
)
from notebook_launcher.errors import LaunchUnsupportedError
from notebook_launcher.launcher.events import OutputLine
from tests.support.tpu import faked_tpu


@pytest.fixture
def tpu_machine(request, monkeypatch):
    """A faked TPU runtime (indirect parameter: its name), with the fake torch_xla installed."""
    with faked_tpu(monkeypatch, request.param) as machine:
        yield machine


def where_am_i(tag):
    import torch_xla.runtime as xr

    ordinal = xr.global_ordinal()
    print(f"python print {ordinal}")
    os.write(1, f"raw fd write {ordinal}\n".encode())
    return {
        "tag": tag,
        "ordinal": ordinal,
        "world": xr.world_size(),
        "pid": os.getpid(),
        "RANK": os.environ["RANK"],
        "addresses": os.environ.get("TPU_PROCESS_ADDRESSES"),
    }


@pytest.mark.parametrize("tpu_machine", ["kaggle-v5e-8"], indirect=True)
def test_kaggles_v5e_8_runs_the_function_in_8_processes_with_prefixed_output(
    tpu_machine, capfd, leak_check
):
    values = notebook_launcher(where_am_i, args=("hi",), return_all=True)
    assert [v["ordinal"] for v in values] == list(range(8))
    assert {v["world"] for v in values} == {8} and len({v["pid"] for v in values}) == 8
    assert [v["RANK"] for v in values] == [str(r) for r in range(8)]
    # Kaggle's preset one-process address was dropped, so torch_xla set up all 8.
    assert {len(v["addresses"].split(",")) for v in values} == {8}
    out, _ = capfd.readouterr()
    for rank in range(8):
        assert f"[rank{rank}]: python print {rank}\n" in out
        assert f"[rank{rank}]: raw fd write {rank}\n" in out


@pytest.mark.parametrize("tpu_machine", ["colab-v6e-1"], indirect=True)
def test_a_single_chip_runs_one_rank_and_returns_its_value(tpu_machine, leak_check):
    value = notebook_launcher(where_am_i, args=("one",))
    assert (value["tag"], value["ordinal"], value["world"]) == ("one", 0, 1)


@pytest.mark.parametrize("tpu_machine", ["tpu-vm-v4-8"], indirect=True)
def test_num_processes_1_runs_one_process_as_torch_xla_allows(tpu_machine, leak_check):
    assert (
        notebook_launcher(where_am_i, args=("x",), num_processes=1, return_all=True)[0]["world"]
        == 1
    )


@pytest.mark.parametrize("tpu_machine", ["kaggle-v5e-8"], indirect=True)
def test_a_process_count_torch_xla_cannot_start_is_refused_with_the_reason(tpu_machine, leak_check):
    with pytest.raises(
        LaunchConfigError,
        match=(
            r"num_processes=3 cannot run on this TPU: torch_xla starts either one process per chip, "
            r"all 8 of them, or a single process.*Use num_processes=8, or 1"
        ),
    ):
        notebook_launcher(where_am_i, args=("x",), num_processes=3)


@pytest.mark.parametrize("tpu_machine", ["kaggle-v3-8"], indirect=True)
def test_v3_chips_run_two_replicas_per_rank_and_each_rank_returns_its_first(
    tpu_machine, leak_check
):
    values = notebook_launcher(where_am_i, args=("v3",), return_all=True)
    assert [v["ordinal"] for v in values] == [0, 2, 4, 6] and {v["world"] for v in values} == {8}


@pytest.mark.parametrize("precision", ["fp16", "fp8"])
@pytest.mark.parametrize("tpu_machine", ["colab-v5e-1"], indirect=True)
def test_fp16_and_fp8_are_refused_on_tpu_with_the_reason(tpu_machine, precision, leak_check):
    reasons = {
        "fp16": r"fp16 is not supported on TPU; use bf16 \(TPU cores compute in bfloat16",
        "fp8": r"fp8 needs a Hopper-class NVIDIA GPU .* this machine has TPU cores, whose "
        r"reduced precision is bf16",
    }
    with pytest.raises(LaunchConfigError, match=reasons[precision]):
        notebook_launcher(where_am_i, args=("x",), mixed_precision=precision)


def fail_on(bad):
    import torch_xla.runtime as xr

    if xr.global_ordinal() == bad:
        raise ValueError(f"shard {bad} is corrupt")
    time.sleep(120)


@pytest.mark.parametrize("tpu_machine", ["tpu-vm-v4-8"], indirect=True)
def test_a_failing_rank_is_named_with_its_traceback_and_type_and_the_others_stop(
    tpu_machine, leak_check
):
    with pytest.raises(RankFailedError) as caught:
        notebook_launcher(fail_on, args=(2,))
    error = caught.value
    assert isinstance(error, ValueError)
    assert str(error).startswith("Rank 2 (pid ")
    assert "raised ValueError: shard 2 is corrupt. The other ranks were stopped.\n\n" in str(error)
    assert "Traceback from rank 2:" in str(error) and "in fail_on" in str(error)
    assert [(f.rank, f.exitcode) for f in error.failures] == [(2, 1)]


@pytest.mark.parametrize("tpu_machine", ["kaggle-v3-8"], indirect=True)
def test_a_failure_in_the_second_replica_of_a_v3_process_fails_its_rank(tpu_machine, leak_check):
    with pytest.raises(
        RankFailedError, match=r"^Rank 1 \(pid \d+\) raised ValueError: shard 3 is corrupt"
    ):
        notebook_launcher(fail_on, args=(3,))


def sleep_forever():
    print("waiting", flush=True)
    time.sleep(600)


@pytest.mark.parametrize("tpu_machine", ["tpu-vm-v4-8"], indirect=True)
def test_a_hung_tpu_launch_ends_at_its_timeout(tpu_machine, leak_check):
    with pytest.raises(
        LaunchTimeoutError, match=r"ran past timeout=3s; rank\(s\) 0, 1, 2, 3 were still running"
    ):
        notebook_launcher(sleep_forever, timeout=3)


class InterruptWhenAllWait:
    """Presses the stop button (SIGINT to the calling thread) once every rank says it waits."""

    def __init__(self, ranks: int) -> None:
        self.ranks, self.waiting = ranks, set()
        self.main = threading.get_ident()

    def on_event(self, event):
        if isinstance(event, OutputLine) and event.text == "waiting":
            self.waiting.add(event.rank)
            if len(self.waiting) == self.ranks:
                signal.pthread_kill(self.main, signal.SIGINT)


@pytest.mark.parametrize("tpu_machine", ["tpu-vm-v4-8"], indirect=True)
def test_an_interrupt_stops_every_tpu_rank(tpu_machine, leak_check):
    pressed = InterruptWhenAllWait(4)
    with pytest.raises(KeyboardInterrupt):
        notebook_launcher(sleep_forever, observers=[pressed])
    assert pressed.waiting == {0, 1, 2, 3}


@pytest.mark.parametrize("tpu_machine", ["colab-v5e-1"], indirect=True)
def test_xla_used_in_the_kernel_is_refused_before_anything_starts(tpu_machine, leak_check):
    import torch_xla

    torch_xla.device()  # a cell that touched the XLA device
    with pytest.raises(
        LaunchConfigError,
        match=(
            r"torch_xla's runtime is already running in this kernel: a cell that used an XLA device "
            r"\(torch_xla.device\(\).*Restart the kernel, then use XLA devices .* only inside the "
            r"launched function"
        ),
    ):
        notebook_launcher(where_am_i, args=("x",))


@pytest.mark.parametrize("tpu_machine", ["colab-v5e-1"], indirect=True)
def test_an_accelerator_made_in_the_kernel_is_named_as_what_started_xla(tpu_machine, leak_check):
    from notebook_launcher import Accelerator

    Accelerator()
    with pytest.raises(
        LaunchConfigError,
        match=(
            r"already running in this kernel: an Accelerator\(\) created in this process \(outside a "
            r"launch\) started it"
        ),
    ):
        notebook_launcher(where_am_i, args=("x",))


@pytest.mark.parametrize("tpu_machine", ["colab-v5e-1+no-torch-xla"], indirect=True)
def test_a_tpu_without_torch_xla_is_refused_with_how_to_install_it(tpu_machine, leak_check):
    with pytest.raises(
        LaunchUnsupportedError, match=r"this machine has a TPU but torch_xla is not installed"
    ):
        notebook_launcher(where_am_i, args=("x",))


@pytest.mark.parametrize("tpu_machine", ["colab-v5e-1"], indirect=True)
def test_a_start_method_other_than_fork_is_refused_on_tpu(tpu_machine, leak_check):
    with pytest.raises(
        LaunchConfigError,
        match=r"TPU ranks are forked from this kernel by torch_xla.*"
        r"start_method='spawn' was asked for",
    ):
        notebook_launcher(where_am_i, args=("x",), start_method="spawn")


def train_with_the_core():
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from notebook_launcher import Accelerator

    acc = Accelerator()
    data = TensorDataset(torch.arange(16.0).reshape(8, 2), torch.ones(8, 1))
    model = torch.nn.Linear(2, 1)
    model, opt, loader = acc.prepare(
        model, torch.optim.SGD(model.parameters(), lr=0.01), DataLoader(data, batch_size=2)
    )
    for x, y in loader:
        loss = torch.nn.functional.mse_loss(model(x), y)
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
    acc.wait_for_everyone()
    weights = acc.gather(model.weight.detach())
    return acc.distributed_type.value, acc.mixed_precision, acc.num_processes, weights


@pytest.mark.parametrize("tpu_machine", ["tpu-vm-v4-8"], indirect=True)
def test_the_core_trains_on_every_tpu_rank_in_bf16(tpu_machine, leak_check):
    kind, precision, world, weights = notebook_launcher(train_with_the_core, mixed_precision="bf16")
    assert (kind, precision, world) == ("XLA", "bf16", 4)
    # Gradients were averaged across the ranks: every rank holds the same weights.
    assert all(bool((w == weights[0]).all()) for w in weights)


def crash_on(bad):
    import ctypes

    import torch_xla.runtime as xr

    if xr.global_ordinal() == bad:
        print("about to crash", flush=True)
        ctypes.string_at(0)  # a segfault, as a broken native library would cause
    time.sleep(120)


@pytest.mark.parametrize("tpu_machine", ["tpu-vm-v4-8"], indirect=True)
def test_a_crashed_tpu_rank_is_reported_with_its_signal_and_last_output(tpu_machine, leak_check):
    with pytest.raises(
        RankFailedError, match=r"^Rank 1 \(pid \d+\) was killed by SIGSEGV \(segmentation fault\)"
    ) as caught:
        notebook_launcher(crash_on, args=(1,))
    assert "Fatal Python error: Segmentation fault" in str(caught.value)
    assert [f.rank for f in caught.value.failures] == [1]


@pytest.mark.parametrize("tpu_machine", ["tpu-vm-v4-32"], indirect=True)
def test_one_host_of_a_multi_host_slice_is_refused_with_the_reason(tpu_machine, leak_check):
    with pytest.raises(
        LaunchUnsupportedError,
        match=(
            r"this machine is one of 4 hosts of a TPU v4-32 slice \(TPU_ACCELERATOR_TYPE=v4-32\), and "
            r"torch_xla's runtime waits until the processes of every host have joined"
        ),
    ):
        notebook_launcher(where_am_i, args=("x",))


@pytest.mark.parametrize("tpu_machine", ["tpu-vm-v4-8"], indirect=True)
def test_a_slice_named_by_its_worker_hostnames_is_refused_too(tpu_machine, leak_check):
    with (
        pytest.MonkeyPatch.context() as patch,
        pytest.raises(
            LaunchUnsupportedError,
            match=(
                r"this machine is one of 2 hosts of a TPU v4-8 slice \(TPU_WORKER_HOSTNAMES lists 2 hosts\)"
            ),
        ),
    ):
        patch.setenv("TPU_WORKER_HOSTNAMES", "a,b")
        notebook_launcher(where_am_i, args=("x",))


@pytest.mark.parametrize("tpu_machine", ["tpu-vm-v4-8"], indirect=True)
def test_a_slice_named_by_its_host_bounds_is_refused_too(tpu_machine, leak_check):
    with (
        pytest.MonkeyPatch.context() as patch,
        pytest.raises(LaunchUnsupportedError, match=r"one of 2 hosts .*\(TPU_HOST_BOUNDS=1,2,1\)"),
    ):
        patch.setenv("TPU_HOST_BOUNDS", "1,2,1")
        notebook_launcher(where_am_i, args=("x",))


@pytest.fixture
def metadata_server(monkeypatch):
    """A stand-in for the TPU VM's metadata server on loopback, listing two workers."""
    import http.server

    asked: list[tuple[str, str | None]] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            asked.append((self.path, self.headers.get("Metadata-Flavor")))
            body = b"t1v-n-0:uid0:10.0.0.2,t1v-n-1:uid1:10.0.0.3"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setenv("GCE_METADATA_HOST", f"127.0.0.1:{server.server_port}")
    yield asked
    server.shutdown()
    server.server_close()
    thread.join()


@pytest.mark.parametrize("tpu_machine", ["tpu-vm-v4-8"], indirect=True)
def test_a_slice_the_vms_metadata_lists_several_workers_of_is_refused_too(
    metadata_server, tpu_machine, leak_check
):
    with pytest.raises(
        LaunchUnsupportedError,
        match=(r"one of 2 hosts of a TPU v4-8 slice \(the VM's metadata lists 2 workers\)"),
    ):
        notebook_launcher(where_am_i, args=("x",))
    assert metadata_server == [
        ("/computeMetadata/v1/instance/attributes/worker-network-endpoints", "Google")
    ]

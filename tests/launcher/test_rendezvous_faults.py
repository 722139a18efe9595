"""Where machines meet, tried as users and strangers meet it: busy ports, absent peers,
peers with other settings, and a stranger process on loopback reading and writing the
stores. Machines are separate processes on loopback."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest

from notebook_launcher import LaunchConfigError, notebook_launcher
from notebook_launcher.errors import LaunchTimeoutError
from notebook_launcher.launcher.rendezvous import RendezvousError, RendezvousTimeoutError
from tests.launcher.test_multinode import tagged
from tests.support.ports import free_port

ROOT = Path(__file__).resolve().parents[2]


def work():
    return int(os.environ["RANK"])


@pytest.fixture
def held_port():
    """A port some other program listens on (and never answers)."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        yield holder.getsockname()[1]


@pytest.mark.parametrize("num_nodes", [1, 2])
def test_a_busy_endpoint_port_fails_at_once_naming_rdzv_endpoint(held_port, num_nodes, leak_check):
    endpoint = f"127.0.0.1:{held_port}"
    with pytest.raises(LaunchConfigError) as raised:
        notebook_launcher(
            work, num_processes=1, num_nodes=num_nodes, timeout=600, rdzv_endpoint=endpoint
        )
    message = str(raised.value)
    assert message.startswith(
        f"rdzv_endpoint='{endpoint}': port {held_port} on 127.0.0.1 is already in use"
    )
    assert "use_port" not in message


def test_c10d_at_a_port_held_by_another_program_says_it_is_no_store(held_port, leak_check):
    with pytest.raises(
        RendezvousError,
        match=r"the program listening on 127\.0\.0\.1:\d+ is not a rendezvous store",
    ):
        notebook_launcher(
            work,
            num_processes=1,
            rdzv_backend="c10d",
            timeout=600,
            rdzv_endpoint=f"127.0.0.1:{held_port}",
        )


def test_timeout_bounds_the_wait_for_an_absent_rendezvous_store(capfd, leak_check):
    endpoint = f"127.0.0.1:{free_port()}"
    with pytest.raises(
        LaunchTimeoutError,
        match=rf"node_rank=1 could not reach the rendezvous store at {endpoint} within timeout=3s \(the launch's limit, rendezvous included\)",
    ):
        notebook_launcher(
            work, num_processes=1, num_nodes=2, node_rank=1, rdzv_endpoint=endpoint, timeout=3
        )
    err = capfd.readouterr().err
    # Said in words while it waits, without torch's C++ stack traces for every try.
    assert (
        f"node_rank=1 waits for the rendezvous store at {endpoint} (nothing listens there yet; node_rank=0 hosts it)"
        in err
    )
    assert "frame #" not in err and "TCPStore.cpp" not in err


@pytest.fixture
def store_that_vanishes():
    """A port that answers the launcher's probe as torch's store does, once, then closes."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)

    def answer_once_then_close():
        with listener, listener.accept()[0] as connection:
            asked = b""
            while len(asked) < 10:  # the store's magic number, a ping and its nonce
                asked += connection.recv(10 - len(asked))
            connection.sendall(asked[6:])

    answering = threading.Thread(target=answer_once_then_close, daemon=True)
    answering.start()
    yield listener.getsockname()[1]
    answering.join(timeout=60)


def test_a_store_that_closes_after_answering_is_waited_for_not_called_closing(
    leak_check, store_that_vanishes
):
    endpoint = f"127.0.0.1:{store_that_vanishes}"
    with pytest.raises(RendezvousTimeoutError) as raised:
        notebook_launcher(
            work,
            num_processes=1,
            num_nodes=2,
            node_rank=1,
            rdzv_endpoint=endpoint,
            rdzv_conf={"join_timeout": 5},
        )
    assert f"could not reach the rendezvous store at {endpoint} within join_timeout=5s" in str(
        raised.value
    )
    # The store was gone, not closing: the connect gave up with the probe, not at join_timeout.
    assert "it is closing" not in str(raised.value)


@pytest.fixture
def store_that_closes_after_the_connect():
    """A port that answers the probe and torch's client handshake as a store does, then
    closes at the first question: the previous launch's store, released just then."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(2)
    asked_after_the_handshake = threading.Event()

    def handshake(connection: socket.socket) -> None:
        asked = b""
        while len(asked) < 10:  # the store's magic number, a ping and its nonce
            asked += connection.recv(10 - len(asked))
        connection.sendall(asked[6:])

    def answer_then_close():
        with listener:
            with listener.accept()[0] as probe:
                handshake(probe)
            with listener.accept()[0] as client:
                handshake(client)
                if client.recv(1):  # the question; the answer never comes
                    asked_after_the_handshake.set()

    answering = threading.Thread(target=answer_then_close, daemon=True)
    answering.start()
    yield listener.getsockname()[1], asked_after_the_handshake
    answering.join(timeout=60)


def test_a_store_that_closes_after_the_connect_is_waited_for(
    leak_check, store_that_closes_after_the_connect
):
    port, asked = store_that_closes_after_the_connect
    endpoint = f"127.0.0.1:{port}"
    with pytest.raises(RendezvousTimeoutError) as raised:
        notebook_launcher(
            work,
            num_processes=1,
            num_nodes=2,
            node_rank=1,
            rdzv_endpoint=endpoint,
            rdzv_conf={"join_timeout": 5},
        )
    assert asked.is_set()  # the launcher did connect, and its first question found the store gone
    assert str(raised.value).startswith(
        f"node_rank=1 could not reach the rendezvous store at {endpoint} within join_timeout=5s"
    )


def test_static_node_0_says_what_it_waits_for_and_honours_join_timeout(capfd, leak_check):
    endpoint = f"127.0.0.1:{free_port()}"
    with pytest.raises(RendezvousTimeoutError) as raised:
        notebook_launcher(
            work,
            num_processes=2,
            num_nodes=2,
            node_rank=0,
            rdzv_endpoint=endpoint,
            rdzv_conf={"join_timeout": 3},
            rdzv_id="job3",
        )
    assert str(raised.value) == (
        f"node_rank=0: 1 of num_nodes=2 machines joined the rendezvous at {endpoint} (rdzv_id='job3') "
        f"within join_timeout=3s: joined node_rank=0 ({socket.gethostname()}, pid {os.getpid()}); "
        "node_rank 1 did not. Start the launch on the missing machine(s) with the same "
        f"rdzv_endpoint and rdzv_id, and check that they reach {endpoint}."
    )
    err = capfd.readouterr().err
    assert (
        f"notebook_launcher: node_rank=0 waits for node_rank 1 at {endpoint} (1 of 2 machines joined)"
        in err
    )
    # Its ranks never started, and the table says so (this machine's ranks: 0 and 1).
    assert "0     not started" in err and "1     not started" in err


def test_a_c10d_timeout_is_a_launch_error_naming_who_joined(leak_check):
    endpoint = f"127.0.0.1:{free_port()}"
    with pytest.raises(RendezvousTimeoutError) as raised:
        notebook_launcher(
            work,
            num_processes=1,
            num_nodes=2,
            rdzv_backend="c10d",
            rdzv_endpoint=endpoint,
            rdzv_conf={"join_timeout": 3},
            rdzv_id="job4",
        )
    message = str(raised.value)
    assert message.startswith(
        f"node_rank=0: the c10d rendezvous at {endpoint} (rdzv_id='job4') did not complete within "
        "join_timeout=3s (RendezvousTimeoutError): 1 of num_nodes=2 machines joined: "
        f"node_rank=0 ({socket.gethostname()}, pid {os.getpid()})."
    )
    assert "rdzv_backend='c10d', the same rdzv_endpoint, rdzv_id and num_nodes" in message


NODE = """
import json, sys
from notebook_launcher import notebook_launcher

node_rank, endpoint, backend, nproc, precision, name = (
    int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5], sys.argv[6])

def train():
    import torch.distributed as dist
    dist.init_process_group("gloo")
    dist.barrier()
    return dist.get_world_size()

def evaluate():
    return 0

try:
    value = notebook_launcher({"train": train, "evaluate": evaluate}[name], num_processes=nproc,
                              num_nodes=2, node_rank=node_rank, rdzv_backend=backend,
                              rdzv_endpoint=endpoint, rdzv_id="mixed", mixed_precision=precision,
                              rdzv_conf={"join_timeout": 120}, timeout=240)
    print("RESULT " + json.dumps(value))
except Exception as error:
    print("ERROR " + json.dumps({"type": type(error).__name__, "text": str(error)}))
"""


def run_nodes(tmp_path: Path, *settings: tuple[str, ...], backend: str = "static") -> list[dict]:
    script = tmp_path / "node.py"
    script.write_text(textwrap.dedent(NODE))
    endpoint = f"127.0.0.1:{free_port()}"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    nodes = [
        subprocess.Popen(
            [sys.executable, str(script), str(node_rank), endpoint, backend, *values],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=tmp_path,
        )
        for node_rank, values in enumerate(settings)
    ]
    outputs = []
    try:
        for node in nodes:
            stdout, stderr = node.communicate(timeout=280)
            outputs.append(subprocess.CompletedProcess(node.args, node.returncode, stdout, stderr))
    finally:
        for node in nodes:
            node.kill()
            node.wait()
    return [tagged(out, "ERROR", outputs) for out in outputs]


@pytest.mark.slow(reason="two machines (processes) meet at a rendezvous, per case")
@pytest.mark.parametrize(
    ("first", "second", "what"),
    [
        (("2", "no", "train"), ("1", "no", "train"), "num_processes=2.*num_processes=1"),
        (
            ("1", "bf16", "train"),
            ("1", "no", "train"),
            "mixed_precision='bf16'.*mixed_precision='no'",
        ),
        (
            ("1", "no", "train"),
            ("1", "no", "evaluate"),
            "function='__main__.train'.*function='__main__.evaluate'",
        ),
    ],
)
def test_machines_that_disagree_are_refused_at_the_rendezvous_naming_both_values(
    tmp_path, first, second, what
):
    errors = run_nodes(tmp_path, first, second)
    name = what.split("=")[0]
    for error in errors:
        assert error["type"] == "RendezvousError"
        assert f"the machines of rdzv_id='mixed' disagree on {name}: node_rank=0 (" in error["text"]
        assert __import__("re").search(what, error["text"]), error["text"]
        assert error["text"].endswith(f"Launch every machine with the same {name}.")


STRANGER_RANK = """
import os, pathlib, time
from notebook_launcher import notebook_launcher

def train(folder):
    import torch, torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_store
    folder = pathlib.Path(folder)
    dist.init_process_group("gloo")
    store = _get_default_store()
    if dist.get_rank() == 0:
        store.set("answer", "kept")
        (folder / "port").write_text(os.environ["MASTER_PORT"])
    dist.barrier()
    while not (folder / "stranger_done").exists():  # the stranger acts meanwhile
        time.sleep(0.05)
    total = torch.ones(1)
    dist.all_reduce(total)
    return store.get("answer").decode(), total.item()

print("RESULT", notebook_launcher(train, args=(os.getcwd(),), num_processes=2, timeout=200, return_all=True))
"""


def stranger(port: int, keys: list[str]) -> dict[str, str]:
    """A process of someone else on loopback: reads and overwrites the names it knows."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", port, None, is_master=False, timeout=timedelta(seconds=1))
    seen = {}
    for key in keys:
        try:
            seen[key] = store.get(key).decode(errors="replace")
        except Exception:
            pass
        store.set(key, "broken")
    return seen


def listed_keys(port: int) -> list[str]:
    from torch.distributed import TCPStore

    return TCPStore(
        "127.0.0.1", port, None, is_master=False, timeout=timedelta(seconds=1)
    ).list_keys()


def test_a_stranger_that_lists_the_keys_learns_nothing_and_cannot_make_ranks_trust_it(tmp_path):
    """TCPStore lists its keys to any client. Through the launch's sealed view, the names
    reveal nothing, the values read as noise, and a value the stranger overwrote is refused
    by the rank that reads it, not trusted."""
    script = tmp_path / "launch.py"
    script.write_text(textwrap.dedent(STRANGER_RANK))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    launch = subprocess.Popen(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        port_file = tmp_path / "port"
        while not port_file.exists() or not port_file.read_text():
            assert launch.poll() is None, launch.communicate()
            subprocess.run(["sleep", "0.05"])
        port = int(port_file.read_text())
        keys = listed_keys(port)
        # Every key the stranger can list: read it, then overwrite it.
        seen = stranger(port, keys)
        (tmp_path / "stranger_done").touch()
        stdout, stderr = launch.communicate(timeout=200)
    finally:
        launch.kill()
        launch.wait()
    assert keys, "the store holds the launch's keys"
    assert not [key for key in keys if "answer" in key or "default_pg" in key or "/" in key], keys
    assert not [value for value in seen.values() if "kept" in value or "127.0.0.1" in value], seen
    assert "RESULT" not in stdout, stdout
    assert "ForgedStoreValue" in stderr and "failed its check" in stderr, stderr


STRANGER_NODE = """
import json, sys
from notebook_launcher import notebook_launcher

def where():
    return int(__import__("os").environ["WORLD_SIZE"])

print("RESULT " + json.dumps(notebook_launcher(
    where, num_processes=1, num_nodes=2, node_rank=int(sys.argv[1]), rdzv_endpoint=sys.argv[2],
    rdzv_conf={"join_timeout": 120, "secret": "our shared words"}, timeout=240)))
"""


@pytest.mark.slow(reason="two machines (processes) and a stranger at a rendezvous")
def test_a_stranger_writing_the_closing_key_does_not_stop_machines_with_a_secret(tmp_path):
    script = tmp_path / "node.py"
    script.write_text(textwrap.dedent(STRANGER_NODE))
    port = free_port()
    endpoint = f"127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = [sys.executable, str(script)]
    host = subprocess.Popen(
        [*run, "0", endpoint],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        from notebook_launcher.launcher.store import probe_store

        while probe_store("127.0.0.1", port) != "store":
            assert host.poll() is None, host.communicate()
        stranger(port, ["notebook_launcher/closing"])
        other = subprocess.run(
            [*run, "1", endpoint],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=250,
        )
        stdout, stderr = host.communicate(timeout=250)
    finally:
        host.kill()
        host.wait()
    assert tagged(subprocess.CompletedProcess([], 0, stdout, stderr), "RESULT") == 2
    assert tagged(other, "RESULT") == 2


def test_at_the_c10d_first_check_the_host_keeps_its_store_until_the_other_machine_refused_too(
    leak_check,
):
    """The host reads both machines' announcements and refuses; the other machine, a moment
    behind, must still find the store and refuse with the values, not with a store gone."""
    import json

    from notebook_launcher.launcher.rendezvous import NodeRendezvous, RendezvousConfig

    endpoint = f"127.0.0.1:{free_port()}"

    def machine(node_rank: int, precision: str) -> NodeRendezvous:
        config = RendezvousConfig(
            backend="c10d",
            num_nodes=2,
            node_rank=node_rank,
            endpoint=endpoint,
            run_id="held",
            conf={"is_host": node_rank == 0, "join_timeout": 60},
        )
        return NodeRendezvous(
            config, "127.0.0.1", None, 1, fingerprint={"mixed_precision": precision}
        )

    host, late = machine(0, "bf16"), machine(1, "no")
    announced = "held/attempt0/machines"
    late._keys.append(announced, json.dumps(late._me) + "\n")  # announced, not yet read
    refusals: dict[str, BaseException] = {}

    def host_round() -> None:
        try:
            host.next_round(0)
        except BaseException as error:
            refusals["host"] = error
        finally:
            host.close()  # as a launch does at once after its rendezvous failed

    thread = threading.Thread(target=host_round)
    thread.start()
    try:
        # The late machine reads once the host has refused (and, before it was held, closed).
        safety = time.monotonic() + 60
        while thread.is_alive() and not late._keys.check([f"{announced}/refused"]):
            assert time.monotonic() < safety, "the host neither refused nor ended"
            time.sleep(0.01)
        with pytest.raises(
            RendezvousError,
            match=r"disagree on mixed_precision: node_rank=0 .* has mixed_precision='bf16', node_rank=1 .* has mixed_precision='no'",
        ):
            late.next_round(0)
    finally:
        late.close()
        thread.join(60)
    assert "disagree on mixed_precision" in str(refusals["host"])


def test_each_rdzv_backend_users_may_pass_is_a_registered_strategy():
    """The rendezvous has the registry's shape: what options accepts is what is registered,
    each strategy behind the one interface the rendezvous reads."""
    from notebook_launcher.launcher import options
    from notebook_launcher.launcher.rendezvous_strategies import (
        STRATEGIES,
        RendezvousConfig,
        Strategy,
    )

    assert set(STRATEGIES) == set(options.RDZV_BACKENDS)
    for name, strategy in STRATEGIES.items():
        assert issubclass(strategy, Strategy) and strategy.name == name
    config = RendezvousConfig("static", 2, 1, "", "job", {})
    assert STRATEGIES["static"](config).should_host("127.0.0.1") is False
    assert STRATEGIES["c10d"](config).should_host("127.0.0.1") is None  # hosts if nobody does
    forced = RendezvousConfig("c10d", 2, 1, "", "job", {"is_host": "yes"})
    assert STRATEGIES["c10d"](forced).should_host("10.255.255.1") is True


def test_a_port_that_closes_without_a_word_is_asked_again_and_one_that_stays_silent_is_no_store(
    held_port,
):
    """A store that is closing (the previous launch's) accepts and closes at once: it may
    listen again, so the rendezvous keeps asking; a program that keeps the connection open
    and says nothing is no store, said at once."""
    from notebook_launcher.launcher.store import probe_store

    with socket.socket() as closer:
        closer.bind(("127.0.0.1", 0))
        closer.listen(1)

        def close_at_once() -> None:
            connection, _ = closer.accept()
            connection.close()

        accepting = threading.Thread(target=close_at_once)
        accepting.start()
        assert probe_store("127.0.0.1", closer.getsockname()[1], timeout=60) == "nothing"
        accepting.join()
    assert probe_store("127.0.0.1", held_port, timeout=0.5) == "other"

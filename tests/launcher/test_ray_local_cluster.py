"""The Ray cluster a launch starts for itself (no ray_address): every port on loopback, and
only clients holding its token admitted, a token written to no file; the kernel's own
settings come back afterwards.
"""

from __future__ import annotations

import ipaddress
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import psutil
import pytest

pytest.importorskip("ray")

from tests.support.kernel_driver import CellRun, RunningKernel, wait_for_output
from tests.support.ray_cluster import favour

pytestmark = [
    pytest.mark.ray,
    pytest.mark.slow(
        reason="the launcher starts local Ray clusters (one whose raylet dies): 1 to 3 min"
    ),
    pytest.mark.kernel,
]

AUTH_ENV = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")
ROOT = str(Path(__file__).resolve().parents[2])

SETUP = """
import os
for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS",
             "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"):
    os.environ.pop(name, None)
os.environ.update({env!r})
from notebook_launcher import notebook_launcher

def blocked(fifo):
    reader = os.open(fifo, os.O_RDWR)  # never at end of file: read() waits for a byte
    print("blocked", flush=True)
    os.read(reader, 1)
    return int(os.environ["RANK"])
"""

# A client that reaches the GCS port and asks it for the cluster's nodes, with the token
# given (if any) the way Ray's own clients send it.
STRANGER = textwrap.dedent("""
    import sys
    import grpc
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    address, token = sys.argv[1], sys.argv[2]
    stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(grpc.insecure_channel(address))
    metadata = [("authorization", f"Bearer {token}")] if token else None
    try:
        reply = stub.GetAllNodeInfo(gcs_service_pb2.GetAllNodeInfoRequest(), timeout=120,
                                    metadata=metadata)
        print("ANSWERED", len(reply.node_info_list))
    except grpc.RpcError as error:
        print("REFUSED", error.code().name)
""")


@pytest.fixture
def folders():
    # Ray's socket paths must stay under 107 bytes: short folders.
    made = {
        name: tempfile.mkdtemp(prefix=name[0], dir="/tmp") for name in ("home", "ray", "stranger")
    }
    yield made
    for path in made.values():
        shutil.rmtree(path, ignore_errors=True)


def listening(pid: int) -> list[tuple[str, str, int]]:
    """Every socket the process and its descendants listen on: (name, address, port)."""
    found = []
    root = psutil.Process(pid)
    for process in [root, *root.children(recursive=True)]:
        try:
            name = process.name()
            connections = process.net_connections(kind="inet")
        except psutil.Error:
            continue
        found += [
            (name, c.laddr.ip, c.laddr.port) for c in connections if c.status == psutil.CONN_LISTEN
        ]
    return found


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    mapped = getattr(ip, "ipv4_mapped", None)  # [::ffff:127.0.0.1], a dual-stack socket
    return (mapped or ip).is_loopback


def ask_gcs(address: str, token: str, folders: dict[str, str]) -> str:
    done = subprocess.run(
        [sys.executable, "-c", STRANGER, address, token],
        capture_output=True,
        text=True,
        env=stranger_env(folders),
        timeout=600,
    )
    return done.stdout.strip() or done.stderr


def stranger_env(folders: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["HOME"] = folders["stranger"]  # no ~/.ray/auth_token of anyone's
    return env


def launch_at(address: str, folders: dict[str, str]) -> str:
    """What a launch of another user's kernel, naming the cluster but without its token, says."""
    script = textwrap.dedent("""
        import sys
        from notebook_launcher import notebook_launcher

        try:
            notebook_launcher(print, num_processes=1, backend="ray", ray_address=sys.argv[1])
        except Exception as error:
            print(type(error).__name__, error)
    """)
    # Without it Ray would rewrite 127.0.0.1 into the machine's outward address, on which
    # this cluster does not listen.
    env = {**stranger_env(folders), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "PYTHONPATH": ROOT}
    done = subprocess.run(
        [sys.executable, "-c", script, address],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    return done.stdout.strip() or done.stderr


def start_blocked_launch(kernel: RunningKernel, fifo: str) -> tuple[str, CellRun]:
    """A launch whose two ranks wait on ``fifo``, once both wait. The start waits for its
    node however long a busy machine makes it (no second attempt): any other end of the
    cell fails the test."""
    msg_id = kernel.submit(
        f"notebook_launcher(blocked, ({fifo!r},), num_processes=2, backend='ray', return_all=True)"
    )
    return msg_id, wait_for_output(kernel, msg_id, ["[rank0]: blocked", "[rank1]: blocked"])


def test_the_cluster_started_for_a_launch_listens_on_loopback_and_refuses_clients_without_its_token(
    folders,
):
    # The user asked for no authentication: the cluster started for the launch has it anyway.
    env = {
        "RAY_USAGE_STATS_ENABLED": "0",
        "GLOO_SOCKET_IFNAME": "lo",
        "HOME": folders["home"],
        "RAY_TMPDIR": folders["ray"],
        "RAY_AUTH_MODE": "disabled",
    }
    fifo = os.path.join(folders["ray"], "go")
    os.mkfifo(fifo)
    kernel = RunningKernel()
    favour(kernel.pid)
    try:
        setup = kernel.run(SETUP.format(env=env))
        assert setup.error is None, setup.error
        msg_id, waited = start_blocked_launch(kernel, fifo)

        # Both ranks wait: the cluster is up, and so is every port of the launch.
        ports = listening(kernel.pid)
        gcs = [port for name, _, port in ports if name == "gcs_server"]
        assert len(gcs) == 1 and {"raylet", "gcs_server"} <= {name for name, _, _ in ports}, ports
        assert [p for p in ports if not is_loopback(p[1])] == []
        address = f"127.0.0.1:{gcs[0]}"
        assert ask_gcs(address, "", folders) == "REFUSED UNAUTHENTICATED"
        assert ask_gcs(address, "0" * 64, folders) == "REFUSED UNAUTHENTICATED"
        assert launch_at(address, folders).startswith(
            f"RayClusterError could not connect to the Ray cluster at '{address}': Failed to "
            f"connect to Ray cluster at {address}"
        )

        writer = os.open(fifo, os.O_WRONLY)
        os.write(writer, b"gg")  # one byte for each rank
        os.close(writer)
        cell = kernel.collect(msg_id, timeout=900)
        after = kernel.run(
            "import psutil, ray; (ray.is_initialized(), "
            f"[os.environ.get(name) for name in {[*AUTH_ENV, 'RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER']!r}], "
            "[p.name() for p in psutil.Process().children(recursive=True)])"
        )
    finally:
        kernel.shutdown()
    assert cell.error is None, cell.error
    assert cell.result == "[0, 1]"  # the launcher itself was admitted
    # The cluster is shut down with every process it started; the kernel's own settings are back.
    assert after.result == repr((False, ["disabled", None, None, None], []))
    assert not os.path.exists(os.path.join(folders["home"], ".ray"))  # no token file written
    note = (
        "notebook_launcher: RAY_AUTH_MODE=disabled is set, but the Ray cluster started for this "
        "launch uses token authentication anyway: it is started with a token of its own, which "
        "only the launcher needs. To run a cluster without authentication, start it yourself "
        "(ray start) and pass ray_address=.\n"
    )
    assert note in waited.stderr + cell.stderr


# Ray's raylet, killed as soon as it appears: a node whose raylet dies while it starts.
RAYLET_KILLED = textwrap.dedent("""
    import os, signal, threading, psutil

    def kill_the_raylet():
        while True:
            for child in psutil.Process().children():
                try:
                    if child.name() == "raylet":
                        os.kill(child.pid, signal.SIGKILL)
                        return
                except psutil.Error:
                    pass

    threading.Thread(target=kill_the_raylet, daemon=True).start()
""")


def test_a_local_cluster_whose_raylet_dies_fails_at_once_saying_where_ray_says_why(folders):
    script = RAYLET_KILLED + textwrap.dedent("""
        from notebook_launcher import notebook_launcher

        try:
            notebook_launcher(print, num_processes=1, backend="ray")
        except Exception as error:
            print(type(error).__name__, error)
        print("LEFT", [p.name() for p in psutil.Process().children(recursive=True)])
    """)
    env = {
        **stranger_env(folders),
        "HOME": folders["home"],
        "RAY_TMPDIR": folders["ray"],
        "RAY_USAGE_STATS_ENABLED": "0",
        "PYTHONPATH": ROOT,
    }
    # Without the check for the raylet, the start would wait Ray's whole bound for a node
    # that never registers (RAY_raylet_start_wait_time_s: the launcher's 300 s); the
    # safety net below is past it.
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=900
    )
    logs = os.path.join(folders["ray"], "ray", "session_latest", "logs")
    lines = done.stdout.splitlines()
    assert re.fullmatch(
        re.escape(
            "RayClusterError could not start a local Ray cluster for the launch: Ray's raylet"
        )
        + r"( \(pid \d+\))?"
        + re.escape(
            f" exited before its node registered with the GCS. Ray's logs in {logs} (raylet.out, "
            "gcs_server.out) say why. Run the launch again, or start a cluster yourself (ray "
            "start --head) and pass ray_address=."
        ),
        lines[0],
    ), done.stdout + done.stderr
    assert "RAY_AUTH_MODE" not in done.stderr  # the note is for those who set it alone
    assert lines[-1] == "LEFT []"

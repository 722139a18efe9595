"""The ``notebook-launcher`` command (also ``python -m notebook_launcher``).

``notebook-launcher env`` prints the hardware and versions report that the JupyterLab
sidebar shows (``--json`` for a machine-readable copy to paste into a bug report).
``notebook-launcher run script.py -n 4 --mixed-precision bf16 -- ARGS`` runs a script on
N ranks through the same launcher a notebook uses: each rank runs the script as
``__main__`` with ``sys.argv = [script.py, *ARGS]``, its output is prefixed with its rank,
and the command exits non-zero when a rank fails.

Exit codes: 0 success, 1 a rank failed or the launch timed out, 2 bad arguments (one
line on stderr), 130 interrupted.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import runpy
import signal
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from notebook_launcher import defaults as launch_defaults
from notebook_launcher import hardware, rules
from notebook_launcher.errors import LaunchConfigError, LaunchError
from notebook_launcher.launcher import backends

PROG = "notebook-launcher"
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
# Distributions whose versions matter when something goes wrong in a launch.
_REPORTED_PACKAGES = (
    "notebook-launcher",
    "torch",
    "torch-xla",
    "accelerate",
    "transformers",
    "ray",
    "cloudpickle",
    "ipykernel",
    "ipywidgets",
    "jupyterlab",
    "jupyter_server",
    "numpy",
)


class _UsageError(Exception):
    """Bad command-line arguments: reported on one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # argparse prints the whole usage block; one line that names --help reads better.
        if message.startswith("unrecognized arguments"):
            message += "; the script's own arguments go after --"
        raise _UsageError(f"{message} (see {self.prog} --help)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG,
        description=(
            "Run a PyTorch training function or script on every GPU, TPU core or a few CPU "
            "processes of this machine, as notebook_launcher() does in a notebook."
        ),
        epilog=(
            "examples:\n"
            f"  {PROG} env                    hardware and versions, for bug reports\n"
            f"  {PROG} env --json             the same as JSON\n"
            f"  {PROG} run train.py -n 4 --mixed-precision bf16 -- --epochs 3\n"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(
        dest="command", metavar="COMMAND", parser_class=_Parser, required=True
    )

    env = commands.add_parser(
        "env",
        help="print the hardware and versions report (what the JupyterLab sidebar shows)",
        description="Print this machine's hardware, what a launch can use, the saved launch "
        "defaults and the versions of the packages that matter, for bug reports.",
    )
    env.add_argument("--json", action="store_true", help="print the report as JSON")

    from notebook_launcher.big_modeling import command as big_model_command

    big_model_command.add_parser(commands)

    run = commands.add_parser(
        "run",
        help="run a Python script on N ranks with the launcher",
        description="Run SCRIPT as __main__ on every rank, with torchrun's environment "
        "(RANK, WORLD_SIZE, MASTER_ADDR, ...) set, each rank's output prefixed with its rank. "
        "Arguments after -- are the script's own (its sys.argv[1:]). Exits 1 when a rank "
        "fails, after printing that rank's traceback.",
        usage=f"{PROG} run SCRIPT [options] [-- SCRIPT_ARGS ...]",
    )
    run.add_argument("script", metavar="SCRIPT", help="the Python file each rank runs")
    run.add_argument(
        "-n",
        "--num-processes",
        type=_positive_int,
        metavar="N",
        help="ranks to start (default: one per GPU, else 2 CPU ranks)",
    )
    _add_choice(
        run,
        "--mixed-precision",
        rules.PRECISIONS,
        "precision the training core (or accelerate) applies in each rank",
    )
    run.add_argument(
        "--hardware",
        choices=rules.HARDWARE_CHOICES,
        default="auto",
        help="where ranks run (default: auto)",
    )
    _add_choice(
        run, "--start-method", rules.START_METHODS, "how rank processes start (default: auto)"
    )
    run.add_argument(
        "--timeout",
        type=_positive_float,
        metavar="SECONDS",
        help="stop every rank and fail after this many seconds",
    )
    run.add_argument(
        "--output",
        choices=rules.OUTPUT_MODES,
        default="all",
        help="whose output to show: every rank, rank 0 only, or none (default: all)",
    )
    run.add_argument(
        "--port", type=int, metavar="PORT", help="rendezvous port (default: a free one)"
    )
    run.add_argument(
        "--max-restarts",
        type=_whole,
        default=0,
        metavar="N",
        help="after a rank fails, restart every rank up to N times (default: 0)",
    )
    _add_backend_arguments(run)
    nodes = run.add_argument_group(
        "several machines", "run the same command on each machine, as with torchrun"
    )
    nodes.add_argument("--num-nodes", type=_positive_int, default=1, metavar="N")
    nodes.add_argument("--node-rank", type=_whole, default=0, metavar="RANK")
    nodes.add_argument("--rdzv-backend", choices=("static", "c10d"), default="static")
    nodes.add_argument("--rdzv-endpoint", default="", metavar="HOST:PORT")
    nodes.add_argument("--rdzv-id", default="none", metavar="ID")
    nodes.add_argument(
        "--rdzv-conf",
        type=_rdzv_conf,
        default={},
        metavar="KEY=VALUE,...",
        help="rendezvous options, as torchrun's: join_timeout=900,last_call_timeout=30; "
        "the shared secret is better given in $NOTEBOOK_LAUNCHER_RDZV_SECRET",
    )
    nodes.add_argument(
        "--master-addr",
        default="127.0.0.1",
        metavar="ADDRESS",
        help="address the store listens on (default: 127.0.0.1)",
    )
    return parser


def _add_choice(run: argparse.ArgumentParser, flag: str, choices: Sequence[str], help: str) -> None:
    """An option that takes one of ``choices``, each listed in --help."""
    run.add_argument(flag, choices=choices, metavar="{" + ",".join(choices) + "}", help=help)


def _add_backend_arguments(run: argparse.ArgumentParser) -> None:
    """--backend, and each registered backend's own options (--ray-address)."""
    known = backends.registered()
    where = "; ".join(f"{name}: {b.description}" for name, b in known.items() if b.description)
    run.add_argument(
        "--backend",
        choices=backends.names(),
        default="auto",
        help=f"what starts the ranks ({where}; default: auto, by the hardware)",
    )
    added: set[str] = set()
    for backend in known.values():
        for option in backend.options:
            if option.name in added:
                continue  # shared by several backends: one flag
            added.add(option.name)
            users = [b.name for b in known.values() if option in b.options]
            run.add_argument(
                "--" + option.name.replace("_", "-"),
                dest=option.name,
                metavar=option.metavar,
                help=f"with --backend {' or '.join(users)}: {option.help}",
            )


def _backend_options(arguments: argparse.Namespace) -> dict[str, Any]:
    """The backends' options given on the command line (the others stay unset)."""
    return {
        option.name: getattr(arguments, option.name)
        for backend in backends.registered().values()
        for option in backend.options
        if getattr(arguments, option.name, None) is not None
    }


def _number_type(
    convert: Callable[[str], Any], expected: str, bound: str, allowed: Callable[[Any], bool]
) -> Callable[[str], Any]:
    """An argparse ``type=`` that converts a value and refuses it outside ``bound``."""

    def parse(text: str) -> Any:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if not allowed(value):
            shown = value if convert is int else text
            raise argparse.ArgumentTypeError(f"must be {bound}, got {shown}")
        return value

    return parse


def _rdzv_conf(text: str) -> dict[str, Any]:
    """torchrun's form: ``key=value`` pairs separated by commas; numbers become numbers."""
    conf: dict[str, Any] = {}
    for pair in filter(None, (part.strip() for part in text.split(","))):
        key, equals, value = pair.partition("=")
        if not equals or not key.strip():
            raise argparse.ArgumentTypeError(
                f"expected KEY=VALUE pairs separated by commas, got {pair!r}"
            )
        conf[key.strip()] = _maybe_number(value.strip())
    return conf


def _maybe_number(text: str) -> Any:
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    return text


_positive_int = _number_type(int, "a whole number", "at least 1", lambda v: v >= 1)
_whole = _number_type(int, "a whole number", "at least 0", lambda v: v >= 0)
_positive_float = _number_type(float, "a number of seconds", "more than 0", lambda v: v > 0)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    words = list(sys.argv[1:] if argv is None else argv)
    ours, script_args = _split_script_args(words)
    try:
        arguments = parser.parse_args(ours)
        arguments.script_args = script_args
        if arguments.command == "env":
            return _env(as_json=arguments.json)
        if arguments.command == "estimate-memory":
            from notebook_launcher.big_modeling import command as big_model_command

            return big_model_command.run(arguments)
        return _run(arguments)
    except _UsageError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return EXIT_USAGE


def _split_script_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """Everything after the first ``--`` belongs to the script, even words like our options."""
    if "--" not in argv:
        return argv, []
    cut = argv.index("--")
    return argv[:cut], argv[cut + 1 :]


# env ---------------------------------------------------------------------------------


def environment_report() -> dict[str, Any]:
    """The hardware report with what a launch may use (as the sidebar gets it) and versions."""
    report = hardware.detect()
    saved = launch_defaults.load_defaults()
    return {
        "hardware": report.to_dict(),
        "choices": launch_defaults.choices(report),
        "defaults": {
            "path": str(launch_defaults.defaults_path()),
            "saved": saved.to_dict(),
            "description": launch_defaults.describe_launch(saved, report),
        },
        "system": {
            "python": sys.version.split()[0],
            "executable": sys.executable,
            "platform": platform.platform(),
        },
        "versions": {name: _version(name) for name in _REPORTED_PACKAGES},
    }


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _env(as_json: bool) -> int:
    data = environment_report()
    if as_json:
        print(json.dumps(data, indent=2, sort_keys=True))
    else:
        print(format_report(data))
    return 0


def format_report(data: dict[str, Any]) -> str:
    hw = data["hardware"]
    lines = [f"{PROG} environment", ""]
    lines.append(f"platform        {hw['platform']} ({data['system']['platform']})")
    lines.append(f"python          {data['system']['python']} ({data['system']['executable']})")
    lines.append(f"CPU cores       {hw['cpu_count']} available to this process")
    if hw["gpus"]:
        lines.append(f"GPUs            {len(hw['gpus'])} (driver {hw['driver_version']})")
        for gpu in hw["gpus"]:
            lines.append(
                f"  cuda:{gpu['index']}         {gpu['name']}, {gpu['memory_mib']} MiB, "
                f"compute capability {gpu['compute_capability'] or 'unknown'}"
            )
    else:
        lines.append("GPUs            none found (nvidia-smi)")
    lines.append(f"TPU cores       {hw['tpu_cores']}")
    lines.append(f"MPS             {'available' if hw['mps_available'] else 'no'}")
    lines.append(
        f"launches        {hw['default_num_processes']} x {hw['accelerator']} rank(s) by default"
    )
    for precision, reason in hw["precisions"].items():
        lines.append(f"  {precision:<6}        {'yes' if reason is None else 'no: ' + reason}")
    defaults = data["defaults"]
    lines.append(f"saved defaults  {defaults['description']} ({defaults['path']})")
    lines.append("")
    lines.append("versions")
    for name, version in data["versions"].items():
        lines.append(f"  {name:<18}{version or 'not installed'}")
    return "\n".join(lines)


# run ---------------------------------------------------------------------------------


def run_script(path: str, argv: list[str], argv0: str | None = None) -> None:
    """What each rank runs: the script as ``__main__``, as ``python SCRIPT ARGS`` would
    (``sys.argv[0]`` as it was typed, as python and torchrun give it)."""
    shown = argv0 if argv0 and os.path.abspath(argv0) == os.path.abspath(path) else path
    sys.argv = [shown, *argv]
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    runpy.run_path(shown, run_name="__main__")  # it sets sys.argv[0] to the path it is given


def _run(arguments: argparse.Namespace) -> int:
    from notebook_launcher.api import notebook_launcher

    script = arguments.script
    if not os.path.isfile(script):
        raise _UsageError(f"the script {script!r} does not exist or is not a file")
    script_args = list(arguments.script_args)
    # A shell that starts a command in the background (`cmd &`, nohup) sets SIGINT to
    # ignored, and Python keeps it so: the launch could then not be interrupted.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        notebook_launcher(
            run_script,
            (os.path.abspath(script), script_args, script),
            num_processes=arguments.num_processes,
            mixed_precision=arguments.mixed_precision,
            use_port=arguments.port,
            hardware=arguments.hardware,
            start_method=arguments.start_method,
            timeout=arguments.timeout,
            output=arguments.output,
            max_restarts=arguments.max_restarts,
            backend=arguments.backend,
            num_nodes=arguments.num_nodes,
            node_rank=arguments.node_rank,
            rdzv_backend=arguments.rdzv_backend,
            rdzv_endpoint=arguments.rdzv_endpoint,
            rdzv_id=arguments.rdzv_id,
            rdzv_conf=arguments.rdzv_conf,
            master_addr=arguments.master_addr,
            **_backend_options(arguments),
        )
    except LaunchConfigError as error:
        raise _UsageError(_one_line(str(error))) from error
    except LaunchError as error:
        sys.stdout.flush()
        print(f"{PROG}: {error}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted; every rank was stopped.", file=sys.stderr)
        return EXIT_INTERRUPTED
    return 0


def _one_line(text: str) -> str:
    return " ".join(text.split())

"""``notebook_launcher()`` and ``debug_launcher()``: accelerate's signature, kept."""

from __future__ import annotations

from typing import Any, Callable

from notebook_launcher.defaults import load_defaults
from notebook_launcher.hardware import detect as detect_hardware  # `hardware` is an argument
from notebook_launcher.launcher import options
from notebook_launcher.launcher.events import LaunchObserver
from notebook_launcher.launcher.printer import TextPrinter
from notebook_launcher.launcher.run import execute
from notebook_launcher.launcher.start_method import KernelState


def notebook_launcher(
    function: Callable[..., Any],
    args: tuple[Any, ...] | list[Any] = (),
    num_processes: int | None = None,
    mixed_precision: str | None = None,
    use_port: int | str | None = None,
    master_addr: str = "127.0.0.1",
    node_rank: int = 0,
    num_nodes: int = 1,
    rdzv_backend: str = "static",
    rdzv_endpoint: str = "",
    rdzv_conf: dict[str, Any] | None = None,
    rdzv_id: str = "none",
    max_restarts: int = 0,
    monitor_interval: float = 0.1,
    log_line_prefix_template: str | None = None,
    *,
    kwargs: dict[str, Any] | None = None,
    hardware: str = "auto",
    start_method: str | None = None,
    timeout: float | None = None,
    return_all: bool = False,
    output: str = "all",
    observers: list[LaunchObserver] | None = None,
) -> Any:
    """Run ``function(*args, **kwargs)`` on ``num_processes`` ranks of this machine.

    Every rank sees torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, ...), so
    ``torch.distributed.init_process_group()`` needs no arguments inside. Each rank's
    output streams into the calling cell with a rank prefix. Returns rank 0's return
    value, or every rank's in a list with ``return_all=True``. If a rank fails, the
    others are stopped and :class:`~notebook_launcher.errors.RankFailedError` (also an
    instance of the rank's exception type where possible) carries its traceback.

    Arguments left as None take the defaults saved with the JupyterLab sidebar (read at
    each call), else the hardware's.

    Several machines: call it in a notebook (or script) on each machine with the same
    ``num_nodes``, ``rdzv_backend``, ``rdzv_endpoint`` and ``rdzv_id``, as with torchrun.
    Global ranks are ``group_rank * num_processes + local_rank``; with ``"static"`` the
    group rank is ``node_rank``, with ``"c10d"`` torch's rendezvous assigns it. Each kernel
    shows its own ranks' output and returns the value of rank 0 where it holds rank 0,
    else of its own first rank (``return_all=True``: its own ranks' values).

    Args:
        num_processes: ranks to start; default one per GPU, else 2 CPU ranks.
        mixed_precision: "no", "bf16", "fp16" or "fp8", passed to each rank as
            ACCELERATE_MIXED_PRECISION for the training core (or accelerate) to apply.
        use_port: the rendezvous port; default a free one, held by this kernel.
        max_restarts: after a rank fails, stop this machine's ranks and start them all
            again, up to this many times (saying so in the cell); then raise the failure.
        monitor_interval: seconds between checks of timeout and stop requests.
        hardware: "auto", "cpu" or "cuda".
        start_method: "auto" (fork when safe, else a warm forkserver), "fork",
            "forkserver" or "spawn".
        timeout: seconds after which a still-running launch is stopped with an error.
        output: "all" (every rank), "main" (rank 0 only) or "none".
        observers: extra receivers of launch events (a dashboard).
    """
    options.check_not_inside_rank()
    options.check_function(function)
    call_args, call_kwargs = options.check_args(args, kwargs)
    rendezvous = options.check_rendezvous(
        node_rank, num_nodes, rdzv_backend, rdzv_endpoint, rdzv_conf, rdzv_id
    )
    restarts = options.check_max_restarts(max_restarts)
    saved = load_defaults()  # at call time: a default saved in the sidebar applies at once
    with options.blame_saved_defaults(
        num_processes is None and saved.num_processes is not None,
        mixed_precision is None and saved.mixed_precision is not None,
        start_method is None and saved.start_method is not None,
    ):
        report = detect_hardware()
        accelerator = options.resolve_accelerator(hardware, report)
        num = options.check_num_processes(
            saved.num_processes if num_processes is None else num_processes, accelerator, report
        )
        precision = options.check_mixed_precision(
            saved.mixed_precision if mixed_precision is None else mixed_precision, accelerator, report
        )
        start = options.choose_start(
            saved.start_method if start_method is None else start_method, KernelState.detect()
        )
    plan = options.LaunchPlan(
        num_processes=num,
        accelerator=accelerator,
        mixed_precision=precision,
        start=start,
        master_addr=master_addr,
        port=options.check_port(use_port),
        threads_per_rank=options.threads_per_rank(num, report),
        timeout=options.check_seconds("timeout", timeout, allow_none=True),
        monitor_interval=options.check_seconds("monitor_interval", monitor_interval, allow_none=False)
        or 0.1,
        output=options.check_output(output),
        prefix_template=options.check_prefix_template(log_line_prefix_template),
        return_all=bool(return_all),
        rendezvous=rendezvous,
        max_restarts=restarts,
    )
    printer = TextPrinter(plan.output, plan.prefix_template)
    values = execute(plan, function, call_args, call_kwargs, [printer, *(observers or [])])
    return values if plan.return_all else values[0]


def debug_launcher(
    function: Callable[..., Any], args: tuple[Any, ...] | list[Any] = (), num_processes: int = 2
) -> Any:
    """Run ``function`` on ``num_processes`` CPU ranks, as accelerate's debug_launcher does."""
    return notebook_launcher(function, args, num_processes=num_processes, hardware="cpu")

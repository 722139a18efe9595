"""``notebook_launcher()`` and ``debug_launcher()``: accelerate's signature, kept.

The public face of the launcher: it adds the dashboard to the observers of a launch,
which the launcher itself (:mod:`notebook_launcher.launcher.launch`) knows nothing of.
"""

from __future__ import annotations

from typing import Any, Callable

from notebook_launcher.launcher import launch
from notebook_launcher.launcher.events import LaunchObserver
from notebook_launcher.launcher.plan import LaunchCall
from notebook_launcher.widgets import dashboard_observer


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
    backend: str = "auto",
    keep_result_devices: bool = False,
    dashboard: bool | str = "auto",
    **backend_options: Any,
) -> Any:
    """Run ``function(*args, **kwargs)`` on ``num_processes`` ranks of this machine.

    Every rank sees torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, ...), so
    ``torch.distributed.init_process_group()`` needs no arguments inside. Each rank's
    output streams into the calling cell with a rank prefix. Returns rank 0's return
    value, or every rank's in a list with ``return_all=True``. If a rank fails, the
    others are stopped and :class:`~notebook_launcher.errors.RankFailedError` (also an
    instance of the rank's exception type where possible) carries its traceback.

    Arguments left as None take the defaults chosen with ``configure()`` in this kernel,
    else those saved with the JupyterLab sidebar (read at each call), else the hardware's.

    Args:
        num_processes: ranks to start; default one per GPU, else 2 CPU ranks.
        mixed_precision: "no", "bf16", "fp16" or "fp8", passed to each rank as
            ACCELERATE_MIXED_PRECISION for the training core (or accelerate) to apply.
        use_port: the rendezvous port; default a free one, held by this kernel.
        hardware: "auto", "cpu", "cuda", "tpu" or "mps".
        start_method: "auto" (fork when safe, else a warm forkserver), "fork",
            "forkserver" or "spawn".
        timeout: seconds after which a still-running launch is stopped with an error.
        output: "all" (every rank), "main" (rank 0 only) or "none".
        observers: extra receivers of launch events .
        backend: "auto" (by the hardware), "local" (processes of this machine), "xla"
            (TPU cores, through torch_xla) or "ray" (Ray actors, one GPU each where there
            are GPUs; needs the ``ray`` extra), or any backend registered with
            :func:`notebook_launcher.launcher.backends.register`.
        backend_options: the chosen backend's own keyword arguments, such as
            ``ray_address`` with backend="ray": the cluster to run on (default
            RAY_ADDRESS, else a local cluster started for the launch and shut down after
            it). A keyword that is neither an argument nor an option of a backend raises
            :class:`~notebook_launcher.errors.LaunchTypeError` (a TypeError).
        keep_result_devices: keep tensors in the return values on the device they were
            made on; by default they come back on the CPU, so that a result never
            initialises CUDA in the kernel.
        dashboard: "auto" (a live dashboard of widgets in a notebook, text elsewhere),
            True (the same, and an error where ipywidgets is missing) or False (none).
    """
    call = LaunchCall(
        num_processes=num_processes,
        mixed_precision=mixed_precision,
        use_port=use_port,
        master_addr=master_addr,
        node_rank=node_rank,
        num_nodes=num_nodes,
        rdzv_backend=rdzv_backend,
        rdzv_endpoint=rdzv_endpoint,
        rdzv_conf=rdzv_conf,
        rdzv_id=rdzv_id,
        max_restarts=max_restarts,
        monitor_interval=monitor_interval,
        log_line_prefix_template=log_line_prefix_template,
        hardware=hardware,
        start_method=start_method,
        timeout=timeout,
        return_all=return_all,
        output=output,
        backend=backend,
        keep_result_devices=keep_result_devices,
        backend_options=backend_options,
    )
    prepared = launch.prepare(function, args, kwargs, call)
    board = dashboard_observer(dashboard)
    extra = [board] if board is not None else []
    # The dashboard shows progress bars: the cell's lines then keep only their final state.
    progress_lines = not getattr(board, "shows_progress", False)
    return prepared.run([*extra, *(observers or [])], progress_lines=progress_lines)


def debug_launcher(
    function: Callable[..., Any], args: tuple[Any, ...] | list[Any] = (), num_processes: int = 2
) -> Any:
    """Run ``function`` on ``num_processes`` CPU ranks, as accelerate's debug_launcher does."""
    return notebook_launcher(function, args, num_processes=num_processes, hardware="cpu")

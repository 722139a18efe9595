"""What the live dashboard costs, measured in a real Jupyter kernel, side by side.

1. Launch overhead: the same 2-rank launch (gloo init, one all_reduce, destroy) with the
   widget dashboard on and off, interleaved in rounds, timed from the kernel's own busy
   and idle messages for the cell; once as a bare job and once with a job whose ranks log
   20 metrics for 20 steps under a tqdm bar (so the dashboard draws rows, a plot of 20
   panels and the lasting record).
2. A rank logging 1,000 metrics a second for 10 s: how long its loop of fixed work takes
   with the dashboard on, off, and without the log calls at all; and how soon a cell
   queued behind the launch starts after the rank's loop ended (the kernel kept up).
3. A flood: 2 ranks each calling ``accelerator.log`` N times as fast as they can; the
   kernel's CPU time over the launch with the dashboard on and off, interleaved; then a
   launch about as long whose ranks log once a millisecond, so that what the calls cost is
   told apart from what any launch long enough for live widgets costs.

Prints medians and ratios, and the machine's load average before and after.

    python benchmarks/bench_dashboard.py [--rounds 15] [--storm-seconds 10] [--storm-rounds 3]
        [--flood-calls 500000] [--flood-rounds 3] [--only launch|storm|flood]
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import sys
import textwrap
import time
from pathlib import Path

from jupyter_client.manager import KernelManager

ROOT = Path(__file__).resolve().parents[1]

SETUP = """
import json, time
from notebook_launcher import notebook_launcher

def bare_job():
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    value = torch.ones(1)
    dist.all_reduce(value)
    dist.destroy_process_group()
    return value.item()

def logging_job():
    import torch, torch.distributed as dist
    from notebook_launcher import Accelerator
    accelerator = Accelerator()
    value = torch.ones(1)
    dist.all_reduce(value)
    for step in accelerator.tqdm(range(20), desc="training"):
        accelerator.log({f"metric_{i}": 1.0 / (step + 1 + i) for i in range(20)}, step=step)
    return value.item()

def flood(calls):
    from notebook_launcher import Accelerator
    accelerator = Accelerator()
    for step in range(calls):
        accelerator.log({"loss": 1.0 / (step + 1)}, step=step)

def paced_flood(seconds):
    from notebook_launcher import Accelerator
    accelerator = Accelerator()
    started = time.perf_counter()
    step = 0
    while time.perf_counter() - started < seconds:
        accelerator.log({"loss": 1.0 / (step + 1)}, step=step)
        step += 1
        time.sleep(0.001)

def kernel_cpu(launch):
    # The kernel's own CPU time over a launch: what watching (and the dashboard) costs it.
    started = time.process_time()
    result = launch()
    return [*result, time.process_time() - started]

def timed(job, dashboard):
    started = time.perf_counter()
    notebook_launcher(job, num_processes=2, start_method="fork", output="none", dashboard=dashboard)
    return time.perf_counter() - started

def work(n):
    total = 0
    for i in range(n):
        total += i * i
    return total

def calibrate(rate):
    # The work that takes 1/rate s here; sized once, so every variant does the same work.
    n, spent = 1000, 0.0
    while spent < 0.5:
        n *= 2
        started = time.perf_counter(); work(n); spent = time.perf_counter() - started
    return max(1, int(n / rate / spent))

def storm(per_step, steps, log):
    from notebook_launcher import Accelerator
    accelerator = Accelerator()
    in_log = 0.0  # time spent inside log(): where a kernel that cannot keep up would block
    cpu_started = time.process_time()  # the loop's own CPU time: unmoved by other processes
    started = time.perf_counter()
    for step in range(steps):
        work(per_step)
        if log:
            before = time.perf_counter()
            accelerator.log({"loss": 1.0 / (step + 1), "lr": 0.1}, step=step)
            in_log += time.perf_counter() - before
    return time.perf_counter() - started, in_log, time.time(), time.process_time() - cpu_started
"""


class Kernel:
    def __init__(self) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        self.manager = KernelManager(kernel_name="python3")
        self.manager.start_kernel(env=env)
        self.client = self.manager.client()
        self.client.start_channels()
        self.client.wait_for_ready(timeout=120)
        self.run(SETUP)

    def run(self, code: str, timeout: float = 600) -> str:
        return self.collect(self.client.execute(textwrap.dedent(code)), timeout)

    def busy_s(self, code: str, timeout: float = 600) -> float:
        """Seconds from the kernel's busy to its idle message for this cell (kernel clock)."""
        self.collect(self.client.execute(textwrap.dedent(code)), timeout)
        return (self.idle_at - self.busy_at).total_seconds()

    def collect(self, msg_id: str, timeout: float = 600) -> str:
        out, deadline = "", time.monotonic() + timeout
        while True:
            try:
                message = self.client.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise TimeoutError(out) from None
                continue
            if message["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = message["msg_type"], message["content"]
            if kind == "stream" and content["name"] == "stdout":
                out += content["text"]
            elif kind == "error":
                raise RuntimeError("\n".join(content["traceback"]))
            elif kind == "status" and content["execution_state"] == "busy":
                self.busy_at = message["header"]["date"]
            elif kind == "status" and content["execution_state"] == "idle":
                self.idle_at = message["header"]["date"]
                return out

    def close(self) -> None:
        self.client.stop_channels()
        self.manager.shutdown_kernel(now=True)


def launch_overhead(kernel: Kernel, job: str, rounds: int) -> dict[str, list[float]]:
    kernel.run(f"timed({job}, True); timed({job}, False)")  # warm: imports, forkserver
    times: dict[str, list[float]] = {"on": [], "off": []}
    for index in range(rounds):
        order = ("on", "off") if index % 2 == 0 else ("off", "on")
        for variant in order:
            times[variant].append(kernel.busy_s(
                f"notebook_launcher({job}, num_processes=2, start_method='fork', output='none', "
                f"dashboard={variant == 'on'})"
            ))  # fmt: skip
    return times


Series = dict[str, list[float]]


def flood_report(kernel: Kernel, calls: int, rounds: int) -> None:
    print(
        f"\n2 ranks x {calls:,} accelerator.log calls, fork, {rounds} interleaved rounds (medians):"
    )
    for dashboard in (True, False):  # warm: imports, the first widgets
        kernel.run(
            f"notebook_launcher(flood, args=(1000,), num_processes=2, start_method='fork', output='none', dashboard={dashboard})"
        )
    cpu, wall = flood_rounds(kernel, f"flood, args=({calls},)", rounds)
    on, off = statistics.median(cpu["on"]), statistics.median(cpu["off"])
    print(
        f"  kernel CPU s: dashboard off {off:.3f}   on {on:.3f}   ratio {on / off:.3f}x"
        f"   (rounds off {', '.join(f'{v:.3f}' for v in cpu['off'])}; on {', '.join(f'{v:.3f}' for v in cpu['on'])})"
    )
    w_on, w_off = statistics.median(wall["on"]), statistics.median(wall["off"])
    print(f"  cell busy s:  dashboard off {w_off:.2f}   on {w_on:.2f}   ratio {w_on / w_off:.3f}x")
    # A launch about as long (its ranks log once a millisecond): what any launch long enough
    # for live widgets costs, calls or not; the difference is what the flood's calls cost.
    seconds = max(0.5, w_off - 0.3)  # the cell's busy time less the launch's start and end
    short, _ = flood_rounds(kernel, f"paced_flood, args=({seconds:.2f},)", rounds)
    s_on, s_off = statistics.median(short["on"]), statistics.median(short["off"])
    print(f"  a {seconds:.2f} s launch logging once a millisecond: off {s_off:.3f}   on {s_on:.3f}")
    # No ratio: both differences lie within the rounds' spread of zero on a quiet machine.
    print(
        f"  what the flood's calls add to the kernel's CPU: off {off - s_off:+.3f} s   on {on - s_on:+.3f} s"
    )


def flood_rounds(kernel: Kernel, job: str, rounds: int) -> tuple[Series, Series]:
    """Kernel CPU and cell busy time of a launch of ``job``, dashboard on and off, interleaved."""
    cpu: Series = {"on": [], "off": []}
    wall: Series = {"on": [], "off": []}
    for index in range(rounds):
        order = ("on", "off") if index % 2 == 0 else ("off", "on")
        for variant in order:
            out = kernel.run(
                f"print(json.dumps(kernel_cpu(lambda: [notebook_launcher({job}, num_processes=2, "
                f"start_method='fork', output='none', dashboard={variant == 'on'})])))"
            )
            cpu[variant].append(json.loads(out.strip().splitlines()[-1])[-1])
            wall[variant].append((kernel.idle_at - kernel.busy_at).total_seconds())
    return cpu, wall


def log_storm(
    kernel: Kernel, seconds: float, rounds: int
) -> tuple[Series, Series, Series, Series, Series]:
    variants = {
        "dashboard on": ("True", True),
        "dashboard off": ("False", True),
        "no log calls": ("False", False),
    }
    loops: dict[str, list[float]] = {name: [] for name in variants}
    in_log: dict[str, list[float]] = {name: [] for name in variants}
    cpu: dict[str, list[float]] = {name: [] for name in variants}
    kernel_cpu: dict[str, list[float]] = {name: [] for name in variants}
    gaps: dict[str, list[float]] = {name: [] for name in variants}
    per_step = int(kernel.run("print(calibrate(1000))").strip())
    steps = int(seconds * 1000)
    for index in range(rounds):
        order = list(variants.items())
        order = order[index % len(order) :] + order[: index % len(order)]  # rotate: noise hits all
        for name, (dashboard, log) in order:
            launch = kernel.client.execute(
                f"print(json.dumps(kernel_cpu(lambda: notebook_launcher(storm, args=({per_step}, {steps}, {log}), "
                f"num_processes=1, start_method='fork', dashboard={dashboard}))))"
            )
            queued = kernel.client.execute("print(time.time())")  # waits behind the launch
            loop_s, log_s, loop_end, cpu_s, kernel_s = json.loads(
                kernel.collect(launch).strip().splitlines()[-1]
            )
            cpu[name].append(cpu_s)
            kernel_cpu[name].append(kernel_s)
            started = float(kernel.collect(queued).strip())
            loops[name].append(loop_s)
            in_log[name].append(log_s / loop_s)
            gaps[name].append(started - loop_end)
    return loops, cpu, in_log, gaps, kernel_cpu


def storm_report(kernel: Kernel, seconds: float, rounds: int) -> None:
    print(f"\n1 rank logging 1,000 metrics/s for {seconds:g} s, {rounds} rotated rounds (medians):")
    loops, cpu, in_log, gaps, watching = log_storm(kernel, seconds, rounds)
    base, bare = statistics.median(loops["dashboard off"]), statistics.median(loops["no log calls"])
    cpu_base = statistics.median(cpu["dashboard off"])
    steps = int(seconds * 1000)
    print("  variant        loop wall s  logs/s  vs off  vs no log   loop CPU s  vs off"
          "  in log()  kernel CPU s  next cell after loop end")  # fmt: skip
    for name, values in loops.items():
        wall, used = statistics.median(values), statistics.median(cpu[name])
        print(
            f"  {name:14s} {wall:11.3f} {steps / wall:7.0f} {wall / base:6.3f}x {wall / bare:8.3f}x"
            f" {used:11.3f} {used / cpu_base:6.3f}x {statistics.median(in_log[name]):8.2%}"
            f" {statistics.median(watching[name]):13.3f}"
            f"  {statistics.median(gaps[name]):.3f} s (max {max(gaps[name]):.3f} s)"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--storm-seconds", type=float, default=10.0)
    parser.add_argument("--storm-rounds", type=int, default=3)
    parser.add_argument("--flood-calls", type=int, default=500_000)
    parser.add_argument("--flood-rounds", type=int, default=3)
    parser.add_argument("--only", choices=("launch", "storm", "flood"), help="run one of the parts")
    options = parser.parse_args()
    print(
        f"load average before: {' '.join(f'{v:.2f}' for v in os.getloadavg())} on {os.cpu_count()} CPUs"
    )
    kernel = Kernel()
    try:
        if options.only in (None, "launch"):
            print(
                f"2-rank launch in a Jupyter kernel, fork, {options.rounds} interleaved rounds (median s):"
            )
        for job in ("bare_job", "logging_job") if options.only in (None, "launch") else ():
            times = launch_overhead(kernel, job, options.rounds)
            on, off = statistics.median(times["on"]), statistics.median(times["off"])
            print(
                f"  {job:12s} dashboard off {off:.3f}   dashboard on {on:.3f}   ratio {on / off:.2f}x"
            )
        if options.only in (None, "storm"):
            storm_report(kernel, options.storm_seconds, options.storm_rounds)
        if options.only in (None, "flood"):
            flood_report(kernel, options.flood_calls, options.flood_rounds)
    finally:
        kernel.close()
        print(f"load average after: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

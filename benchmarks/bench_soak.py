"""Sustained use from real Jupyter kernels: what a hundred launches and a few hundred session
cells leave behind.

1. Launches: one kernel runs ``notebook_launcher()`` (2 CPU ranks: a gloo group, one all_reduce) ``--launches``
   times in a row. After each, the kernel's open descriptors, threads, child processes
   (multiprocessing's own helpers aside), resident memory and the launch's time are noted.
   Bounds, from launch 10 to the last: at most 2 more descriptors and 2 more threads, no
   child left, at most 30 MB more memory; the median launch time of the last ten is at most
   1.5x that of launches 10 to 19.
2. Cells: another kernel runs ``--cells`` ``%%distributed`` cells on a session of 2 CPU
   ranks, in turn: a print, an all_reduce, a 1 MB tensor made and dropped; every 50th cell
   fails on rank 1 while rank 0 waits in an all_reduce (the process group is rebuilt). Each
   rank's resident memory is read after cell 30 and after the last; a cell's time is from
   the notebook client's request to the kernel's idle, and each good cell is followed by an
   empty cell of the kernel's own, timed as the peer (the machine's load changes over a run).
   Bounds: each rank grows at most 50 MB; the median of (cell / empty kernel cell) over the
   last 30 good cells is at most 1.5x that over cells 30 to 59; the
   session is alive at the end. Each rank's descriptors and threads gained are shown too.

The figures and a pass or fail per bound are printed; the exit status is 1 when a bound
fails. On a busy machine the times are noisy: the time bounds compare medians within one run.

    PYTHONPATH=. python benchmarks/bench_soak.py [--launches 100] [--cells 300]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.support.kernel_driver import RunningKernel

LAUNCHES = """
import json, os, threading, time
import psutil
import torch
from notebook_launcher import notebook_launcher

def reduce_once():
    torch.distributed.init_process_group("gloo")
    t = torch.ones(4)
    torch.distributed.all_reduce(t)
    torch.distributed.destroy_process_group()
    return t.sum().item()

def helpers_aside(process):
    kept = []
    for child in process.children(recursive=True):
        try:
            line = " ".join(child.cmdline())
        except psutil.Error:
            continue
        if "forkserver import main" in line or "resource_tracker" in line:
            continue
        kept.append(child.pid)
    return kept

me = psutil.Process()
rows = []
for number in range(1, {launches} + 1):
    started = time.perf_counter()
    value = notebook_launcher(reduce_once, num_processes=2, hardware="cpu", dashboard=False)
    took = time.perf_counter() - started
    assert value == 8.0, value
    rows.append(dict(
        launch=number, seconds=took, fds=len(os.listdir("/proc/self/fd")),
        threads=me.num_threads(), children=len(helpers_aside(me)), rss=me.memory_info().rss,
    ))
print("ROWS " + json.dumps(rows))
"""

GOOD_CELLS = [
    "%%distributed\nprint('cell', {n}, 'on rank', rank)",
    "%%distributed\nt = torch.ones(8) * (rank + 1)\ntorch.distributed.all_reduce(t)\nt.sum().item()",
    "%%distributed\nbig = torch.empty(262144)\nbig.fill_(rank)\nchecked = big.sum().item()\ndel big",
]
FAILING_CELL = (
    "%%distributed\nt = torch.ones(8)\nif rank == 1:\n    raise ValueError('planned failure')\n"
    "torch.distributed.all_reduce(t)"
)


def run_launches(count: int) -> dict[str, float]:
    kernel = RunningKernel()
    try:
        cell = kernel.run(LAUNCHES.format(launches=count), timeout=3600)
        if cell.error is not None:
            raise RuntimeError(f"the launches failed: {cell.error['evalue']}")
        rows = json.loads(cell.stdout.split("ROWS ", 1)[1].splitlines()[0])
    finally:
        kernel.shutdown()
    tenth, last = rows[9], rows[-1]
    early = statistics.median(r["seconds"] for r in rows[9:19])
    late = statistics.median(r["seconds"] for r in rows[-10:])
    return {
        "fds_gained": last["fds"] - tenth["fds"],
        "threads_gained": last["threads"] - tenth["threads"],
        "children_left": last["children"],
        "rss_gained_mb": (last["rss"] - tenth["rss"]) / 2**20,
        "launch_s_early": early,
        "launch_s_late": late,
        "launch_time_ratio": late / early,
    }


def run_cells(count: int) -> dict[str, float]:
    kernel = RunningKernel()
    try:
        setup = kernel.run("%load_ext notebook_launcher\n%distributed start -n 2 --hardware cpu")
        if setup.error is not None:
            raise RuntimeError(f"the session did not start: {setup.error['evalue']}")
        found = kernel.run("from notebook_launcher import Session\nSession.current().pids")
        pids = json.loads(found.result or "[]")
        ranks = [psutil.Process(pid) for pid in pids]
        times: dict[int, float] = {}
        plain: dict[int, float] = {}  # the kernel's own empty cell, right after each good one
        failed_as_planned = 0
        rss_30: list[int] = []
        held_30: list[tuple[int, int]] = []  # each rank's (descriptors, threads)
        for n in range(1, count + 1):
            failing = n % 50 == 0
            code = FAILING_CELL if failing else GOOD_CELLS[n % len(GOOD_CELLS)].format(n=n)
            started = time.perf_counter()
            cell = kernel.run(code)
            took = time.perf_counter() - started
            if failing:
                if cell.error is None or "planned failure" not in cell.error["evalue"]:
                    raise RuntimeError(f"cell {n} should have failed: {cell}")
                failed_as_planned += 1
            else:
                if cell.error is not None:
                    raise RuntimeError(f"cell {n} failed: {cell.error['evalue']}")
                times[n] = took
                started = time.perf_counter()
                kernel.run("pass")
                plain[n] = time.perf_counter() - started
            if n == 30:
                rss_30 = [rank.memory_info().rss for rank in ranks]
                held_30 = [(rank.num_fds(), rank.num_threads()) for rank in ranks]
        rss_end = [rank.memory_info().rss for rank in ranks]
        held_end = [(rank.num_fds(), rank.num_threads()) for rank in ranks]
        status = kernel.run("%distributed status").stdout
    finally:
        if kernel.manager.is_alive():
            kernel.run("%distributed stop")
        kernel.shutdown()
    good = sorted(times)
    early_cells = [n for n in good if 30 <= n < 60]
    late_cells = good[-30:]
    early = statistics.median(times[n] for n in early_cells)
    late = statistics.median(times[n] for n in late_cells)
    # The machine's load changes over a run: each cell is weighed against the kernel's own
    # empty cell timed right after it, and those ratios are compared.
    early_rel = statistics.median(times[n] / plain[n] for n in early_cells)
    late_rel = statistics.median(times[n] / plain[n] for n in late_cells)
    figures = {
        "failing_cells": failed_as_planned,
        "cell_ms_early": early * 1000,
        "cell_ms_late": late * 1000,
        "plain_cell_ms_early": statistics.median(plain[n] for n in early_cells) * 1000,
        "plain_cell_ms_late": statistics.median(plain[n] for n in late_cells) * 1000,
        "cell_vs_plain_early": early_rel,
        "cell_vs_plain_late": late_rel,
        "cell_time_ratio": late_rel / early_rel,
        "alive_at_end": float("alive (pids" in status),
    }
    for rank, (before, after) in enumerate(zip(rss_30, rss_end)):
        figures[f"rank{rank}_rss_gained_mb"] = (after - before) / 2**20
        figures[f"rank{rank}_rss_end_mb"] = after / 2**20
    for rank, (before, after) in enumerate(zip(held_30, held_end)):
        # Figures only (no bound): a process group rebuilt after each failing cell must not
        # leave its old connections or threads behind.
        figures[f"rank{rank}_fds_gained"] = after[0] - before[0]
        figures[f"rank{rank}_threads_gained"] = after[1] - before[1]
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launches", type=int, default=100)
    parser.add_argument("--cells", type=int, default=300)
    parser.add_argument("--only", choices=("launches", "cells"), help="run one part alone")
    args = parser.parse_args()
    print(f"machine load (1, 5, 15 min): {psutil.getloadavg()}, {psutil.cpu_count()} cores")
    results: list[tuple[str, bool]] = []

    if args.only != "cells":
        results += launch_results(args.launches)
    if args.only != "launches":
        results += cell_results(args.cells)
    print()
    for name, passed in results:
        print(f"{'PASS' if passed else 'FAIL'}  {name}")
    return 0 if all(passed for _, passed in results) else 1


def launch_results(count: int) -> list[tuple[str, bool]]:
    launches = run_launches(count)
    print(f"\n{count} launches in one kernel (from launch 10 to {count}):")
    for key, value in launches.items():
        print(f"  {key:22} {value:10.3f}")
    return [
        ("launches: at most 2 fds gained", launches["fds_gained"] <= 2),
        ("launches: at most 2 threads gained", launches["threads_gained"] <= 2),
        ("launches: no child process left", launches["children_left"] == 0),
        ("launches: at most 30 MB gained", launches["rss_gained_mb"] <= 30),
        ("launches: launch time does not grow (<= 1.5x)", launches["launch_time_ratio"] <= 1.5),
    ]


def cell_results(count: int) -> list[tuple[str, bool]]:
    cells = run_cells(count)
    print(f"\n{count} %%distributed cells on one session (from cell 30 to {count}):")
    for key, value in cells.items():
        print(f"  {key:22} {value:10.3f}")
    results = [
        (
            f"cells: rank {r} grew at most 50 MB",
            cells[f"rank{r}_rss_gained_mb"] <= 50,
        )
        for r in (0, 1)
    ]
    results += [
        ("cells: cell time does not grow (<= 1.5x)", cells["cell_time_ratio"] <= 1.5),
        ("cells: the session is alive at the end", cells["alive_at_end"] == 1.0),
    ]
    return results


if __name__ == "__main__":
    sys.exit(main())

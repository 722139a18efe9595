"""A launch ended from outside (its ``timeout=``, the stop button) says where each rank was:
the cell and line (file:line in a script) and the function, such as ``all_reduce``.

Each rank says when its main thread is where the test wants it (a thread of the test's own
in the rank watches it), so nothing here waits for a duration."""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import pytest

from notebook_launcher import LaunchTimeoutError, notebook_launcher
from notebook_launcher.launcher import whereabouts
from notebook_launcher.launcher.events import OutputLine
from tests.conftest import run_script

SLOW = pytest.mark.slow(
    reason="waits out a launch's timeout= of 20-45 s, long enough for a busy machine's ranks "
    "to reach where they hang"
)

# A rank says "at <what>" once its main thread's innermost frame passes ``check``.
SAY_WHEN = """
def say_when(what, check):
    import sys, threading, time
    main = threading.get_ident()
    def watch():
        while True:
            frame = sys._current_frames().get(main)
            if frame is not None and check(frame):
                print("at " + what, flush=True)
                return
            time.sleep(0.01)
    threading.Thread(target=watch, daemon=True).start()
"""

HANG = """import time
import torch
import torch.distributed as dist

def hang():
    dist.init_process_group("gloo")
    if dist.get_rank() == 0:
        say_when("sleep", lambda f: f.f_lineno - f.f_code.co_firstlineno == 4)
        time.sleep(600)
    say_when("all_reduce", lambda f: f.f_code.co_name == "all_reduce")
    dist.all_reduce(torch.ones(1))
"""
SLEEP_LINE, ALL_REDUCE_LINE = 9, 11


def _line_of(text: str, source: str = HANG) -> int:
    return next(n for n, line in enumerate(source.splitlines(), 1) if text in line)


assert _line_of("time.sleep(600)") == SLEEP_LINE and _line_of("all_reduce(torch") == ALL_REDUCE_LINE


@SLOW
def test_a_script_names_the_file_and_line(tmp_path):
    source = (
        SAY_WHEN
        + HANG
        + (
            "\nif __name__ == '__main__':\n"
            "    from notebook_launcher import LaunchTimeoutError, notebook_launcher\n"
            "    try:\n"
            "        notebook_launcher(hang, num_processes=2, timeout=45)\n"
            "    except LaunchTimeoutError as error:\n"
            "        print(error)\n"
        )
    )
    out = run_script(source, tmp_path)
    offset = len(SAY_WHEN.splitlines())
    script = tmp_path / "script.py"
    assert "at sleep" in out and "at all_reduce" in out, out
    assert (
        f"  rank 0 was in {script}:{SLEEP_LINE + offset} (in hang), in time.sleep\n"
        f"  rank 1 was in {script}:{ALL_REDUCE_LINE + offset} (in hang), in all_reduce "
        "(waiting for the others)\n"
    ) in out, out


def stuck_or_deaf():
    """Rank 0 blocks every signal it can and ignores SIGUSR1: it still says where it is.
    Rank 1 is stuck in C code that holds Python's lock: it cannot say."""
    import ctypes

    if os.environ["RANK"] == "0":
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        signal.pthread_sigmask(signal.SIG_BLOCK, set(signal.Signals) - {signal.SIGKILL})
        print("deaf", flush=True)
        time.sleep(600)
    # Said from C right before the C call that keeps Python's lock (PyDLL): no Python code of
    # the rank runs in between, so once the line is seen the rank can no longer answer.
    libc = ctypes.PyDLL(None)
    libc.write(1, b"stuck\n", 6)
    libc.sleep(600)


@SLOW
def test_a_rank_that_cannot_answer_is_said_not_to_have_and_the_launch_ends_in_its_bound(
    leak_check,
):
    seen: set[str] = set()
    both = threading.Event()

    class Lines:
        def on_event(self, event):  # type: ignore[no-untyped-def]
            if isinstance(event, OutputLine) and event.text in ("deaf", "stuck"):
                seen.add(event.text)
                if len(seen) == 2:
                    both.set()

    started = time.monotonic()
    with pytest.raises(LaunchTimeoutError) as caught:
        notebook_launcher(stuck_or_deaf, num_processes=2, timeout=30, observers=[Lines()])
    elapsed = time.monotonic() - started
    assert both.is_set()
    message = str(caught.value)
    assert re.search(
        r"Where they were:\n"
        r"  rank 0 was in .*test_hang_whereabouts\.py:\d+ \(in stuck_or_deaf\), in time\.sleep\n"
        r"  rank 1 did not say where it was\n",
        message,
    ), message
    # The timeout, the wait for the answers, SIGTERM: a rank stuck in C holding Python's
    # lock dies of SIGTERM's default action at once.
    assert elapsed < 30 + whereabouts.ANSWER_WAIT_S + 30, elapsed


def one_returns_one_sleeps():
    if os.environ["RANK"] == "1":
        print("sleeping", flush=True)
        time.sleep(600)


@SLOW
def test_a_rank_that_already_returned_is_not_asked(leak_check):
    with pytest.raises(LaunchTimeoutError) as caught:
        notebook_launcher(one_returns_one_sleeps, num_processes=2, timeout=20)
    message = str(caught.value)
    assert "rank(s) 1 were still running" in message
    assert "Where they were:\n  rank 1 was in " in message and "rank 0 was" not in message


def test_a_second_stop_while_the_ranks_are_asked_ends_the_launch_at_once(monkeypatch, leak_check):
    # No safety net for the answers: only the second press can end the wait for rank 1.
    monkeypatch.setattr(whereabouts, "ANSWER_WAIT_S", 600.0)
    main = threading.get_ident()
    ready, answered = threading.Event(), threading.Event()
    seen: set[str] = set()
    original = whereabouts.Asker.answered

    def answered_and_tell(self, rank, answer):  # type: ignore[no-untyped-def]
        original(self, rank, answer)
        answered.set()

    monkeypatch.setattr(whereabouts.Asker, "answered", answered_and_tell)

    class Lines:
        def on_event(self, event):  # type: ignore[no-untyped-def]
            if isinstance(event, OutputLine) and event.text in ("deaf", "stuck"):
                seen.add(event.text)
                if len(seen) == 2:
                    ready.set()

    def press_twice():
        if not ready.wait(300):
            return
        signal.pthread_kill(main, signal.SIGINT)  # the stop button
        if answered.wait(300):  # rank 0 answered; rank 1 never will
            signal.pthread_kill(main, signal.SIGINT)  # pressed again

    pusher = threading.Thread(target=press_twice)
    pusher.start()
    with pytest.raises(KeyboardInterrupt) as caught:
        notebook_launcher(stuck_or_deaf, num_processes=2, timeout=300, observers=[Lines()])
    pusher.join()
    message = str(caught.value)
    assert re.search(
        r"^the launch was stopped; every rank has been ended\. Where they were:\n"
        r"  rank 0 was in .*:\d+ \(in stuck_or_deaf\), in time\.sleep\n"
        r"  rank 1 did not say where it was$",
        message,
    ), message

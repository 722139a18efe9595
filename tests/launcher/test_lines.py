from __future__ import annotations

import io
import sys

from notebook_launcher.launcher.events import LaunchStarted, OutputLine
from notebook_launcher.launcher.lines import LineSplitter
from notebook_launcher.launcher.printer import TextPrinter


def test_partial_writes_become_one_line():
    splitter = LineSplitter()
    assert splitter.feed(b"hel") == []
    assert splitter.feed(b"lo wor") == []
    assert splitter.feed(b"ld\nnext") == [("hello world", False)]
    assert splitter.close() == [("next", False)]


def test_carriage_returns_give_progress_states_then_the_final_line():
    splitter = LineSplitter()
    pieces = splitter.feed(b"\r 10%|#   |\r 50%|##  |\r100%|####|\n")
    assert pieces == [(" 10%|#   |", True), (" 50%|##  |", True), ("100%|####|", False)]


def test_a_bar_ended_by_carriage_return_then_newline_keeps_its_last_state():
    splitter = LineSplitter()
    assert splitter.feed(b"100%|####|\r")[-1] == ("100%|####|", True)
    assert splitter.feed(b"\n") == [("100%|####|", False)]


def test_windows_line_ends_are_single_breaks():
    assert LineSplitter().feed(b"a\r\nb\r\n") == [("a", False), ("b", False)]


def test_utf8_split_across_reads_is_decoded_whole():
    splitter = LineSplitter()
    data = "déjà vu\n".encode()
    assert splitter.feed(data[:2]) == []
    assert splitter.feed(data[2:]) == [("déjà vu", False)]


def test_invalid_bytes_are_replaced_not_fatal():
    assert LineSplitter().feed(b"bad \xff byte\n") == [("bad \ufffd byte", False)]


def capture(printer: TextPrinter, *events) -> tuple[str, str]:
    out, err = io.StringIO(), io.StringIO()
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = out, err
    try:
        for event in events:
            printer.on_event(event)
    finally:
        sys.stdout, sys.stderr = saved
    return out.getvalue(), err.getvalue()


def test_lines_get_the_rank_prefix_and_their_stream():
    out, err = capture(
        TextPrinter(), OutputLine(0, "stdout", "hi", False), OutputLine(1, "stderr", "warn", False)
    )
    assert out == "[rank0]: hi\n"
    assert err == "[rank1]: warn\n"


def test_torchrun_style_prefix_templates_are_honoured():
    out, _ = capture(
        TextPrinter(prefix_template="<${role_name}:${rank}> "), OutputLine(3, "stdout", "x", False)
    )
    assert out == "<default:3> x\n"


def test_progress_states_are_throttled_but_the_final_line_is_kept():
    events = [OutputLine(0, "stderr", f"{i}%", True) for i in range(100)]
    _, err = capture(TextPrinter(), *events, OutputLine(0, "stderr", "100%", False))
    assert err.splitlines() == ["[rank0]: 0%", "[rank0]: 100%"]


def test_main_mode_shows_rank_zero_only_and_none_shows_nothing():
    lines = [OutputLine(0, "stdout", "zero", False), OutputLine(1, "stdout", "one", False)]
    assert capture(TextPrinter("main"), *lines)[0] == "[rank0]: zero\n"
    assert capture(TextPrinter("none"), *lines) == ("", "")


def test_a_start_method_fallback_is_told_in_one_line():
    _, err = capture(
        TextPrinter(),
        LaunchStarted(2, "forkserver", "cuda", "no", "CUDA was initialised in this kernel"),
    )
    assert (
        err
        == "notebook_launcher: using start_method='forkserver' because CUDA was initialised in this kernel.\n"
    )


def test_one_huge_line_without_a_newline_is_never_copied_while_it_grows():
    # Joining the pieces only when the line ends keeps a 100 MB line linear: before, each
    # read re-copied everything held so far (quadratic: 47 s for 100 MB).
    splitter = LineSplitter()
    chunk = b"x" * 65536
    for _ in range(200):
        assert splitter.feed(chunk) == []
    assert splitter.pending_pieces == 200  # held as received, none joined yet
    [(line, is_progress)] = splitter.feed(b"\n")
    assert len(line) == 200 * 65536 and not is_progress
    assert splitter.pending_pieces == 0


def test_an_unterminated_huge_line_is_still_given_at_the_end():
    splitter = LineSplitter()
    for _ in range(10):
        splitter.feed(b"y" * 1000)
    assert splitter.close() == [("y" * 10000, False)]

"""What is shown of a long line: its start, and how much was left out."""

from __future__ import annotations

from notebook_launcher.shown_text import LINE_CHARS, cut, cut_lines


def test_a_line_within_the_limit_is_shown_whole():
    assert cut("x" * LINE_CHARS) == "x" * LINE_CHARS


def test_a_longer_line_says_how_much_was_left_out():
    assert cut("x" * (LINE_CHARS + 1234)) == "x" * LINE_CHARS + "… (1,234 more characters)"


def test_every_long_line_of_a_text_is_cut_and_the_others_kept():
    text = "Traceback (most recent call last):\n  File ...\nValueError: " + "e" * 5000
    assert cut_lines(text).splitlines() == [
        "Traceback (most recent call last):",
        "  File ...",
        ("ValueError: " + "e" * 5000)[:LINE_CHARS] + "… (3,012 more characters)",
    ]

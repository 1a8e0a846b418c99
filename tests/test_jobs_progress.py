"""The job progress bar: rows/s and ETA from a fake clock, throttled redraws, silent off a terminal."""

from __future__ import annotations

import io

from triton_npu_client._jobs._progress import Progress, format_duration


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_rate_and_eta_count_this_run_only() -> None:
    clock = Clock()
    bar = Progress(total=1000, done=200, enabled=True, stream=io.StringIO(), clock=clock)
    clock.now += 4.0
    bar.update(380, 20)  # 400 rows in 4 s this run; 600 of 1000 done in all
    line = bar.line()
    assert "600/1,000 rows" in line
    assert "60.0%" in line
    assert "100 rows/s" in line
    assert "ETA 4s" in line  # 400 rows left at 100 rows/s
    assert "20 errors" in line


def test_unknown_total_shows_a_count_without_eta() -> None:
    clock = Clock()
    bar = Progress(total=None, enabled=True, stream=io.StringIO(), clock=clock)
    clock.now += 2.0
    bar.update(50, 0)
    assert bar.line().startswith("50 rows")
    assert "25 rows/s" in bar.line()
    assert "ETA" not in bar.line()


def test_no_terminal_no_bar() -> None:
    stream = io.StringIO()
    bar = Progress(total=10, stream=stream)
    bar.update(10, 0)
    bar.close()
    assert not bar.enabled
    assert stream.getvalue() == ""


def test_on_a_terminal_redraws_are_throttled_and_the_line_ends() -> None:
    clock = Clock()
    stream = Tty()
    bar = Progress(total=100, stream=stream, interval_s=1.0, clock=clock)
    assert bar.enabled
    for i in range(1, 51):
        clock.now += 0.1  # 50 updates over 5 s
        bar.update(i, 0)
    bar.close()
    text = stream.getvalue()
    assert 5 <= text.count("\r") <= 7  # about one redraw a second, plus the final one
    assert text.endswith("\n")
    assert "50/100 rows" in text


def test_format_duration() -> None:
    assert [format_duration(s) for s in (0, 42.4, 185, 7260)] == ["0s", "42s", "3m05s", "2h01m"]

"""The console's lines of a worker's output (launcher/progress.py): whole lines as a
terminal leaves them, and a progress bar's updates at most every PROGRESS_EVERY_S."""

from __future__ import annotations

import pytest
from test_distributed_init import FakeClock
from test_launcher_e2e import E2E, PY, e2e  # noqa: F401

from resilient_train.launcher.console import ConsoleLines


def test_a_bar_shows_its_latest_update_every_interval_and_its_last_at_the_newline() -> None:
    clock = FakeClock()
    lines = ConsoleLines(every_s=10.0, clock=clock)
    assert lines.feed(b"epoch 1\n") == [("epoch 1", True)]
    assert lines.feed(b"\r 10%") == []                    # may still be arriving
    assert lines.feed(b"\r 20%") == [(" 10%", False)]     # whole once the next begins
    clock.now = 4.0
    assert lines.feed(b"\r 30%\r 40%") == []              # within the interval
    clock.now = 10.5
    assert lines.feed(b"\r 50%\r 6") == [(" 50%", False)]  # the latest whole update
    assert lines.feed(b"0%\r100%|done\n") == [("100%|done", True)]
    assert lines.feed(b"\r 1%") == [] and lines.feed(b"\r") == [(" 1%", False)]  # afresh


def test_lines_split_anywhere_and_windows_endings_come_out_whole() -> None:
    lines = ConsoleLines()
    got = [p for chunk in (b"al", b"pha\r\nbe", b"ta\n\nga", b"mma") for p in lines.feed(chunk)]
    assert got == [("alpha", True), ("beta", True), ("", True)]
    assert lines.flush() == [("gamma", True)] and lines.flush() == []


@pytest.mark.slow
def test_a_workers_progress_bar_reaches_the_console_as_it_draws(e2e: E2E) -> None:
    bar = ("import sys\n"
           "for i in range(1, 201):\n"
           "    sys.stderr.write(f'\\rtraining {i}/200'); sys.stderr.flush()\n"
           "print(); print('done', flush=True)\n")
    status, _, out = e2e.launch(script=[PY, "-c", bar])
    assert status == 0, out
    shown = [line for line in out.splitlines() if line.startswith("[workerpool0-0]")]
    assert shown[-2:] == ["[workerpool0-0] training 200/200", "[workerpool0-0] done"], shown
    assert all("\r" not in line for line in shown)
    log = (e2e.job_dir() / "logs" / "attempt-1" / "workerpool0-0.log").read_bytes()
    assert log.count(b"\rtraining") == 200   # the log keeps every update

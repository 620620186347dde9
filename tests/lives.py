"""Several runs ("lives") of test scripts as processes forked from a warm server that has
imported torch (tests/preloads.py), instead of one ``python script.py`` each: a test that runs
a script, fails it, then reruns it pays torch's imports (3-5 CPU-seconds with the
``torch._dynamo`` that an optimizer's first use imports, most of a short run's cost) once
per test process, not once per run.

Each life is a process of its own, started as ``python SCRIPT ARGS`` starts one: its own
environment, working directory, ``sys.argv``, ``sys.path[0]`` and output files, run as
``__main__``, exiting as the interpreter exits (``atexit`` handlers, an uncaught exception's
traceback and exit 1, ``sys.exit``'s status). It is forked by the launcher's own client
(``launcher/preload.py``), which forks only what fits (the same start-up environment as the
server's, modules it imported) and starts a server of its own otherwise. What a life shares
with its siblings is what the imports left behind; the library is imported by each life,
as by a fresh process. Not for a script whose start-up is the thing tested.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import preloads

from resilient_train.launcher.preload import Forked, Preloader

# What the server has imported before it forks: torch, and what an optimizer's first step
# imports.
PRELOAD = preloads.MODULES


@dataclass(frozen=True)
class Life:
    """One run: ``python argv[0] argv[1:]`` with ``env`` (the whole environment)."""

    argv: Sequence[str]
    env: Mapping[str, str]
    cwd: str | None = None


def run_lives(lives: Sequence[Life], *, together: bool = False, timeout: float = 120.0,
              preload: Sequence[str] = PRELOAD) -> list[subprocess.CompletedProcess[str]]:
    """Run ``lives`` (in turn, or all at once) and return each one's status and output as
    ``subprocess.run(..., capture_output=True, text=True)`` would. A life killed by a signal
    has the negative signal number as its status. Past ``timeout`` seconds, every life
    still running is killed and the test fails. The lives are forked from the warm server
    of the first life's start-up environment, where they fit it."""
    preloader = Preloader(preload, {}, shared=preloads.server_for(lives[0].env))
    deadline = time.monotonic() + timeout
    started: list[Forked | subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory(prefix="lives-") as tmp:
        outputs = [(open(os.path.join(tmp, f"{i}.out"), "wb+"),
                    open(os.path.join(tmp, f"{i}.err"), "wb+")) for i in range(len(lives))]
        try:
            for life, (out, err) in zip(lives, outputs):
                started.append(_start(preloader, life, out, err))
                if not together:
                    _wait(started[-1], deadline, lives)
            codes = [_wait(proc, deadline, lives) for proc in started]
        finally:
            for proc in started:
                if proc.returncode is None:
                    _kill(proc)
            preloader.close()
        results = []
        for life, code, (out, err) in zip(lives, codes, outputs):
            out.seek(0)
            err.seek(0)
            results.append(subprocess.CompletedProcess(
                list(life.argv), code, out.read().decode(errors="replace"),
                err.read().decode(errors="replace")))
            out.close()
            err.close()
        return results


def _start(preloader: Preloader, life: Life, out: IO[bytes],
           err: IO[bytes]) -> Forked | subprocess.Popen[bytes]:
    command = [sys.executable, *life.argv]
    cwd = Path(life.cwd) if life.cwd else None
    if preloader.can_fork(command, life.env):
        forked = preloader.spawn(command, life.env, cwd, output=(out.fileno(), err.fileno()))
        if forked is not None:
            return forked
    return subprocess.Popen(command, env=dict(life.env), cwd=cwd, stdin=subprocess.DEVNULL,
                            stdout=out, stderr=err, start_new_session=True)


def _wait(proc: Forked | subprocess.Popen[bytes], deadline: float,
          lives: Sequence[Life]) -> int:
    try:
        return proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        raise AssertionError(f"lives still running after the timeout: "
                             f"{[life.argv for life in lives]}") from None


def _kill(proc: Forked | subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)   # each life leads its own session
    except OSError:
        pass
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass

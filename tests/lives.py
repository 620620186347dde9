"""Several runs ("lives") of test scripts as processes forked from one interpreter that has
imported torch, instead of one ``python script.py`` each: a test that runs a script, fails
it, then reruns it pays torch's imports (3 CPU-seconds with the ``torch._dynamo`` that an
optimizer's first use imports, most of a short run's cost) once.

Each life is a process of its own, started as ``python SCRIPT ARGS`` starts one: its own
environment, working directory, ``sys.argv``, ``sys.path[0]`` and output files, run as
``__main__``, exiting as the interpreter exits (``atexit`` handlers, an uncaught exception's
traceback and exit 1, ``sys.exit``'s status). What it shares with its siblings is what the
imports left behind, which is why the parent imports torch only: the library is imported
by each life, as by a fresh process. Not for a script whose start-up is the thing tested.

``run_lives`` is the test side; ``python lives.py SPEC`` is the parent, which forks the
lives in turn (each after the previous ended) or all at once (``together``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Life:
    """One run: ``python argv[0] argv[1:]`` with ``env`` (the whole environment)."""

    argv: Sequence[str]
    env: Mapping[str, str]
    cwd: str | None = None


# What the parent imports before it forks: torch, and what an optimizer's first step imports.
PRELOAD = ("torch", "torch._dynamo")


def run_lives(lives: Sequence[Life], *, together: bool = False, timeout: float = 120.0,
              preload: Sequence[str] = PRELOAD) -> list[subprocess.CompletedProcess[str]]:
    """Run ``lives`` (in turn, or all at once) and return each one's status and output as
    ``subprocess.run(..., capture_output=True, text=True)`` would. A life killed by a signal
    has the negative signal number as its status. Past ``timeout`` seconds, every life
    still running is killed and the test fails. The parent runs with the first life's
    environment (what torch reads as it is imported) and imports ``preload``."""
    with tempfile.TemporaryDirectory(prefix="lives-") as tmp:
        spec = {"together": together, "preload": list(preload), "lives": [
            {"argv": list(life.argv), "env": dict(life.env), "cwd": life.cwd,
             "out": os.path.join(tmp, f"{i}.out"), "err": os.path.join(tmp, f"{i}.err")}
            for i, life in enumerate(lives)], "codes": os.path.join(tmp, "codes.json")}
        path = os.path.join(tmp, "spec.json")
        with open(path, "w") as f:
            json.dump(spec, f)
        # Its own process group: on a timeout, the lives go with the parent.
        parent = subprocess.Popen([sys.executable, __file__, path], env=dict(lives[0].env),
                                  start_new_session=True, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True)
        try:
            out, _ = parent.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(parent.pid, signal.SIGKILL)
            parent.communicate()
            raise AssertionError(f"lives still running after {timeout:.0f} s: "
                                 f"{[life.argv for life in lives]}") from None
        assert parent.returncode == 0, out[-3000:]
        with open(spec["codes"]) as f:
            codes = json.load(f)
        return [subprocess.CompletedProcess(list(life.argv), code, Path(s["out"]).read_text(
                    errors="replace"), Path(s["err"]).read_text(errors="replace"))
                for life, code, s in zip(lives, codes, spec["lives"])]


def _fork_lives(spec: dict) -> dict | None:
    """In a forked life: its spec. In the parent: None, once every life has ended."""
    import importlib
    import threading

    for module in spec["preload"]:
        importlib.import_module(module)
    assert threading.active_count() == 1, "a fork must not copy a running thread's locks"
    pids: list[int] = []
    codes: list[int] = []
    for life in spec["lives"]:
        pid = os.fork()
        if pid == 0:
            return life
        pids.append(pid)
        if not spec["together"]:
            codes.append(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
    if spec["together"]:
        codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
    with open(spec["codes"], "w") as f:
        json.dump(codes, f)
    return None


def _become(life: dict) -> str:
    """Turn this forked process into ``python SCRIPT``'s: the script's path."""
    os.environ.clear()
    os.environ.update(life["env"])
    if life["cwd"]:
        os.chdir(life["cwd"])
    for fd, name, flags in ((0, os.devnull, os.O_RDONLY),
                            (1, life["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                            (2, life["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
        opened = os.open(name, flags)
        os.dup2(opened, fd)
        os.close(opened)
    script = os.path.abspath(life["argv"][0])
    sys.argv = list(life["argv"])
    sys.path[0] = os.path.dirname(script)
    return script


if __name__ == "__main__":
    with open(sys.argv[1]) as spec_file:
        _life = _fork_lives(json.load(spec_file))
    if _life is not None:
        import runpy

        # Not in a try: an exception or sys.exit ends this process as it would the script's.
        runpy.run_path(_become(_life), run_name="__main__")

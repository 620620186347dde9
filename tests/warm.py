"""A warm child process the tests drive by lines: one JSON request in, one JSON answer out
(tests/ckpt_workers/saver.py and deleter.py answer so). Started once per module, it
spares every request the seconds of a Python start and a torch import."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any


class WarmProcess:
    """``script`` running under this interpreter; its stderr goes to ``log_path``."""

    def __init__(self, script: Path, log_path: Path, what: str, *,
                 env: Mapping[str, str] | None = None, answer_limit_s: float = 60.0) -> None:
        self.what = what          # "the saver": for the messages
        self.answer_limit_s = answer_limit_s
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        env = dict(os.environ, **(env or {}), PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._log, env=env)
        self._lines: queue.Queue[bytes] = queue.Queue()
        assert self.proc.stdout is not None
        threading.Thread(target=self._pump, args=(self.proc.stdout,), daemon=True).start()

    def wait_ready(self) -> None:
        """Wait for its imports (several may import torch at the same time)."""
        assert self.answer()["event"] == "ready"

    def _pump(self, out: IO[bytes]) -> None:
        for line in out:
            self._lines.put(line)
        self._lines.put(b"")

    def answer(self) -> dict[str, Any]:
        """Its next answer; an AssertionError with its log if none comes."""
        try:
            line = self._lines.get(timeout=self.answer_limit_s)
        except queue.Empty:
            raise AssertionError(f"{self.what} did not answer within {self.answer_limit_s} s; "
                                 f"its log: {self.log()}") from None
        if not line:
            raise AssertionError(f"{self.what} exited ({self.proc.wait()}); its log: "
                                 f"{self.log()}")
        return dict(json.loads(line))

    def request(self, request: Mapping[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(dict(request)) + "\n").encode())
        self.proc.stdin.flush()
        return self.answer()

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        """Ask it to quit; kill it if it cannot hear (it may be stopped or dead)."""
        if self.proc.poll() is None and self.proc.stdin is not None:
            try:
                self.proc.stdin.write(b'{"cmd": "quit"}\n')
                self.proc.stdin.close()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(timeout=30)
        self._log.close()

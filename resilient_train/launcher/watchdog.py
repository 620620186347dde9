"""The launcher's watchdog: a tiny process in its own session that outlives a SIGKILLed launcher.

Its stdin is a pipe from the launcher. Each line ``LIFE REPLICA ATTEMPT RESTART`` says a
worker life is over: it SIGKILLs whatever still carries that life's environment. At EOF
(the launcher ended, or died) it SIGKILLs every process that carries the launch id.
Workers themselves die with the launcher by PR_SET_PDEATHSIG; this catches their
descendants, even those that left the worker's process group or session.
Linux only (it reads /proc/PID/environ); imports nothing beyond the standard library.
"""

from __future__ import annotations

import os
import signal
import sys


def sweep(key: bytes, extra: list[bytes]) -> None:
    """SIGKILL every process whose environment has ``key`` and all of ``extra``; repeat
    while that finds any, since a dying process may have forked."""
    me = os.getpid()
    for _ in range(5):
        hits = 0
        for name in os.listdir("/proc"):
            if not name.isdigit() or int(name) == me:
                continue
            try:
                with open(f"/proc/{name}/environ", "rb") as f:
                    env = f.read().split(b"\0")
            except OSError:
                continue
            if key in env and all(e in env for e in extra):
                try:
                    os.kill(int(name), signal.SIGKILL)
                    hits += 1
                except OSError:
                    pass
        if not hits:
            return


def main(argv: list[str]) -> None:
    key = argv[1].encode()
    for line in sys.stdin.buffer:
        parts = line.split()
        if len(parts) == 4 and parts[0] == b"LIFE":
            sweep(key, [b"RESILIENT_TRAIN_REPLICA=" + parts[1],
                        b"RESILIENT_TRAIN_ATTEMPT=" + parts[2],
                        b"RESILIENT_TRAIN_RESTART_COUNT=" + parts[3]])
    sweep(key, [])


if __name__ == "__main__":
    main(sys.argv)

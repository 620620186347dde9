"""clean_daemon.py [--double-fork]: start a daemon that leaves the worker's session and
clears its environment (setsid, then exec ``sleep 300`` with no variables at all), then hang.

The daemon carries none of the job's variables (nor E2E_MARKER), so only the launcher's
record of the worker's process tree can find it. With --double-fork its parent exits at
once, the classic daemon start: the daemon is never the worker's child. The worker
writes ``<stem>.daemon`` with the daemon's pid.
"""
import os
import shutil
import subprocess
import sys

import _common

_common.start()
sleep = shutil.which("sleep") or "/bin/sleep"
if "--double-fork" in sys.argv:
    r, w = os.pipe()
    middle = os.fork()
    if middle == 0:
        os.setsid()
        daemon = os.fork()
        if daemon == 0:
            null = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):   # off the worker's output pipe, as a daemon does
                os.dup2(null, fd)
            os.execve(sleep, [sleep, "300"], {})
        os.write(w, str(daemon).encode())
        os._exit(0)
    os.close(w)
    pid = int(os.read(r, 64))
    os.waitpid(middle, 0)
else:
    pid = subprocess.Popen(["env", "-i", sleep, "300"], start_new_session=True,
                           stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL).pid
_common.mark("daemon", daemon=pid)
_common.hang()

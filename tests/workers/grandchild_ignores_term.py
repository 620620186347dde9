"""grandchild_ignores_term.py [--setsid] [--exit CODE]: spawn a grandchild that ignores
SIGTERM, then hang (or exit with CODE, leaving the grandchild behind).

The grandchild writes ``<stem>.grandchild`` with its pid. With --setsid it leaves the
worker's process group and session (a daemon), so only a launcher that remembers the
worker's process tree, or scans for it, can find it.
"""
import subprocess
import sys

import _common

CHILD = """
import signal, sys
sys.path.insert(0, {here!r})
signal.signal(signal.SIGTERM, signal.SIG_IGN)
import _common
_common.mark("grandchild")
_common.hang()
"""

_common.start()
here = sys.path[0]
child = subprocess.Popen([sys.executable, "-c", CHILD.format(here=here)],
                         start_new_session="--setsid" in sys.argv)
_common.wait_for([f"{_common.stem()}.grandchild"])
_common.mark("parent", child=child.pid)
if "--exit" in sys.argv:
    sys.exit(int(sys.argv[sys.argv.index("--exit") + 1]))
_common.hang()

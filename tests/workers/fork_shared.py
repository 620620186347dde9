"""fork_shared.py MIB CHILDREN HOLD_S: allocate (and touch) MIB MiB, fork CHILDREN children
that share it copy-on-write without touching it (as DataLoader workers share a model),
record the tree's RSS sum and PSS sum, hold HOLD_S seconds, exit 0."""
import os
import sys
import time

import _common
import psutil

from resilient_train.platform.resources import tree_pss, tree_rss

_common.start()
mib, children, hold_s = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
block = b"x" * (mib << 20)  # one allocation, filled: resident (no second copy's peak)
pids = []
for _ in range(children):
    pid = os.fork()
    if pid == 0:
        time.sleep(hold_s + 30)  # killed by the parent; never touches the block
        os._exit(0)
    pids.append(pid)
tree = [psutil.Process(), *(psutil.Process(p) for p in pids)]
_common.mark("forked", rss_sum=tree_rss(tree), pss_sum=tree_pss(tree))
time.sleep(hold_s)  # the launcher polls memory many times meanwhile
for pid in pids:
    os.kill(pid, 9)
    os.waitpid(pid, 0)

"""alloc.py MIB: allocate (and touch) MIB MiB in 16 MiB blocks, then hang."""
import sys
import time

import _common

_common.start()
blocks = []
for _ in range(int(sys.argv[1]) // 16):
    blocks.append(b"x" * (16 << 20))  # filled, so the pages are resident
    time.sleep(0.005)
_common.mark("allocated")
_common.hang()

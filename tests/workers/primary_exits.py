"""primary_exits.py SECONDS: the primary sleeps SECONDS then exits 0; the others hang."""
import sys
import time

import _common

_common.start()
if _common.PRIMARY:
    time.sleep(float(sys.argv[1]))
    sys.exit(0)
_common.hang()

"""exit_code.py CODE [REPLICA]: exit with CODE (on REPLICA only, others hang).

CODE may also come from $E2E_EXIT_CODE when argv[1] is "env".
"""
import os
import sys

import _common

_common.start()
code = int(os.environ["E2E_EXIT_CODE"] if sys.argv[1] == "env" else sys.argv[1])
if _common.targeted(2):
    print(f"{_common.REPLICA}: exiting with {code}", flush=True)
    sys.exit(code)
_common.hang()

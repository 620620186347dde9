"""A script that reports no training steps (no ``@rt.main``): ``KIND@stepN`` cannot fire.

``no_steps.py SECONDS``: the primary exits 0 after SECONDS; ``no_steps.py warning``: once
the launcher's job record holds a ``warning`` event (at most 60 s). The others hang until
they are stopped.
"""
import json
import os
import sys
import time

import _common

_common.start()
if not _common.PRIMARY:
    _common.hang()
if sys.argv[1] != "warning":
    time.sleep(float(sys.argv[1]))
    sys.exit(0)
record = os.path.join(os.environ["RESILIENT_TRAIN_JOB_DIR"], "job.json")
deadline = time.monotonic() + _common.WAIT_LIMIT_S
while time.monotonic() < deadline:
    try:
        with open(record, encoding="utf-8") as f:
            if any(e["kind"] == "warning" for e in json.load(f)["events"]):
                sys.exit(0)
    except (OSError, ValueError):
        pass   # between two atomic rewrites
    time.sleep(0.05)
print("no warning in the job record", flush=True)
sys.exit(99)

"""Steps of a fixed sleep, reported as training steps, each one's time logged.

``ticker.py STEPS [PAUSE_S] [OTHERS_STEPS]``: the primary runs STEPS steps, the other
replicas OTHERS_STEPS (default STEPS; 0 = forever), then exit 0. Each step is a sleep of
PAUSE_S (default 5 ms), so its count measures how long the process was allowed to run,
whatever the load of the machine. The steps go to the launcher's telemetry (as
``@rt.main`` reports them, so ``KIND@stepN`` faults work) and, with their times, to
``$E2E_READY_DIR/<replica>.a<attempt>.r<restart>.ticks``. With ``$E2E_TICK_AFTER``
(``;``-separated globs in the ready directory) the primary starts counting once they all
match, e.g. once the others' tick files exist.
"""
import os
import sys
import time

import _common

from resilient_train.observe.telemetry import Telemetry

_common.start()
steps = int(sys.argv[1])
pause = float(sys.argv[2]) if len(sys.argv) > 2 else 0.005
if not _common.PRIMARY and len(sys.argv) > 3:
    steps = int(sys.argv[3])
tele = Telemetry.from_env()
if tele is not None:
    tele.begin_segment(0)
step = 0
with open(os.path.join(_common.READY_DIR, f"{_common.stem()}.ticks"), "w") as log:
    after = os.environ.get("E2E_TICK_AFTER")
    if _common.PRIMARY and after:
        _common.wait_for([p for p in after.split(";") if p])
    while steps == 0 or step < steps:
        time.sleep(pause)
        step += 1
        if tele is not None:
            tele.step(step)
        log.write(f"{step} {time.time():.6f}\n")
        log.flush()
if tele is not None:
    tele.close()
print(f"{_common.REPLICA}: {step} steps", flush=True)

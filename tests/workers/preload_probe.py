"""preload_probe.py OUT_DIR [--die-once] [--bug]: what a life sees as it starts, written
to OUT_DIR/REPLICA.rRESTART.json, for tests/test_preload.py.

--die-once: rank 1's first life SIGKILLs itself (the launcher restarts it).
--bug: raise an uncaught exception (the job fails with its traceback).
--sleep: after writing what it saw, sleep until killed.
"""
import sys

PRELOADED = "torch" in sys.modules   # before this script imports anything

import json  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import signal  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import numpy  # noqa: E402
import torch  # noqa: E402


def main() -> None:
    out, flags = sys.argv[1], sys.argv[2:]
    replica = os.environ["RESILIENT_TRAIN_REPLICA"]
    restart = os.environ["RESILIENT_TRAIN_RESTART_COUNT"]
    seen = {
        "preloaded": PRELOADED, "argv": sys.argv, "path0": sys.path[0], "name": __name__,
        "cwd": os.getcwd(), "tmp": tempfile.gettempdir(), "TMPDIR": os.environ["TMPDIR"],
        "rank": os.environ.get("RANK"), "session_leader": os.getsid(0) == os.getpid(),
        "stdin": os.read(0, 1).decode(), "random": random.random(),
        "numpy": float(numpy.random.random()), "torch": float(torch.rand(1)),
        "threads": torch.get_num_threads(), "omp": os.environ.get("OMP_NUM_THREADS"),
        "pid": os.getpid(), "ppid": os.getppid(),
    }
    with open(os.path.join(out, f"{replica}.r{restart}.json"), "w") as f:
        json.dump(seen, f)
    print(f"probe {replica} restart {restart} preloaded={PRELOADED}", flush=True)
    if "--die-once" in flags and seen["rank"] == "1" and restart == "0":
        os.kill(os.getpid(), signal.SIGKILL)
    if "--bug" in flags:
        raise ValueError("a bug in the probe")
    while "--sleep" in flags:
        time.sleep(1)


main()

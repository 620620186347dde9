"""loader_on_sigterm.py: iterate a DataLoader with 2 worker processes, as a training loop
does, with a SIGTERM handler that asks for a clean exit 134 at the next batch (the
emergency-checkpoint pattern). Writes <stem>.iterating once batches flow."""
import signal
import sys
import time

import _common

asked = []
signal.signal(signal.SIGTERM, lambda signum, frame: asked.append(signum))

from torch.utils.data import DataLoader  # noqa: E402 - after the handler, on purpose

_common.start()
loader = DataLoader(list(range(100_000)), batch_size=4, num_workers=2)
try:
    for i, _batch in enumerate(loader):
        if i == 1:
            _common.mark("iterating")
        if asked:
            print("SIGTERM: leaving at a batch boundary", flush=True)
            sys.exit(134)
        time.sleep(0.05)
except RuntimeError as exc:  # what DataLoader raises when its workers were killed
    print(f"the loader failed: {exc}", flush=True)
    sys.exit(1)

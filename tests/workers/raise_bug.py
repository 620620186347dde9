"""raise_bug.py [REPLICA]: a deterministic bug (an uncaught exception, exit 1) on REPLICA."""
import _common


def load_config(lr: str) -> float:
    raise ValueError(f"e2e bug: learning rate {lr!r} is not a number")


_common.start()
if _common.targeted(1):
    load_config("fast")
_common.hang()

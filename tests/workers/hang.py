"""Start, then sleep forever (a stuck worker)."""
import _common

_common.start()
_common.hang()

"""Ignore SIGTERM, then hang: only SIGKILL ends this worker."""
import signal

import _common

signal.signal(signal.SIGTERM, signal.SIG_IGN)
_common.start()
_common.hang()

"""Write this replica's environment as JSON (``<stem>.env``), then start() and hang."""
import os

import _common

_common.mark("env", env=dict(os.environ))
_common.start()
_common.hang()

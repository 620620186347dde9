"""`python -m resilient_train.cli`: the same as the `resilient-train` command."""

import sys

from .main import main

sys.exit(main())

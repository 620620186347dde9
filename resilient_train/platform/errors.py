"""What a job spec can get wrong, and the hint that names what was meant."""

from __future__ import annotations

import difflib
import re

QUOTE_CHARS = 80        # of a value that an error message quotes


class JobSpecError(ValueError):
    """The job spec is malformed; the message names the field path and the fix."""


def suggest_field(key: str, known: set[str]) -> str:
    """What ``key`` may have meant among the ``known`` field names, for a message."""
    if len(key) > QUOTE_CHARS:   # no field name is that long: nothing to compare
        return f"known fields here: {', '.join(sorted(known))}"
    if "_" in key:
        camel = re.sub(r"_([a-z0-9])", lambda m: m.group(1).upper(), key)
        if camel in known:
            return f"the API's names are camelCase (gcloud rejects underscores): write {camel}"
    close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
    hint = f"did you mean {close[0]}? " if close else ""
    return f"{hint}known fields here: {', '.join(sorted(known))}"

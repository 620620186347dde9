"""One check that options' ``__post_init__`` methods share: a field of the wrong type is a
``TypeError`` that names the field, the value and what is expected."""

from __future__ import annotations

from typing import Any

NONE = type(None)


def expect_type(where: str, value: Any, kind: type | tuple[type, ...], expected: str) -> None:
    """Raise ``TypeError("WHERE=VALUE: expected EXPECTED")`` unless ``value`` is a ``kind``."""
    if not isinstance(value, kind):
        raise TypeError(f"{where}={value!r}: expected {expected}")

"""Checks that the public options share: a field of the wrong type is a ``TypeError`` that
names the field, the value and what is expected; a keyword that is not an option says
where it belongs or what was meant, instead of Python's bare "unexpected keyword
argument"."""

from __future__ import annotations

import dataclasses
import difflib
import functools
from typing import Any, TypeVar

NONE = type(None)
T = TypeVar("T")


def expect_type(where: str, value: Any, kind: type | tuple[type, ...], expected: str) -> None:
    """Raise ``TypeError("WHERE=VALUE: expected EXPECTED")`` unless ``value`` is a ``kind``."""
    if not isinstance(value, kind):
        raise TypeError(f"{where}={value!r}: expected {expected}")


def options(cls: type[T]) -> type[T]:
    """Class decorator (above ``@dataclass``) for an options class that users build: an
    unknown keyword raises :func:`unknown_option`'s message."""
    init = cls.__init__
    known = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]

    @functools.wraps(init)
    def checked(self: Any, *args: Any, **kwargs: Any) -> None:
        for key in kwargs:
            if key not in known:
                raise TypeError(unknown_option(cls, key))
        init(self, *args, **kwargs)

    setattr(cls, "__init__", checked)
    return cls


def _public_options() -> list[type]:
    """The options classes of the ``rt`` namespace (loaded on this error path only)."""
    import resilient_train as rt

    classes = (getattr(rt, name) for name in rt.__all__)
    return [c for c in classes if isinstance(c, type) and dataclasses.is_dataclass(c)
            and getattr(c.__init__, "__wrapped__", None) is not None]


def holder(outer: type, inner: type) -> str | None:
    """The field of ``outer`` that takes an ``inner`` (MainOptions.checkpoint), if any."""
    for f in dataclasses.fields(outer):
        if inner.__name__ in str(f.type):
            return f.name
    return None


def unknown_option(cls: type, key: str) -> str:
    """``rt.CheckpointOptions(checkpoint_dir=...)``: whose option it is, and how to pass it
    from here; else the option of this class that the name is close to; else the list."""
    name = cls.__name__
    fields = [f.name for f in dataclasses.fields(cls)]
    head = f"rt.{name}({key}=...): {name} has no option {key!r}"
    ways = []
    for owner in _public_options():
        if owner is cls or key not in {f.name for f in dataclasses.fields(owner)}:
            continue
        other = owner.__name__
        down = holder(cls, owner)     # MainOptions(save_every_steps=): one level down
        up = holder(owner, cls)       # CheckpointOptions(checkpoint_dir=): one level up
        if down is not None:
            ways.append(f"rt.{name}({down}=rt.{other}({key}=...))")
        elif up is not None:
            ways.append(f"rt.{other}({key}=..., {up}=rt.{name}(...))")
        else:
            ways.append(f"rt.{other}({key}=...)")
    if ways:
        return f"{head}; it is an option of another class: {' or '.join(ways)}"
    close = difflib.get_close_matches(key, fields, n=1, cutoff=0.6)
    if close:
        return f"{head}; did you mean {close[0]}=...?"
    return f"{head}; its options are: {', '.join(fields)}"

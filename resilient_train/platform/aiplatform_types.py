"""The platform's own types for a CustomJob, when the ``cloud`` extra is installed.

Google publishes the Vertex AI API as code: ``google-cloud-aiplatform``'s ``aiplatform_v1``
messages (``pip install "resilient-train[cloud]"``). With them, a job spec is read and an
export is checked through ``CustomJob`` / ``CustomJobSpec`` by the protobuf JSON mapping,
the way the API itself reads a request: every field the API does not have, at any depth,
and every value of the wrong type or enum is refused with its path. The field names the
launcher's own reader accepts (platform/jobspec.py) then come from the messages' descriptors too.

Without the extra, nothing here imports it: `available` is False, `known_fields` returns
None and platform/jobspec.py keeps its own tables. Importing the types costs about a second and a
half of CPU (the package loads every Vertex AI message), so it happens only when a spec
is read or written, never when the CLI starts.
"""

from __future__ import annotations

import functools
import importlib.util
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:   # the extra's types, for annotations only
    from google.cloud.aiplatform_v1 import CustomJob, CustomJobSpec

__all__ = ["CloudExtraMissing", "available", "custom_job_message", "known_fields",
           "require", "spec_message", "to_document"]

INSTALL_HINT = "pip install 'resilient-train[cloud]'"
_MODULE = "google.cloud.aiplatform_v1"

# The messages of a CustomJob document that the launcher's reader walks, by the name it
# gives them; each is a message of aiplatform_v1.
MESSAGES = ("CustomJob", "CustomJobSpec", "WorkerPoolSpec", "MachineSpec", "ContainerSpec",
            "PythonPackageSpec", "Scheduling", "GcsDestination", "EnvVar")


class CloudExtraMissing(RuntimeError):
    """The ``cloud`` extra (google-cloud-aiplatform) is not installed."""


@functools.cache
def available() -> bool:
    """Whether google-cloud-aiplatform's ``aiplatform_v1`` types can be imported."""
    try:
        return importlib.util.find_spec(_MODULE) is not None
    except (ImportError, ValueError):   # google.cloud itself missing, or a broken install
        return False


def require(purpose: str) -> None:
    """Raise CloudExtraMissing, naming ``purpose`` and the fix, without the extra."""
    if not available():
        raise CloudExtraMissing(f"{purpose} needs Google's aiplatform types, which are not "
                                f"installed: {INSTALL_HINT}")


def _types() -> Any:
    import google.cloud.aiplatform_v1 as types

    return types


@functools.cache
def known_fields(message: str) -> frozenset[str] | None:
    """The JSON names of ``message``'s fields as aiplatform_v1 defines them (``message``
    one of MESSAGES); None without the extra."""
    if not available():
        return None
    descriptor = getattr(_types(), message).pb().DESCRIPTOR
    return frozenset(f.json_name for f in descriptor.fields)


def custom_job_message(doc: Mapping[str, Any]) -> CustomJob:
    """``doc`` (a whole CustomJob in the API's JSON) as an ``aiplatform_v1.CustomJob``."""
    return _parse(doc, "CustomJob")


def spec_message(doc: Mapping[str, Any]) -> CustomJobSpec:
    """``doc`` (a bare CustomJobSpec) as an ``aiplatform_v1.CustomJobSpec``."""
    return _parse(doc, "CustomJobSpec")


def to_document(message: Any) -> dict[str, Any]:
    """A message as the API's JSON (camelCase names; int64 values as strings)."""
    from google.protobuf import json_format

    pb = type(message).pb(message) if hasattr(type(message), "pb") else message
    return json_format.MessageToDict(pb)


def _parse(doc: Mapping[str, Any], name: str) -> Any:
    from google.protobuf import json_format

    from .errors import JobSpecError

    require(f"reading a {name} through the platform's types")
    cls = getattr(_types(), name)
    pb = cls.pb()()
    try:
        json_format.ParseDict(dict(doc), pb)
    except json_format.ParseError as exc:
        raise JobSpecError(explain(str(exc), name, doc)) from None
    return cls.wrap(pb)


# protobuf's messages: 'Failed to parse jobSpec field: Failed to parse workerPoolSpecs
# field: ... Message type "google.cloud.aiplatform.v1.EnvVar" has no field named "bogus"
# at "CustomJob.jobSpec.workerPoolSpecs[0].containerSpec.env[0]".\n Available Fields...'
_CHAIN = re.compile(r"Failed to parse (\w+) field: ")
_AT = re.compile(r' at "?([A-Za-z]\w*(?:\.\w+|\[\d+\])*)"?\.*')
_NO_FIELD = re.compile(r'Message type "(?:[\w]+\.)*(\w+)" has no field named "([^"]*)"')
_AVAILABLE = re.compile(r"Available Fields\(except extensions\): \"\[(.*?)\]\"", re.DOTALL)


_NOT_INT = re.compile(r"invalid literal for int\(\) with base 10: (.*)")
_BAD_ENUM = re.compile(r"Invalid enum value (\S+) for enum type ([\w.]+)")
_NULL_ITEM = "null is not allowed to be used as an element in a repeated field"


def explain(message: str, root: str, doc: Mapping[str, Any] | None = None) -> str:
    """protobuf's ParseError text as the launcher's: ``PATH: what; the fix``."""
    reason = _CHAIN.sub("", message).strip()
    chain = _CHAIN.findall(message)
    at = _AT.search(reason)
    if at is not None:   # "CustomJob.jobSpec.workerPoolSpecs[0]...": drop the message name
        path = at.group(1).split(".", 1)[1] if "." in at.group(1) else ""
        reason = reason[:at.start()] + reason[at.end():]
    else:                # only the field names: find the list items in the document
        path = _locate(doc, chain) if doc is not None else ".".join(chain)
    if _NULL_ITEM in reason:
        return (f"{path or 'the top'}: an empty item (null) in a list; the API refuses it: "
                f"write an empty worker pool as {{}}, and leave out other empty items")
    not_int = _NOT_INT.search(reason)
    if not_int is not None:
        return f"{path}: expected an integer, found {not_int.group(1).rstrip('.')}"
    enum = _BAD_ENUM.search(reason)
    if enum is not None:
        return (f"{path}: expected one of {', '.join(_enum_values(enum.group(2)))} (as the "
                f"API writes them), found {enum.group(1)}")
    unknown = _NO_FIELD.search(reason)
    if unknown is not None:
        message_type, field = unknown.groups()
        fields = _AVAILABLE.search(reason)
        known = sorted(re.findall(r"'(\w+)'", fields.group(1))) if fields else []
        from .errors import suggest_field

        where = f"{path}.{field}" if path else field
        return (f"{where}: unknown field (aiplatform_v1.{message_type} has no such field); "
                f"{suggest_field(field, set(known))}")
    reason = reason.split("\n")[0].rstrip(".").strip()
    return (f"{path or 'the top'}: refused by aiplatform_v1.{root}: {reason}; write it as "
            f"the API's JSON does")


def _locate(doc: Any, chain: list[str]) -> str:
    """The path of the field that ``chain`` (field names, outermost first) names in
    ``doc``, with each list's index: the first item that has the next field."""
    parts: list[str] = []
    node = doc
    for name in chain:
        node = node.get(name) if isinstance(node, Mapping) else None
        parts.append(f".{name}" if parts else name)
        if isinstance(node, list):
            nxt = chain[len(parts)] if len(parts) < len(chain) else None
            index = next((i for i, item in enumerate(node)
                          if nxt is None or (isinstance(item, Mapping) and nxt in item)), None)
            if index is None:
                break
            parts.append(f"[{index}]")
            node = node[index]
    return "".join(parts)


def _enum_values(full_name: str) -> list[str]:
    from google.protobuf import descriptor_pool

    try:
        enum = descriptor_pool.Default().FindEnumTypeByName(full_name)
    except KeyError:
        return [full_name]
    return [v.name for v in enum.values]

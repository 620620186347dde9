"""One rule for an exception's chain, and each small helper once (issue 16, point 7).

A ValueError raised while handling RuntimeError("Connection reset by peer") was a peer
failure to distributed/group.py (which followed __cause__ or __context__) and a bug to
errors.py (__cause__ only). Both now read errors.exception_chain: __cause__ only.
"""

from __future__ import annotations

import ast
from pathlib import Path

from resilient_train.distributed.group import is_peer_failure
from resilient_train.errors import Classification, classify_exception, exception_chain

PACKAGE = Path(__file__).resolve().parent.parent / "resilient_train"


def _raised_while_handling() -> ValueError:
    try:
        try:
            raise RuntimeError("Connection reset by peer")
        except RuntimeError:
            raise ValueError("a bug in the handler")  # noqa: B904 - the point of the test
    except ValueError as exc:
        return exc


def _raised_from() -> ValueError:
    try:
        try:
            raise RuntimeError("Connection reset by peer")
        except RuntimeError as cause:
            raise ValueError("the step failed") from cause
    except ValueError as exc:
        return exc


def test_a_bug_raised_while_handling_a_peer_failure_is_a_bug_to_every_reader() -> None:
    bug = _raised_while_handling()
    assert bug.__context__ is not None and bug.__cause__ is None
    assert list(exception_chain(bug)) == [bug]
    assert classify_exception(bug) is Classification.PERMANENT
    assert not is_peer_failure(bug)


def test_an_error_raised_from_a_peer_failure_is_a_peer_failure_to_every_reader() -> None:
    wrapped = _raised_from()
    assert [type(e) for e in exception_chain(wrapped)] == [ValueError, RuntimeError]
    assert classify_exception(wrapped) is Classification.TRANSIENT
    assert is_peer_failure(wrapped)


def test_a_cycle_in_the_chain_ends_the_walk() -> None:
    a, b = RuntimeError("a"), RuntimeError("b")
    a.__cause__, b.__cause__ = b, a
    assert list(exception_chain(a)) == [a, b]


def _definitions(*, top_level: bool) -> dict[str, list[str]]:
    """Function names -> the modules that define them (module-level ones only, or all)."""
    found: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in (tree.body if top_level else ast.walk(tree)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found.setdefault(node.name, []).append(str(path.relative_to(PACKAGE)))
    return found


def test_each_small_helper_is_defined_once() -> None:
    defs = _definitions(top_level=True)
    for name in ("first_line", "error_line", "format_duration", "exception_chain",
                 "observed_mtbf",
                 "replica_name", "process_start_time", "classify_exit", "error_for"):
        assert len(defs.get(name, [])) == 1, (name, defs.get(name))
    # The copies they replaced are gone, methods included.
    defs = _definitions(top_level=False)
    for gone in ("_dur", "_first_line", "_one_line", "_chain", "_process_start_time",
                 "_killed_from_outside"):
        assert gone not in defs, (gone, defs[gone])


def test_only_storage_reads_an_implicit_chain() -> None:
    # Storage links torch.save's implicit ENOSPC context where a writer's error comes
    # back to it; nothing else reads __context__ to make a decision.
    readers = sorted({str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                      for node in ast.walk(ast.parse(p.read_text(encoding="utf-8")))
                      if isinstance(node, ast.Attribute) and node.attr == "__context__"})
    assert readers == ["checkpoint/storage/base.py"]

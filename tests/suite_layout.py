"""How the suite is spread over processes (pytest-xdist's ``--dist loadgroup``, set in
pyproject.toml): twice as many processes as the machine has cores, the tests that share a
module-scoped fixture in one process, and the longest first. A plugin of its own
(conftest.py imports its hooks) so that a test can run it against a probe module
(tests/test_suite_layout.py).

The grouping and the order happen in pytest-xdist's workers, the only processes that
collect: the controller schedules the nodeids the workers report, in their order. A worker
appends a test's ``xdist_group`` to its nodeid in its own ``pytest_collection_modifyitems``;
this hook runs before that one (``tryfirst``), or the groups it marks would never reach the
scheduler.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
from _pytest.fixtures import FixtureDef


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int | None:
    """``-n auto``: twice the cores this process may use (at most ``--maxprocesses``).
    Many tests spend seconds waiting (a timeout, a restart, a step's sleep) with a core
    idle; on 2 cores the suite took 651 s in 2 processes, 610-622 s in 3 (1.7 of the 2
    cores busy) and 574-607 s in 4 within the same hour (a slower hour later: 621 and
    677 s). PYTEST_XDIST_AUTO_NUM_WORKERS, where set, is pytest-xdist's to read."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None
    return 2 * len(os.sched_getaffinity(0))


def _module_fixtures(item: pytest.Item) -> bool:
    """Whether the test uses a module-scoped fixture (a job run once for the module's tests)."""
    info = getattr(item, "_fixtureinfo", None)
    defs: dict[str, tuple[FixtureDef[Any], ...]] = getattr(info, "name2fixturedefs", {})
    return any(d and d[-1].scope == "module" for d in defs.values())


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In a run spread over processes, the tests that share a module-scoped fixture run in
    one process: in two, each would run the fixture's job again. And the longest go first:
    pytest-xdist hands tests out in this order, and a group of end-to-end jobs (a minute or
    two in one process) left to the end ran alone while the other processes had nothing."""
    if not hasattr(config, "workerinput"):   # the controller, or a run in one process
        return
    for item in items:
        if isinstance(item, pytest.Function) and _module_fixtures(item):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))

    def weight(item: pytest.Item) -> int:
        slow = item.get_closest_marker("slow") is not None
        grouped = item.get_closest_marker("xdist_group") is not None
        return 0 if grouped and slow else 1 if slow else 2

    items.sort(key=weight)   # stable: each group's tests stay in their order

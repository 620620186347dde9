"""How the suite is spread over processes with pytest-xdist: twice as many processes as the
machine has cores, the tests that share a module-scoped fixture in one process, and the
longest first. A plugin of its own (conftest.py imports its hooks) so that a test can run
it against a probe module (tests/test_suite_layout.py).

Why a scheduler of our own: only pytest-xdist's workers collect, and its controller
schedules the nodeids they report. xdist's ``--dist loadgroup`` told the controller a
test's group by appending ``@group`` to the worker's ``item._nodeid``; pytest 9.2 builds
``nodeid`` from a structured id and no longer reads that attribute, so the groups silently
stopped reaching the scheduler (pytest-xdist issue 1386, no release fixes it yet). Here
the worker writes its groups to a file the controller named (``pytest_configure_node``,
one of xdist's public hooks) before it reports its collection, and the controller's
scheduler (``pytest_xdist_make_scheduler``, public too) reads them. No nodeid is changed,
so this works on every pytest and xdist that have those hooks.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
from _pytest.fixtures import FixtureDef

_GROUPS_DIR = "suite_layout_groups"      # the workerinput key: where workers write
_groups_dir_key = pytest.StashKey[Path]()


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int | None:
    """``-n auto``: twice the cores this process may use (at most ``--maxprocesses``).
    Many tests spend seconds waiting (a timeout, a restart, a step's sleep) with a core
    idle; on 2 cores the suite took 651 s in 2 processes, 610-622 s in 3 (1.7 of the 2
    cores busy) and 574-607 s in 4 within the same hour (a slower hour later: 621 and
    677 s). PYTEST_XDIST_AUTO_NUM_WORKERS, where set, is pytest-xdist's to read."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None
    return 2 * len(os.sched_getaffinity(0))


def pytest_configure(config: pytest.Config) -> None:
    """The controller makes the folder its workers write their groups into."""
    if not hasattr(config, "workerinput"):
        config.stash[_groups_dir_key] = Path(tempfile.mkdtemp(prefix="suite-layout-"))


def pytest_unconfigure(config: pytest.Config) -> None:
    folder = config.stash.get(_groups_dir_key, None)
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """Tell each worker where to write its groups (before it starts)."""
    node.workerinput[_GROUPS_DIR] = str(node.config.stash[_groups_dir_key])


def _module_fixtures(item: pytest.Item) -> bool:
    """Whether the test uses a module-scoped fixture (a job run once for the module's tests)."""
    info = getattr(item, "_fixtureinfo", None)
    defs: dict[str, tuple[FixtureDef[Any], ...]] = getattr(info, "name2fixturedefs", {})
    return any(d and d[-1].scope == "module" for d in defs.values())


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In a run spread over processes, the tests that share a module-scoped fixture run in
    one process: in two, each would run the fixture's job again. And the longest go first:
    the scheduler hands tests out in this order, and a group of end-to-end jobs (a minute or
    two in one process) left to the end ran alone while the other processes had nothing."""
    workerinput = getattr(config, "workerinput", None)
    if workerinput is None:   # the controller, or a run in one process
        return
    groups = {item.nodeid: item.module.__name__ for item in items
              if isinstance(item, pytest.Function) and _module_fixtures(item)}

    def weight(item: pytest.Item) -> int:
        slow = item.get_closest_marker("slow") is not None
        return 0 if item.nodeid in groups and slow else 1 if slow else 2

    items.sort(key=weight)   # stable: each group's tests stay in their order
    folder = workerinput.get(_GROUPS_DIR)
    if folder is not None:    # None: a controller without this plugin's hooks
        path = Path(folder) / f"{workerinput['workerid']}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(groups))
        os.replace(tmp, path)   # whole or absent: the controller reads it after this


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadgroup`` (pyproject.toml's addopts) is scheduled by GroupScheduling."""
    if config.getvalue("dist") != "loadgroup":
        return None
    return _group_scheduling()(config, log)


def _group_scheduling() -> type:
    from xdist.scheduler import LoadScopeScheduling  # only where xdist runs the suite

    class GroupScheduling(LoadScopeScheduling):   # type: ignore[misc, valid-type]
        """xdist's scope scheduling, with a test's scope its group (read from the file its
        worker wrote) or, for a test in no group, the test alone."""

        def __init__(self, config: pytest.Config, log: Any) -> None:
            super().__init__(config, log)
            self.folder = config.stash[_groups_dir_key]
            self.groups: dict[str, str] = {}

        def add_node_collection(self, node: Any, collection: Any) -> None:
            path = self.folder / f"{node.workerinput['workerid']}.json"
            # Written before the worker reported its collection, which is how we got here.
            self.groups.update(json.loads(path.read_text()))
            super().add_node_collection(node, collection)

        def _split_scope(self, nodeid: str) -> str:
            group = self.groups.get(nodeid)
            return nodeid if group is None else f"group:{group}"

    return GroupScheduling

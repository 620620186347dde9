"""The package's shape: no import circles between its files, no part importing a part above
it, no two modules with one name. Run alone as ``python -m pytest tests/test_package_layout.py``;
docs/design.md ("Parts") says what each part is for.

Every import counts, inside functions too (a function-level import is a dependency all the
same), but not one under ``if TYPE_CHECKING:`` for the circles: it never runs.
"""

from __future__ import annotations

import ast
import functools
from collections import Counter
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "resilient_train"

# The parts, lowest first: a module may import modules of its own part and of the parts
# below it, never above. The public API (resilient_train/__init__.py) stands above all.
LAYERS: tuple[tuple[str, ...], ...] = (
    # basics every part may use: the exit taxonomy, where this process is, texts, option
    # checks, SIGTERM, what outlives a life
    ("errors", "cluster", "text", "validate", "frames", "sigterm", "forkwatch", "lifecycle"),
    ("observe",),        # telemetry, goodput, the job record's events and files, the report
    ("distributed",),    # the process group
    ("checkpoint",),     # storage, commit, tiers, transports, state capture, scheduling
    ("runtime", "data", "spawn"),   # the training loop's runtime; a replica's processes
    ("platform",),       # the platform's own API: job specs, export, JobSet, submit
    ("launcher",),       # the local platform emulator
    ("cli",),
)


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


MODULES = _modules()


class _Imports(ast.NodeVisitor):
    def __init__(self, module: str, is_package: bool, with_type_checking: bool) -> None:
        self.package = module if is_package else module.rpartition(".")[0]
        self.with_type_checking = with_type_checking
        self.found: set[str] = set()

    def visit_If(self, node: ast.If) -> None:
        test = node.test
        name = test.id if isinstance(test, ast.Name) else \
            test.attr if isinstance(test, ast.Attribute) else ""
        if name == "TYPE_CHECKING" and not self.with_type_checking:
            for child in node.orelse:
                self.visit(child)
            return
        self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = node.module or ""
        if node.level:
            parts = self.package.split(".")
            parts = parts[:len(parts) - (node.level - 1)]
            base = ".".join(parts + ([base] if base else []))
        for alias in node.names:
            full = f"{base}.{alias.name}"
            self._add(full if full in MODULES else base)

    def _add(self, name: str) -> None:
        while name and name not in MODULES and "." in name:
            name = name.rpartition(".")[0]
        if name in MODULES and name != "resilient_train":
            self.found.add(name)


@functools.cache
def imports(module: str, *, with_type_checking: bool) -> frozenset[str]:
    path = MODULES[module]
    visitor = _Imports(module, path.name == "__init__.py", with_type_checking)
    visitor.visit(ast.parse(path.read_text(encoding="utf-8")))
    # A package's own __init__ is loaded on the way to any of its modules: not an edge.
    return frozenset(m for m in visitor.found
                     if m != module and not module.startswith(m + "."))


def circles() -> list[list[str]]:
    """The strongly connected components of more than one file (Tarjan's algorithm)."""
    graph = {m: imports(m, with_type_checking=False) for m in MODULES}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def layer_of(module: str) -> int:
    part = module.split(".")[1]
    for i, names in enumerate(LAYERS):
        if part in names:
            return i
    raise AssertionError(f"{module}: in no part of LAYERS; add {part!r} where it belongs")


def test_no_import_circles_between_files() -> None:
    assert circles() == []


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m != "resilient_train"))
def test_no_part_imports_a_part_above_it(module: str) -> None:
    mine = layer_of(module)
    above = sorted(m for m in imports(module, with_type_checking=True)
                   if m != "resilient_train" and layer_of(m) > mine)
    assert above == [], f"{module} ({LAYERS[mine]}) imports from above: {above}"


def test_no_two_modules_share_a_name() -> None:
    names = Counter(path.name for path in MODULES.values()
                    if path.name not in ("__init__.py", "errors.py"))
    assert [name for name, n in names.items() if n > 1] == []

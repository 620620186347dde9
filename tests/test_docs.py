"""The reference docs in the repository: they say what the code does, and nothing points
outside the repository.

- The default restart table, in README.md and in docs/platform.md, is the table that
  ``default_policy()`` builds: rule names in order for every strategy, each rule's causes,
  exit codes and actions with their budgets, and the budgets' limits and scopes.
- No file of the repository cites the project's notes outside it, or an absolute path of
  the machine it was written on.
- Every relative link of README.md and docs/*.md reaches a file (and its heading, for a
  ``#fragment``), every repository path a doc names in backticks exists, and every
  citation of a section by title (``docs/platform.md, "Why a worker ended"``, or the
  README's) names a heading that is there.
- The user guides name every option: each field of the option dataclasses, each
  ``launch`` option, each fault kind, each event field.

Pure file reading (the code is read with ``ast``, not imported, except the small policy
module), plus one ``git ls-files``: fast, and it works in a clean clone.
"""

from __future__ import annotations

import ast
import functools
import re
import subprocess
from pathlib import Path

import pytest

from resilient_train.platform.rules import Policy, Strategy, default_policy

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PACKAGE = ROOT / "resilient_train"

# --- reading Markdown -----------------------------------------------------------------

_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
_INLINE_CODE = re.compile(r"`[^`\n]*`")
_CELL_SPLIT = re.compile(r"(?<!\\)\|")
_BACKTICKED = re.compile(r"`([^`\n]+)`")


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def _doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


def _cells(line: str) -> list[str]:
    inner = line.strip()
    inner = inner[1:] if inner.startswith("|") else inner
    inner = inner[:-1] if inner.endswith("|") and not inner.endswith("\\|") else inner
    return [c.strip() for c in _CELL_SPLIT.split(inner)]


def tables(text: str, header: tuple[str, ...]) -> list[list[list[str]]]:
    """Every Markdown table whose header row is ``header`` (compared lowercased), as its
    body rows of cells."""
    lines = _FENCE.sub("", text).splitlines()
    found = []
    for i, line in enumerate(lines[:-1]):
        if not line.lstrip().startswith("|"):
            continue
        if tuple(c.lower() for c in _cells(line)) != header:
            continue
        if not re.fullmatch(r"\|?(\s*:?-+:?\s*\|)+\s*:?-*:?\s*\|?", lines[i + 1].strip()):
            continue
        rows = []
        for body in lines[i + 2:]:
            if not body.lstrip().startswith("|"):
                break
            rows.append(_cells(body))
        found.append(rows)
    return found


def slug(title: str) -> str:
    """GitHub's anchor for a heading: lowercased, punctuation dropped, spaces to hyphens."""
    text = title.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def headings(path: Path) -> list[str]:
    """The headings of a Markdown file, as written (backticks dropped)."""
    text = _FENCE.sub("", _read(path))
    return [m.group(1).strip().replace("`", "")
            for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, re.M)]


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for title in headings(path):
        base = slug(title)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


# --- the restart table ------------------------------------------------------------------

RESTART_HEADER = ("rule", "matches", "actions")
BUDGET_HEADER = ("budget", "limit", "scope")
_VARIANT = re.compile(r"\(with `--strategy ([\w-]+)`:([^)]*)\)")
_ONLY = re.compile(r"`--strategy ([\w-]+)` only")
_STEP = re.compile(r"[a-z_]+(?::[a-z_]+)?")


def _steps(text: str) -> list[str]:
    return [t for t in _BACKTICKED.findall(text) if _STEP.fullmatch(t)]


def documented_rules(text: str, where: str) -> list[dict]:
    found = tables(text, RESTART_HEADER)
    assert len(found) == 1, (
        f"{where} must hold the default restart table once, headed "
        f"| rule | matches | actions |; found {len(found)}")
    rules = []
    for cells in found[0]:
        assert len(cells) == 3, f"{where}: a restart table row has 3 cells: {cells}"
        name_cell, match_cell, action_cell = cells
        names = _BACKTICKED.findall(name_cell)
        assert names, f"{where}: the rule cell names the rule in backticks: {name_cell!r}"
        only = _ONLY.search(name_cell)
        variants = {m.group(1): _steps(m.group(2)) for m in _VARIANT.finditer(action_cell)}
        rules.append({
            "name": names[0],
            "only": only.group(1) if only else None,
            "words": set(_BACKTICKED.findall(match_cell)),
            "numbers": {int(n) for n in re.findall(r"\b\d+\b", _INLINE_CODE.sub(
                lambda m: m.group(0) if m.group(0)[1:-1].isdigit() else "", match_cell))},
            "match": match_cell,
            "steps": _steps(_VARIANT.sub("", action_cell)),
            "variants": variants,
        })
    return rules


def _step_texts(rule) -> list[str]:
    return [s.action.value + (f":{s.budget}" if s.budget else "") for s in rule.steps]


def check_restart_table(text: str, where: str) -> None:
    rows = documented_rules(text, where)
    causes = {c.value for c in _causes()}
    for strategy in Strategy:
        policy: Policy = default_policy(strategy)
        mine = [r for r in rows if r["only"] in (None, strategy.value)]
        assert [r["name"] for r in mine] == [r.name for r in policy.rules], (
            f"{where}: the rules for --strategy {strategy.value}, in order")
        for row, rule in zip(mine, policy.rules):
            steps = row["variants"].get(strategy.value, row["steps"])
            assert steps == _step_texts(rule), (
                f"{where}: the actions of {rule.name} under --strategy {strategy.value}")
            match = rule.match
            if match.causes is not None:
                assert row["words"] & causes == {c.value for c in match.causes}, (
                    f"{where}: the causes {rule.name} matches, in backticks")
            if match.exit_codes is not None:
                assert row["numbers"] == set(match.exit_codes), (
                    f"{where}: the exit statuses {rule.name} matches")
            if match.primary is True:
                assert "the primary" in row["match"], f"{where}: {rule.name} is the primary's"
            if match.primary is False:
                assert "another worker" in row["match"], f"{where}: {rule.name} is not"
    budgets = tables(text, BUDGET_HEADER)
    assert len(budgets) == 1, (
        f"{where} must hold the budget table once, headed | budget | limit | scope |")
    policy = default_policy()
    documented = {}
    for name_cell, limit_cell, scope_cell in budgets[0]:
        name = _BACKTICKED.findall(name_cell)[0]
        documented[name] = (int(limit_cell), _BACKTICKED.findall(scope_cell)[0])
    assert documented == {n: (b.limit, b.scope) for n, b in policy.budgets.items()}, where


@functools.cache
def _causes():
    from resilient_train.platform.rules import Cause

    return tuple(Cause)


def test_the_readme_restart_table_is_default_policy() -> None:
    check_restart_table(_read(ROOT / "README.md"), "README.md")


def test_the_platform_doc_restart_table_is_default_policy() -> None:
    check_restart_table(_read(DOCS / "platform.md"), "docs/platform.md")


def test_the_table_reader_reads_what_it_is_given() -> None:
    # The reader itself, on a small table: a strategy-only row and a strategy's variant.
    text = ("| rule | matches | actions |\n|---|---|---|\n"
            "| `a` | an `exit` 0 of the primary | `succeed_job` |\n"
            "| `b` (`--strategy spot` only) | `preemption` | `retry_job:spot_retries` |\n"
            "| `c` | `stockout` | `retry_job:job_retries` (with `--strategy flex-start`: "
            "`wait_for_capacity`) |\n")
    rows = documented_rules(text, "example")
    assert [r["name"] for r in rows] == ["a", "b", "c"]
    assert rows[0]["numbers"] == {0} and rows[1]["only"] == "spot"
    assert rows[2]["steps"] == ["retry_job:job_retries"]
    assert rows[2]["variants"] == {"flex-start": ["wait_for_capacity"]}


# --- nothing cites what is outside the repository ---------------------------------------------

# The patterns are written so that this file does not match them itself.
_OUTSIDE = {
    "the platform notes": re.compile(r"\bPLATFORM\.md"),
    "the design notes": re.compile(r"\bDESIGN\.md"),
    "the field notes": re.compile(r"\bFIELD-NOTE[S]\b"),
    "a path into the shared notes": re.compile(r"(?:(?<![\w.\-/])|(?<=\.\./))shared\/"),
    "an absolute path of the project's machine": re.compile(r"(?<![\w.\-])/work\/"),
}
_ABSOLUTE = "an absolute path of the project's machine"


def _exempt(rel: str, what: str) -> bool:
    # Recorded benchmark results keep the command lines they ran, with the paths of the
    # machine that ran them: measurements, not citations.
    return what == _ABSOLUTE and rel.startswith("benchmarks/results/") and rel.endswith(".json")


@functools.cache
def repository_files() -> tuple[str, ...]:
    """Tracked files, plus the untracked ones under docs/ and tests/ (new files of the
    working tree), relative to the root. Without git (an unpacked archive): every file."""
    try:
        tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                                 check=True, timeout=30).stdout
        new = subprocess.run(["git", "ls-files", "-z", "--others", "--exclude-standard",
                              "--", "docs", "tests"], cwd=ROOT, capture_output=True,
                             check=True, timeout=30).stdout
        names = {n for n in (tracked + new).decode().split("\0") if n}
    except (OSError, subprocess.CalledProcessError):
        # No git: every file but hidden ones (.git, caches) and what .gitignore names.
        names = {str(p.relative_to(ROOT)) for p in ROOT.rglob("*") if p.is_file()
                 and not any(part.startswith(".") or part in ("rt-jobs", "checkpoints")
                             for part in p.relative_to(ROOT).parts)}
    return tuple(sorted(n for n in names if not any(
        part == ".git" or part.endswith(".egg-info") or part == "__pycache__"
        for part in Path(n).parts)))


@functools.cache
def _text(rel: str) -> str | None:
    path = ROOT / rel
    try:
        data = path.read_bytes()
    except OSError:   # listed but gone (deleted in the working tree)
        return None
    if b"\0" in data[:8192]:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def test_nothing_cites_a_document_outside_the_repository() -> None:
    found = []
    for rel in repository_files():
        text = _text(rel)
        if text is None:
            continue
        for what, pattern in _OUTSIDE.items():
            if _exempt(rel, what):
                continue
            for m in pattern.finditer(text):
                line = text.count("\n", 0, m.start()) + 1
                found.append(f"{rel}:{line}: {what}: "
                             f"{text.splitlines()[line - 1].strip()[:100]}")
    assert not found, ("cite the docs in docs/ instead (by document and section title):\n"
                       + "\n".join(found))


def test_the_outside_patterns_match_what_they_should() -> None:
    hits = {what: bool(p.search(sample)) for (what, p), sample in zip(_OUTSIDE.items(), (
        "see PLATFORM" ".md section 4", "DESIGN" ".md", "FIELD-" "NOTES: the emulator",
        "../sha" "red/x", "/wo" "rk/shared/y"))}
    assert all(hits.values()), hits
    shared = _OUTSIDE["a path into the shared notes"]
    assert not shared.search("tests/shared/helpers.py and a shared view")
    assert not _OUTSIDE[_ABSOLUTE].search("JOB_DIR/machines/R/container/workdir")


# --- links, paths and citations ---------------------------------------------------------------

_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_REPO_PATH = re.compile(r"^(?:resilient_train|tests|examples|benchmarks|docs)/[\w./-]*$")


@pytest.mark.parametrize("doc", _doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_reaches_a_file_and_heading(doc: Path) -> None:
    text = _INLINE_CODE.sub("", _FENCE.sub("", _read(doc)))
    broken = []
    for target in _LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):   # http:, https:, mailto:
            continue
        path_part, _, fragment = target.partition("#")
        dest = (doc.parent / path_part).resolve() if path_part else doc
        if ROOT not in dest.parents and dest != ROOT:
            broken.append(f"{target}: outside the repository")
        elif not dest.exists():
            broken.append(f"{target}: no such file")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            broken.append(f"{target}: no heading with that anchor in {dest.name}")
    assert not broken, f"{doc.relative_to(ROOT)}:\n" + "\n".join(broken)


@pytest.mark.parametrize("doc", _doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_repository_path_a_doc_names_exists(doc: Path) -> None:
    text = _FENCE.sub("", _read(doc))
    missing = sorted({p for p in _BACKTICKED.findall(text)
                      if _REPO_PATH.match(p) and not (ROOT / p.rstrip("/")).exists()})
    assert not missing, f"{doc.relative_to(ROOT)} names paths that do not exist: {missing}"


# A title may run on over a line break of a comment or docstring, as in this one's
# ``(docs/platform.md, "Why a
# worker ended")``.
_CITATION = re.compile(
    r"\bdocs/([\w-]+\.md)[,:]?\s*(?:#\s*)?(?:section\s*)?[\"“]([^\"”]{1,120})[\"”]")
_CONTINUATION = re.compile(r"\s*\n\s*#?\s*")
# The top-level README's sections, cited the same way (``README, "Your training script"``).
_README_CITATION = re.compile(
    r"(?<![\w/\"'])README(?:\.md)?(?:,\s*|\s*\(|\s+)(?:#\s*)?[\"“]([^\"”]{1,120})[\"”]")
_MENTION = re.compile(r"\bdocs/([\w-]+)\.md\b")


def test_every_citation_of_a_doc_names_a_heading_that_is_there() -> None:
    bad = []
    for rel in repository_files():
        text = _text(rel)
        if text is None or rel.startswith("docs/"):
            continue
        for m in _MENTION.finditer(text):
            if not (DOCS / f"{m.group(1)}.md").is_file():
                bad.append(f"{rel}: docs/{m.group(1)}.md does not exist")
        for m in _CITATION.finditer(text):
            doc, title = DOCS / m.group(1), _CONTINUATION.sub(" ", m.group(2)).strip()
            if doc.is_file() and title not in headings(doc):
                bad.append(f"{rel}: docs/{m.group(1)} has no section titled {title!r}")
    assert not bad, "\n".join(bad)


def test_every_citation_of_a_readme_section_names_a_heading_that_is_there() -> None:
    # The README is a front page now: its reference sections moved to docs/.
    titles = headings(ROOT / "README.md")
    bad = []
    for rel in repository_files():
        text = _text(rel)
        if text is None:
            continue
        for m in _README_CITATION.finditer(text):
            title = _CONTINUATION.sub(" ", m.group(1)).strip()
            if title not in titles:
                bad.append(f"{rel}: README.md has no section titled {title!r}")
    assert not bad, "cite the section's new home in docs/:\n" + "\n".join(bad)


# --- the guides name every option ---------------------------------------------------------------

@functools.cache
def _sources() -> tuple[tuple[Path, str], ...]:
    return tuple((p, _read(p)) for p in sorted(PACKAGE.rglob("*.py")))


@functools.cache
def _parsed(path: Path) -> ast.Module:
    return ast.parse(_read(path))


def class_body(name: str) -> list[ast.stmt]:
    """The body of the module-level class ``name``, wherever in the package it lives (only
    the modules that mention it are parsed)."""
    declared = re.compile(rf"^class {re.escape(name)}\b", re.M)
    for path, text in _sources():
        if declared.search(text):
            for node in _parsed(path).body:
                if isinstance(node, ast.ClassDef) and node.name == name:
                    return node.body
    raise AssertionError(f"no class {name} in resilient_train/: update tests/test_docs.py")


def fields_of(name: str) -> list[str]:
    """A dataclass's fields: its annotated class-level names."""
    return [n.target.id for n in class_body(name)
            if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
            and "ClassVar" not in ast.unparse(n.annotation)]


def enum_values(name: str) -> list[str]:
    return [n.value.value for n in class_body(name)
            if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant)
            and isinstance(n.value.value, str)]


def launch_options() -> list[str]:
    """The long options of ``resilient-train launch``, read from cli/main.py's parser."""
    tree = ast.parse(_read(PACKAGE / "cli" / "main.py"))
    parsers = {t.id for node in ast.walk(tree) if isinstance(node, ast.Assign)
               and isinstance(node.value, ast.Call)
               and isinstance(node.value.func, ast.Attribute)
               and node.value.func.attr == "add_parser" and node.value.args
               and isinstance(node.value.args[0], ast.Constant)
               and node.value.args[0].value == "launch"
               for t in node.targets if isinstance(t, ast.Name)}
    assert parsers, "cli.py has no add_parser('launch'): update tests/test_docs.py"
    return [a.value for node in ast.walk(tree) if isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument"
            and isinstance(node.func.value, ast.Name) and node.func.value.id in parsers
            for a in node.args if isinstance(a, ast.Constant)
            and str(a.value).startswith("--")]


def _named(doc: str) -> set[str]:
    return set(_BACKTICKED.findall(_read(DOCS / doc)))


@pytest.mark.parametrize("doc, cls", [
    ("checkpointing.md", "CheckpointOptions"), ("checkpointing.md", "MainOptions"),
    ("checkpointing.md", "RetentionPolicy"), ("checkpointing.md", "RetryOptions"),
    ("design.md", "DistributedOptions")])
def test_every_option_field_is_documented(doc: str, cls: str) -> None:
    fields = fields_of(cls)
    assert fields, cls
    missing = [f for f in fields if f not in _named(doc)]
    assert not missing, f"docs/{doc} does not name {cls}'s fields {missing}"


def test_every_launch_option_is_documented() -> None:
    options = launch_options()
    assert "--chaos" in options and "--job-spec" in options
    text = _read(DOCS / "launcher.md")
    missing = [o for o in options if not re.search(re.escape(o) + r"(?![\w-])", text)]
    assert not missing, f"docs/launcher.md does not name the launch options {missing}"


def test_every_fault_kind_event_field_and_cause_is_documented() -> None:
    launcher = _named("launcher.md")
    for name in ("FaultKind", "EventKind"):
        missing = [v for v in enum_values(name) if v not in launcher]
        assert not missing, f"docs/launcher.md does not name the {name} values {missing}"
    missing = [f for f in fields_of("Event") if f not in launcher]
    assert not missing, f"docs/launcher.md does not name the event fields {missing}"
    platform = _named("platform.md")
    for name in ("Cause", "Action"):
        missing = [v for v in enum_values(name) if v not in platform]
        assert not missing, f"docs/platform.md does not name the {name} values {missing}"

"""The shape of the code, stated as specifications and checked on every run.

Every module under mdcli/ is read with `ast` (nothing is imported), and its first-party imports
are collected, those inside function bodies included: an import inside a function is still a
dependency, only a hidden one. From that graph:

* no import cycles;
* no module over 500 lines;
* the commands use only the public API (`COMMANDS_MAY_IMPORT`, written once below);
* a first-party import inside a function says why, in a comment on its line or the line above
  (above it or above the group of imports it is written in).

Other work in issue 12 (the run layer, the recipes package) is moving modules that still break
these rules; the allowlists below name each such offender, in those files only. They are being
fixed in issue 12; remove the entries when it is merged. The test also fails when an allowlisted
offender has been fixed, so the lists cannot outlive the problems they excuse.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parent.parent / "mdcli"
MAX_LINES = 500

# What mdcli/cli/ may import from mdcli: the public API and the layers a command line is
# made of. A name ending in ".*" also allows everything under it.
COMMANDS_MAY_IMPORT = (
    "mdcli",  # the package: its lazily exported API (load_model, ask_many, ...)
    "mdcli.api",  # the Python API the README promises the commands use
    "mdcli.errors",  # the error types every command turns into exit codes
    "mdcli.events",  # the event types the API yields
    "mdcli.recipes",  # the recipe API (load, check, compile); its package's __init__ only
    "mdcli.render.*",  # presentation: the renderers and their console helpers
    "mdcli.cli.*",  # shared options and helpers between commands
    "mdcli.bench.*",  # the benchmark harness, which exists only for `mdcli bench`
)

# -- today's offenders, in files other work in issue 12 is rewriting -----------------------------
# Being fixed in issue 12; remove when merged.
KNOWN_CYCLES: set[frozenset[str]] = set()
# Being fixed in issue 12; remove when merged.
LONG_MODULES: set[str] = set()
# Being fixed in issue 12; remove when merged.
LAZY_IMPORT_FILES: set[str] = set()
# Being fixed in issue 12; remove when merged.
COMMANDS_OFF_API: set[str] = set()


@dataclass(frozen=True)
class Import:
    """One first-party import: the module it names, where it is, and whether it runs lazily."""

    target: str
    line: int
    in_function: bool


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def relative_path(path: Path) -> str:
    return path.relative_to(PACKAGE_ROOT.parent).as_posix()


def all_modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE_ROOT.rglob("*.py"))}


MODULES = all_modules()


def first_party_imports(path: Path) -> list[Import]:
    """Every import of an mdcli module in `path`, at any depth. `from mdcli import api` counts as
    importing mdcli.api (a module), `from mdcli import __version__` as importing mdcli; relative
    imports are resolved against the module's package. Imports under `if TYPE_CHECKING:` are
    left out: they never run."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[Import] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child, in_function)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "mdcli" or alias.name.startswith("mdcli."):
                    found.append(Import(alias.name, node.lineno, in_function))
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, package)
            if base == "mdcli" or base.startswith("mdcli."):
                for alias in node.names:
                    submodule = f"{base}.{alias.name}"
                    found.append(Import(submodule if submodule in MODULES else base, node.lineno, in_function))
        inside = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, inside)

    visit(tree, False)
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _absolute(node: ast.ImportFrom, package: str) -> str:
    if not node.level:
        return node.module or ""
    parts = package.split(".")
    base = ".".join(parts[: len(parts) - node.level + 1])
    return f"{base}.{node.module}" if node.module else base


def import_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {name: set() for name in MODULES}
    for name, path in MODULES.items():
        for found in first_party_imports(path):
            if found.target != name:
                graph[name].add(found.target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Every strongly connected component of more than one module: modules that import each
    other, directly or round a loop."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def connect(node: str) -> None:  # Tarjan's algorithm
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(component)

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return components


def chain(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A readable loop through a cycle: the shortest path from its first module back to itself."""
    start = min(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for target in sorted(graph[node] & component):
                if target == start:
                    return paths[node] + [start]
                if target not in paths:
                    paths[target] = paths[node] + [target]
                    following.append(target)
        frontier = following
    return sorted(component)


def may_import_from_commands(target: str) -> bool:
    for allowed in COMMANDS_MAY_IMPORT:
        if allowed.endswith(".*"):
            prefix = allowed[:-2]
            if target == prefix or target.startswith(prefix + "."):
                return True
        elif target == allowed:
            return True
    return False


def has_why_comment(lines: list[str], statement: Import, import_lines: set[int]) -> bool:
    """A comment on the import's line, or on the line above it or above the block of imports it
    belongs to (one comment may explain a group of imports written together)."""
    if "#" in lines[statement.line - 1]:
        return True
    line = statement.line - 1
    while line in import_lines:
        if "#" in lines[line - 1]:
            return True
        line -= 1
    return line >= 1 and lines[line - 1].strip().startswith("#")


def import_lines_of(path: Path) -> set[int]:
    """The line numbers every import statement in `path` spans (any module, any depth)."""
    spans: set[int] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            spans.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    return spans


# -- the specifications -------------------------------------------------------------------------


def test_the_import_graph_sees_imports_inside_functions_and_relative_imports():
    # The graph is only as good as its parser: check it on the cases that hide dependencies.
    assert "mdcli.api" in graph_of("mdcli")  # mdcli/__init__.py imports the API lazily
    assert "mdcli.render.base" in graph_of("mdcli.render")  # a package re-exporting its modules
    assert _absolute(ast.parse("from .base import x").body[0], "mdcli.render") == "mdcli.render.base"
    assert _absolute(ast.parse("from .. import errors").body[0], "mdcli.render") == "mdcli"
    loops = {"a": {"b"}, "b": {"c", "d"}, "c": {"a"}, "d": {"b"}, "e": {"a"}}
    assert cycles(loops) == [{"a", "b", "c", "d"}]
    assert chain(loops, {"a", "b", "c", "d"}) == ["a", "b", "c", "a"]


def graph_of(name: str) -> set[str]:
    return import_graph()[name]


def test_no_import_cycles():
    graph = import_graph()
    found = cycles(graph)
    unexpected = [component for component in found if frozenset(component) not in KNOWN_CYCLES]
    assert not unexpected, "import cycles:\n" + "\n".join(
        " -> ".join(chain(graph, component)) + f"  (modules in the cycle: {sorted(component)})"
        for component in unexpected
    )
    fixed = KNOWN_CYCLES - {frozenset(component) for component in found}
    assert not fixed, f"no longer cycles, remove them from KNOWN_CYCLES: {sorted(map(sorted, fixed))}"


def test_no_module_is_over_500_lines():
    lengths = {relative_path(path): len(path.read_text(encoding="utf-8").splitlines()) for path in MODULES.values()}
    long = {path: count for path, count in lengths.items() if count > MAX_LINES}
    unexpected = {path: count for path, count in long.items() if path not in LONG_MODULES}
    assert not unexpected, f"modules over {MAX_LINES} lines (split them by job): {unexpected}"
    fixed = LONG_MODULES - set(long)
    assert not fixed, f"no longer over {MAX_LINES} lines, remove them from LONG_MODULES: {sorted(fixed)}"


def test_commands_use_only_the_public_api():
    off_api: dict[str, list[str]] = {}
    for name, path in MODULES.items():
        if not name.startswith("mdcli.cli."):
            continue
        outside = sorted({i.target for i in first_party_imports(path) if not may_import_from_commands(i.target)})
        if outside:
            off_api[relative_path(path)] = outside
    unexpected = {path: targets for path, targets in off_api.items() if path not in COMMANDS_OFF_API}
    assert not unexpected, f"commands importing past the public API (see COMMANDS_MAY_IMPORT): {unexpected}"
    fixed = COMMANDS_OFF_API - set(off_api)
    assert not fixed, f"now on the public API, remove them from COMMANDS_OFF_API: {sorted(fixed)}"


def test_first_party_imports_inside_functions_say_why():
    unexplained: dict[str, list[int]] = {}
    for path in MODULES.values():
        lines = path.read_text(encoding="utf-8").splitlines()
        spans = import_lines_of(path)
        bare = [i.line for i in first_party_imports(path) if i.in_function and not has_why_comment(lines, i, spans)]
        if bare:
            unexplained[relative_path(path)] = sorted(set(bare))
    unexpected = {path: lines for path, lines in unexplained.items() if path not in LAZY_IMPORT_FILES}
    assert not unexpected, (
        "first-party imports inside functions without a comment saying why (move them to the top, "
        f"or say why on the line or the line above): {unexpected}"
    )
    fixed = LAZY_IMPORT_FILES - set(unexplained)
    assert not fixed, f"no unexplained lazy imports left, remove them from LAZY_IMPORT_FILES: {sorted(fixed)}"


def test_the_command_line_starts_without_torch():
    # `mdcli --help` must answer at once: the CLI and the package import neither torch nor
    # transformers; they come with the first command that runs a model.
    code = (
        "import sys, mdcli, mdcli.cli.app; "
        "heavy = [m for m in ('torch', 'transformers') if m in sys.modules]; "
        "assert not heavy, heavy"
    )
    env = {**os.environ, "PYTHONPATH": str(PACKAGE_ROOT.parent)}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr


def test_the_literal_defaults_in_commands_are_the_apis():
    # commands/margins.py spells the API's defaults as literals (importing them would load the
    # decoding stack on `mdcli --help`): they must not drift apart.
    from mdcli import api
    from mdcli.cli import margins

    assert (margins._SEGMENT_TOKENS, margins._MIN_SEGMENT_TOKENS) == (api.DEFAULT_SEGMENT_TOKENS, api.MIN_SEGMENT_TOKENS)
    assert (margins._MARGIN_TOKENS, margins._CLASSIFY_TOKENS, margins._ANSWER_TOKENS) == (
        api.DEFAULT_MARGIN_TOKENS, api.DEFAULT_CLASSIFY_TOKENS, api.DEFAULT_ANSWER_TOKENS,
    )

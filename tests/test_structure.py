"""The shape of the code, stated as specifications and checked on every run.

Every module under mdcli/ is read with `ast` (nothing is imported), and its imports are
collected, those inside function bodies and under `if TYPE_CHECKING:` included: an import inside a
function is still a dependency, only a hidden one, and an import for annotations is still a
dependency of meaning. From that graph and those trees:

* no import cycle, TYPE_CHECKING imports included;
* the layers: lower layers never import higher ones (`LAYER_RULES`, written once below);
* the commands use only the public API (`COMMANDS_MAY_IMPORT`);
* imports inside functions only at the one lazy boundary that keeps `mdcli --help` from loading
  torch (`LAZY_BOUNDARY`), and there they say why;
* no assignment to any attribute of torch or transformers, and no write to the environment;
* the environment is read in mdcli/settings.py only;
* at most a dozen modules at the top of mdcli/, every package folder with a docstring;
* no module over 500 lines;
* `mdcli --help` starts without torch, transformers, pydantic, yaml, rich or numpy (the one test of it).

Each rule holds everywhere: no module is excused. The one exception is written with its rule:
settings.py, the registry, writes the one variable mdcli sets (the OpenMP wait policy).
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
MAX_TOP_MODULES = 12

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
    "mdcli.settings",  # the registry: the process's defaults set before torch loads (app.main)
    "mdcli.distributed.*",  # --each on Ray: imported only for --workers / --ray-address, so the API never loads Ray
)

# The layers, bottom up: each rule is (layer, "only" | "never", packages). "only": the layer
# imports nothing from mdcli but these; "never": it imports none of these. A name covers its
# submodules.
LAYER_RULES = (
    # the engine is handed its forward and its plan: no host rule, no tokenizer, no CLI
    ("mdcli.core", "only", ("mdcli.core", "mdcli.speculative", "mdcli.prefixes", "mdcli.events", "mdcli.errors",
                            "mdcli.settings")),
    # speculation sits below the step loop, which imports it: one direction only, speculative never imports core
    ("mdcli.speculative", "only", ("mdcli.speculative", "mdcli.prefixes", "mdcli.events", "mdcli.errors", "mdcli.settings")),
    # how one forward runs on this host: handed to the engine, never reaching up into it
    ("mdcli.backends", "never", ("mdcli.core", "mdcli.strategies", "mdcli.cli", "mdcli.render", "mdcli.recipes", "mdcli.api")),
    ("mdcli.models", "never", ("mdcli.core", "mdcli.strategies", "mdcli.cli", "mdcli.render", "mdcli.recipes")),
    # the prompt cache on disk: handed to the run as core's PrefixStore, built at load (models); it
    # counts token prefixes as the engine does, and shares the cache files' rules with the model loader
    ("mdcli.prompt_cache", "only", ("mdcli.prompt_cache", "mdcli.core.prefix_store", "mdcli.prefixes", "mdcli.errors",
                                    "mdcli.events", "mdcli.settings", "mdcli.cache_files")),
    # the ground floor: the cache files' rules and token prefixes, the standard library only
    ("mdcli.cache_files", "only", ()),
    ("mdcli.prefixes", "only", ()),
    # output constraints: the llguidance adapter behind core's ConstraintState protocol; it knows core's
    # protocol and a tokenizer, never a backend, a model loader, a strategy or the CLI
    ("mdcli.constraints", "only", ("mdcli.constraints", "mdcli.core", "mdcli.errors")),
    # renderers read events only
    ("mdcli.render", "never", ("mdcli.core", "mdcli.backends", "mdcli.models")),
    # documents are text, paths and a token counter handed in: read, chunked, ranked, never run
    ("mdcli.documents", "only", ("mdcli.documents", "mdcli.events", "mdcli.errors")),
    # --each on Ray: a driver and its actors over the strategies' run_each and the model loader; nothing
    # below imports it (the API would load Ray with it), only the command line, for --workers
    ("mdcli.distributed", "only", ("mdcli.distributed", "mdcli.strategies", "mdcli.models", "mdcli.documents",
                                   "mdcli.events", "mdcli.errors")),
    ("mdcli.api", "never", ("mdcli.distributed",)),
)
# The command line is the top: only these import it.
MAY_IMPORT_THE_CLI = ("mdcli.cli", "mdcli.__main__", "mdcli.bench")

# The lazy boundaries: `mdcli --help` must not load torch, so the package's __init__ (PEP 562
# exports of the API) and the command modules (which import mdcli.api inside the command they run)
# may import inside functions; and bm25s is imported only when retrieval is asked for, because
# where jax is installed importing it runs a jax op (seconds, and most of a GPU's memory).
# Everywhere else imports go at the top of the module. A path ending in "/" covers its folder.
LAZY_BOUNDARY = ("mdcli/__init__.py", "mdcli/cli/", "mdcli/documents/retrieve.py")

HEAVY_PACKAGES = ("torch", "transformers")  # process-wide state mdcli must never assign to
ENVIRONMENT_MODULE = "mdcli/settings.py"  # the only module that reads the environment
# settings.py gives the command line's process its OpenMP spin before torch loads (process_defaults),
# where the environment leaves OpenMP's waiting unset: the one variable mdcli writes, declared
# in the registry beside the rest; no other module writes the environment or torch's or transformers' state
WRITES_ITS_ENVIRONMENT = ENVIRONMENT_MODULE


@dataclass(frozen=True)
class Import:
    """One import of a module: the module it names, where it is, whether it runs lazily (inside a
    function) and whether it runs at all (under `if TYPE_CHECKING:`, for annotations only)."""

    target: str
    line: int
    in_function: bool
    type_checking: bool = False


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def relative_path(path: Path) -> str:
    return path.relative_to(PACKAGE_ROOT.parent).as_posix()


def all_modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE_ROOT.rglob("*.py"))}


MODULES = all_modules()


def parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"))


def imports_in(tree: ast.AST, package: str) -> list[Import]:
    """Every import in `tree`, at any depth, of any module. `from mdcli import api` counts as
    importing mdcli.api (a module), `from mdcli import __version__` as importing mdcli; relative
    imports are resolved against `package`, the module's package."""
    found: list[Import] = []

    def visit(node: ast.AST, in_function: bool, type_checking: bool) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, in_function, True)
            for child in node.orelse:
                visit(child, in_function, type_checking)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.append(Import(alias.name, node.lineno, in_function, type_checking))
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, package)
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                target = submodule if submodule in MODULES else base
                found.append(Import(target, node.lineno, in_function, type_checking))
        inside = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, inside, type_checking)

    visit(tree, False, False)
    return found


def package_of(path: Path) -> str:
    name = module_name(path)
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def first_party(target: str) -> bool:
    return target == "mdcli" or target.startswith("mdcli.")


def first_party_imports(path: Path) -> list[Import]:
    """Every import of an mdcli module in `path`, TYPE_CHECKING and function bodies included."""
    return [i for i in imports_in(parse(path), package_of(path)) if first_party(i.target)]


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


def within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def layer_breaches(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    """Every (module, module it imports) that LAYER_RULES or MAY_IMPORT_THE_CLI forbid."""
    breaches = set()
    for name, targets in graph.items():
        for target in targets:
            for layer, kind, packages in LAYER_RULES:
                if not within(name, layer):
                    continue
                listed = any(within(target, package) for package in packages)
                if listed != (kind == "only"):
                    breaches.add((name, target))
            if within(target, "mdcli.cli") and not any(within(name, allowed) for allowed in MAY_IMPORT_THE_CLI):
                breaches.add((name, target))
    return breaches


def may_import_from_commands(target: str) -> bool:
    for allowed in COMMANDS_MAY_IMPORT:
        if allowed.endswith(".*"):
            prefix = allowed[:-2]
            if target == prefix or target.startswith(prefix + "."):
                return True
        elif target == allowed:
            return True
    return False


def at_lazy_boundary(path: Path) -> bool:
    relative = relative_path(path)
    return any(relative.startswith(place) if place.endswith("/") else relative == place for place in LAZY_BOUNDARY)


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
    for node in ast.walk(parse(path)):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            spans.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    return spans


def _root(node: ast.expr) -> ast.expr:
    """The start of an attribute / subscript chain: `F` for `F.linear`, `A` for `A["sdpa"].x`."""
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node


def _chain_names(node: ast.expr) -> list[str]:
    """`os.environ.get` -> ["os", "environ", "get"]; [] when the chain does not start at a name."""
    names: list[str] = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    return [node.id, *reversed(names)] if isinstance(node, ast.Name) else []


def heavy_names(tree: ast.AST) -> set[str]:
    """The names a module binds to torch or transformers, or to anything imported from them
    (`import torch`, `import torch.nn.functional as F`, `from transformers... import X`)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in HEAVY_PACKAGES:
                    names.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] in HEAVY_PACKAGES:
            names.update(alias.asname or alias.name for alias in node.names)
    return names


def environment_names(tree: ast.AST) -> set[str]:
    """Names bound to os.environ itself (`from os import environ`)."""
    return {
        alias.asname or alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module == "os"
        for alias in node.names
        if alias.name == "environ"
    }


def _is_environment(node: ast.expr, environ: set[str]) -> bool:
    names = _chain_names(node)
    return names[:2] == ["os", "environ"] or (bool(names) and names[0] in environ)


def global_writes(tree: ast.AST) -> list[int]:
    """Lines that write process-wide state mdcli does not own: an assignment (or `del`, or
    setattr / delattr) into an attribute or item of torch, transformers or anything imported from
    them, and any write to the environment (`os.environ[...] =`, its setdefault / update / pop /
    popitem / clear, os.putenv / unsetenv)."""
    heavy, environ = heavy_names(tree), environment_names(tree)

    def global_target(target: ast.expr) -> bool:
        if isinstance(target, (ast.Tuple, ast.List)):
            return any(global_target(element) for element in target.elts)
        if not isinstance(target, (ast.Attribute, ast.Subscript)):
            return False
        root = _root(target)
        return (isinstance(root, ast.Name) and root.id in heavy) or _is_environment(
            target.value if isinstance(target, ast.Subscript) else target, environ
        )

    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        elif isinstance(node, ast.Call):
            function = _chain_names(node.func)
            if function in (["setattr"], ["delattr"]) and node.args:
                root = _root(node.args[0])
                if isinstance(root, ast.Name) and root.id in heavy:
                    lines.append(node.lineno)
            elif function in (["os", "putenv"], ["os", "unsetenv"]) or (
                isinstance(node.func, ast.Attribute)
                and node.func.attr in ("setdefault", "update", "pop", "popitem", "clear")
                and _is_environment(node.func.value, environ)
            ):
                lines.append(node.lineno)
            continue
        else:
            continue
        if any(global_target(target) for target in targets):
            lines.append(node.lineno)
    return sorted(set(lines))


def environment_reads(tree: ast.AST) -> list[int]:
    """Lines that touch the environment: os.environ, os.getenv, `from os import environ / getenv`."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "os":
            if node.attr in ("environ", "getenv", "environb", "getenvb"):
                lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "os":
            if any(alias.name in ("environ", "getenv", "environb", "getenvb") for alias in node.names):
                lines.append(node.lineno)
    return sorted(set(lines))


def package_folders() -> list[Path]:
    """Every folder under mdcli/ (mdcli/ included) that holds Python modules."""
    return sorted({path.parent for path in PACKAGE_ROOT.rglob("*.py")})


# -- the specifications -------------------------------------------------------------------------


def test_the_import_graph_sees_imports_inside_functions_type_checking_and_relative_imports():
    # The graph is only as good as its parser: check it on the cases that hide dependencies.
    assert "mdcli.api" in graph_of("mdcli")  # mdcli/__init__.py imports the API lazily
    assert "mdcli.render.base" in graph_of("mdcli.render")  # a package re-exporting its modules
    assert _absolute(ast.parse("from .base import x").body[0], "mdcli.render") == "mdcli.render.base"
    assert _absolute(ast.parse("from .. import errors").body[0], "mdcli.render") == "mdcli"
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from mdcli.events import Event\nelse:\n    import json\n"
    found = {i.target: i.type_checking for i in imports_in(ast.parse(source), "mdcli.core")}
    assert found == {"typing": False, "mdcli.events": True, "json": False}
    loops = {"a": {"b"}, "b": {"c", "d"}, "c": {"a"}, "d": {"b"}, "e": {"a"}}
    assert cycles(loops) == [{"a", "b", "c", "d"}]
    assert chain(loops, {"a", "b", "c", "d"}) == ["a", "b", "c", "a"]


def graph_of(name: str) -> set[str]:
    return import_graph()[name]


def test_no_import_cycles_type_checking_imports_included():
    graph = import_graph()
    found = cycles(graph)
    assert not found, "import cycles:\n" + "\n".join(
        " -> ".join(chain(graph, component)) + f"  (modules in the cycle: {sorted(component)})"
        for component in found
    )


def test_the_layer_rules_see_what_they_forbid():
    graph = {
        "mdcli.core.run": {"mdcli.models.load", "mdcli.core.engine", "mdcli.settings"},
        "mdcli.render.live": {"mdcli.events", "mdcli.core.forest"},
        "mdcli.api": {"mdcli.cli.common"},
        "mdcli.cli.app": {"mdcli.cli.run"},
        "mdcli.speculative.drafting": {"mdcli.core.forest", "mdcli.prefixes"},  # core imports speculative, never back
        "mdcli.core.verify": {"mdcli.speculative.drafting"},
    }
    assert layer_breaches(graph) == {
        ("mdcli.speculative.drafting", "mdcli.core.forest"),
        ("mdcli.core.run", "mdcli.models.load"),
        ("mdcli.render.live", "mdcli.core.forest"),
        ("mdcli.api", "mdcli.cli.common"),
    }


def test_lower_layers_never_import_higher_ones():
    breaches = sorted(f"{name} -> {target}" for name, target in layer_breaches(import_graph()))
    assert not breaches, f"imports across the layers (see LAYER_RULES): {breaches}"


def test_no_module_is_over_500_lines():
    lengths = {relative_path(path): len(path.read_text(encoding="utf-8").splitlines()) for path in MODULES.values()}
    long = {path: count for path, count in lengths.items() if count > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them by job): {long}"


def test_at_most_a_dozen_modules_at_the_top_of_the_package():
    top = sorted(path.name for path in PACKAGE_ROOT.glob("*.py"))
    assert len(top) <= MAX_TOP_MODULES, f"{len(top)} modules directly in mdcli/ (the rest go in a layer's folder): {top}"


def test_every_package_folder_says_what_it_is_in_its_docstring():
    missing = {}
    for folder in package_folders():
        init = folder / "__init__.py"
        if not init.exists():
            missing[relative_path(init)] = "no __init__.py"
        elif not ast.get_docstring(parse(init)):
            missing[relative_path(init)] = "no docstring"
    assert not missing, f"package folders without a docstring: {missing}"


def test_commands_use_only_the_public_api():
    off_api: dict[str, list[str]] = {}
    for name, path in MODULES.items():
        if not name.startswith("mdcli.cli."):
            continue
        outside = sorted({i.target for i in first_party_imports(path) if not may_import_from_commands(i.target)})
        if outside:
            off_api[relative_path(path)] = outside
    assert not off_api, f"commands importing past the public API (see COMMANDS_MAY_IMPORT): {off_api}"


def test_imports_inside_functions_only_at_the_lazy_boundary():
    inside: dict[str, list[int]] = {}
    for path in MODULES.values():
        if at_lazy_boundary(path):
            continue
        lines = sorted({i.line for i in imports_in(parse(path), package_of(path)) if i.in_function})
        if lines:
            inside[relative_path(path)] = lines
    assert not inside, (
        f"imports inside functions outside the lazy boundary {LAZY_BOUNDARY} (move them to the top of the module): "
        f"{inside}"
    )


def test_first_party_imports_inside_functions_say_why():
    unexplained: dict[str, list[int]] = {}
    for path in MODULES.values():
        lines = path.read_text(encoding="utf-8").splitlines()
        spans = import_lines_of(path)
        bare = [i.line for i in first_party_imports(path) if i.in_function and not has_why_comment(lines, i, spans)]
        if bare:
            unexplained[relative_path(path)] = sorted(set(bare))
    assert not unexplained, (
        "first-party imports inside functions without a comment saying why (move them to the top, "
        f"or say why on the line or the line above): {unexplained}"
    )


def test_the_global_write_check_sees_patches_and_environment_writes():
    source = """
import os
import torch.nn.functional as F
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from os import environ
F.linear = mine
ALL_ATTENTION_FUNCTIONS["sdpa"] = mine
del ALL_ATTENTION_FUNCTIONS["sdpa"]
setattr(F, "linear", mine)
os.environ["X"] = "1"
os.environ.setdefault("X", "1")
environ.update(X="1")
os.putenv("X", "1")
model.weight = mine
setattr(layer, "proj", mine)
value = os.environ.get("X")
"""
    assert global_writes(ast.parse(source)) == [6, 7, 8, 9, 10, 11, 12, 13]
    assert environment_reads(ast.parse(source)) == [5, 10, 11, 16]


def test_nothing_assigns_to_torch_transformers_or_the_environment():
    found = {relative_path(path): lines for path in MODULES.values()
             if relative_path(path) != WRITES_ITS_ENVIRONMENT and (lines := global_writes(parse(path)))}
    assert not found, (
        "writes to torch's or transformers' attributes or items, or to the environment (hand the engine its "
        f"forward instead; pass a subprocess its environment, settings.child_environment): {found}"
    )


def test_the_environment_is_read_in_settings_only():
    found = {
        relative_path(path): lines
        for path in MODULES.values()
        if relative_path(path) != ENVIRONMENT_MODULE and (lines := environment_reads(parse(path)))
    }
    assert not found, (
        f"the environment read outside {ENVIRONMENT_MODULE} (declare the variable there, read settings.current()): "
        f"{found}"
    )


def test_the_command_line_starts_without_torch():
    # `mdcli --help` must answer at once: the package and the CLI import none of the heavy modules
    # (the decoding stack, model loading, pydantic, yaml, rich, numpy), which come with the first
    # command that runs; the renderers, which read events only, never import torch
    code = (
        "import sys, mdcli, mdcli.cli.app; "
        "heavy = [m for m in ('torch', 'transformers', 'mdcli.models.load', 'pydantic', 'yaml', 'rich', 'numpy') "
        "if m in sys.modules]; "
        "assert not heavy, heavy; "
        "import mdcli.render; "
        "assert 'torch' not in sys.modules, 'mdcli.render imported torch'"
    )
    env = {**os.environ, "PYTHONPATH": str(PACKAGE_ROOT.parent)}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr


def test_the_literal_defaults_in_commands_are_the_apis():
    # mdcli/cli/margins.py spells the API's defaults as literals (importing them would load the
    # decoding stack on `mdcli --help`): they must not drift apart.
    from mdcli import api
    from mdcli.cli import margins

    assert (margins._SEGMENT_TOKENS, margins._MIN_SEGMENT_TOKENS) == (api.DEFAULT_SEGMENT_TOKENS, api.MIN_SEGMENT_TOKENS)
    assert (margins._MARGIN_TOKENS, margins._CLASSIFY_TOKENS, margins._ANSWER_TOKENS) == (
        api.DEFAULT_MARGIN_TOKENS, api.DEFAULT_CLASSIFY_TOKENS, api.DEFAULT_ANSWER_TOKENS,
    )

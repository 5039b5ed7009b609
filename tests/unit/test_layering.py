"""The package's layering, read from its source with ``ast``: every import counts, also
those inside functions and under ``TYPE_CHECKING`` (an import hidden in a function still
ties the two modules together; it only hides the tie from a reader).

Layers, lowest first; a module imports only its own layer or lower (issue 11)::

    agent/                                   (stdlib only: it runs inside the sandbox)
    errors settings sanitize host layout logs metrics   (and the package's __init__)
    workspace/
    egress/                                  (the host side of the sandbox's proxy)
    backends/
    sessions/
    run/
    service
    server/  doctor/  provision/             (provision/ is build time only)
    cli  cli_help  __main__

On top of the order: only ``server/`` imports the MCP SDK, no other module of
``sessions/`` imports its manager, only ``settings`` reads the process environment,
nothing imports a private (``_name``) of another module, and the import graph between
modules has no cycle. Each rule is one test, and its failure lists every offending
import as ``module:line -> target``.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

import mcp_code_sandbox

PACKAGE = "mcp_code_sandbox"
ROOT = Path(mcp_code_sandbox.__file__).resolve().parent

#: Lowest first. A key is a module's first name under the package (its top-level
#: module or subpackage); the package's own ``__init__`` is ``""``.
LAYERS: tuple[frozenset[str], ...] = (
    frozenset({"agent"}),
    frozenset(
        {"", "errors", "settings", "sanitize", "host", "layout", "logs", "metrics", "tracing"}
    ),
    frozenset({"workspace"}),
    frozenset({"egress"}),
    frozenset({"backends"}),
    frozenset({"sessions"}),
    frozenset({"run"}),
    frozenset({"service"}),
    frozenset({"server", "doctor", "provision"}),
    frozenset({"cli", "cli_help", "__main__"}),
)
#: The request path: it never imports build-time code.
REQUEST_PATH = frozenset({"backends", "sessions", "run", "service", "server"})
#: The MCP SDK's top-level packages (v2 ships its types as ``mcp_types``).
MCP_SDK = frozenset({"mcp", "mcp_types"})
#: Reading the process environment; ``settings`` reads it once, for everyone.
ENVIRON_READS = frozenset({"environ", "environb", "getenv", "getenvb"})


@dataclass(frozen=True)
class Import:
    """One imported thing: ``target`` is a module, ``name`` an attribute of it or None."""

    module: str  # the importing module, dotted
    line: int
    target: str  # dotted; absolute, relative imports resolved
    name: str | None = None

    def __str__(self) -> str:
        what = f"{self.target}.{self.name}" if self.name else self.target
        return f"{self.module}:{self.line} -> {what}"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def _sources() -> dict[str, tuple[Path, ast.Module]]:
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        found[_module_name(path)] = (path, ast.parse(path.read_bytes(), str(path)))
    return found


def _is_package(module: str) -> bool:
    return _sources()[module][0].name == "__init__.py"


def _resolve(module: str, node: ast.ImportFrom) -> str:
    """The absolute module a ``from ... import`` names (PEP 328 relative levels)."""
    if not node.level:
        return node.module or ""
    base = module.split(".")
    # ``from . import x`` in a package's __init__ is relative to the package itself.
    base = base if _is_package(module) else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def _imports_of(module: str, tree: ast.Module) -> Iterator[Import]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(module, node.lineno, alias.name)
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, node)
            for alias in node.names:
                submodule = f"{target}.{alias.name}"
                if submodule in _sources():
                    yield Import(module, node.lineno, submodule)
                else:
                    yield Import(module, node.lineno, target, alias.name)


@cache
def _all_imports() -> tuple[Import, ...]:
    return tuple(
        imp for module, (_, tree) in _sources().items() for imp in _imports_of(module, tree)
    )


def _ours(dotted: str) -> bool:
    return dotted == PACKAGE or dotted.startswith(PACKAGE + ".")


def _area(dotted: str) -> str:
    """``mcp_code_sandbox.backends.docker.spec`` -> ``backends``; the package -> ``""``."""
    return dotted.split(".")[1] if dotted.count(".") else ""


def _layer(dotted: str) -> int:
    area = _area(dotted)
    for index, members in enumerate(LAYERS):
        if area in members:
            return index
    raise AssertionError(f"{dotted} is in no layer: give {area!r} one in LAYERS")


def _fail_if(offences: list[str], rule: str) -> None:
    if offences:
        pytest.fail(f"{rule} ({len(offences)}):\n  " + "\n  ".join(offences), pytrace=False)


def test_every_module_has_a_layer() -> None:
    for module in _sources():
        _layer(module)


def test_the_agent_imports_only_the_standard_library_and_itself() -> None:
    """It runs inside the sandbox as ``mcs_agent``, where the host package does not exist."""
    agent = f"{PACKAGE}.agent"
    offences = [
        str(imp)
        for imp in _all_imports()
        if _area(imp.module) == "agent"
        and not (imp.target == agent or imp.target.startswith(agent + "."))
        and imp.target.split(".")[0] not in sys.stdlib_module_names
    ]
    _fail_if(offences, "agent/ imports something that is neither stdlib nor agent/")


def test_the_agent_imports_itself_relatively() -> None:
    """Absolute ``mcp_code_sandbox.agent`` imports break inside the sandbox (``mcs_agent``)."""
    offences = [
        f"{module}:{node.lineno} -> {node.module}"
        for module, (_, tree) in _sources().items()
        if _area(module) == "agent"
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and not node.level and _ours(node.module or "")
    ] + [
        f"{module}:{node.lineno} -> {alias.name}"
        for module, (_, tree) in _sources().items()
        if _area(module) == "agent"
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
        if _ours(alias.name)
    ]
    _fail_if(offences, "agent/ imports its own package absolutely")


def test_only_the_server_imports_the_mcp_sdk() -> None:
    offences = [
        str(imp)
        for imp in _all_imports()
        if imp.target.split(".")[0] in MCP_SDK and _area(imp.module) != "server"
    ]
    _fail_if(offences, "the MCP SDK imported outside server/")


def test_no_module_imports_a_higher_layer() -> None:
    offences = [
        f"{imp} (layer {_layer(imp.module)} imports layer {_layer(imp.target)})"
        for imp in _all_imports()
        if _ours(imp.target) and _layer(imp.target) > _layer(imp.module)
    ]
    _fail_if(offences, "imports of a higher layer")


def test_backends_import_no_session_run_service_server_doctor_or_provision() -> None:
    banned = {"sessions", "run", "service", "server", "doctor", "provision"}
    offences = [
        str(imp)
        for imp in _all_imports()
        if _area(imp.module) == "backends" and _ours(imp.target) and _area(imp.target) in banned
    ]
    _fail_if(offences, "backends/ imports what sits above the seam")


def test_no_module_of_sessions_imports_the_manager() -> None:
    """The manager wires its rooms (table, reaper, ending, pausing, ...) together; they
    are below it and know it not, so each is testable without the whole manager."""
    manager = f"{PACKAGE}.sessions.manager"
    offences = [
        str(imp)
        for imp in _all_imports()
        if _area(imp.module) == "sessions" and imp.module != manager and imp.target == manager
    ]
    _fail_if(offences, "sessions/ imports the session manager")


def test_the_request_path_never_imports_build_time_code() -> None:
    offences = [
        str(imp)
        for imp in _all_imports()
        if _area(imp.module) in REQUEST_PATH
        and _ours(imp.target)
        and _area(imp.target) == "provision"
    ]
    _fail_if(offences, "provision/ (build time) imported by the request path")


def _environ_reads(module: str, tree: ast.Module) -> Iterator[str]:
    os_names = {"os"}  # ``import os as x`` binds x
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            os_names |= {
                alias.asname for alias in node.names if alias.name == "os" and alias.asname
            }
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and node.attr in ENVIRON_READS
            and isinstance(node.value, ast.Name)
            and node.value.id in os_names
        ):
            yield f"{module}:{node.lineno} -> os.{node.attr}"
        elif isinstance(node, ast.ImportFrom) and node.module == "os":
            for alias in node.names:
                if alias.name in ENVIRON_READS:
                    yield f"{module}:{node.lineno} -> from os import {alias.name}"


def test_only_settings_reads_the_process_environment() -> None:
    """The agent is exempt: it is another program, and its environment is the sandbox's."""
    offences = [
        offence
        for module, (_, tree) in _sources().items()
        if _area(module) not in {"settings", "agent"}
        for offence in dict.fromkeys(_environ_reads(module, tree))  # once per line
    ]
    _fail_if(offences, "the process environment read outside settings")


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _stdlib(dotted: str) -> bool:
    """The standard library's underscored names are documented API (``os._exit``)."""
    return dotted.split(".")[0] in sys.stdlib_module_names


def _module_aliases(tree: ast.Module, module: str) -> dict[str, str]:
    """Local names bound to a module by an import: ``name -> dotted module``."""
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                aliases[alias.asname or alias.name.split(".")[0]] = (
                    alias.name if alias.asname else alias.name.split(".")[0]
                )
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, node)
            for alias in node.names:
                if f"{target}.{alias.name}" in _sources():
                    aliases[alias.asname or alias.name] = f"{target}.{alias.name}"
    return aliases


#: Private modules of other packages we read on purpose, each with why.
_PRIVATE_ON_PURPOSE = {
    # pip has no public API for the index it uses by default: the ``pypi`` preset reads
    # pip's own constant rather than write a registry's host name into this project.
    "pip._internal.models.index",
}


def test_no_module_imports_a_private_name_of_another() -> None:
    """``from x import _y``, ``import x._y`` and ``x._y`` with ``x`` an imported module."""
    offences = [
        str(imp)
        for imp in _all_imports()
        if imp.target != imp.module
        and not _stdlib(imp.target)
        and imp.target not in _PRIVATE_ON_PURPOSE
        and (
            (imp.name is not None and _private(imp.name))
            or any(_private(part) for part in imp.target.split("."))
        )
    ]
    for module, (_, tree) in _sources().items():
        aliases = _module_aliases(tree, module)
        offences += [
            f"{module}:{node.lineno} -> {aliases[node.value.id]}.{node.attr}"
            for node in ast.walk(tree)
            if isinstance(node, ast.Attribute)
            and _private(node.attr)
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
            and aliases[node.value.id] != module
            and not _stdlib(aliases[node.value.id])
        ]
    _fail_if(offences, "private names of another module")


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {module: set() for module in _sources()}
    for imp in _all_imports():
        if imp.target in graph and imp.target != imp.module:
            graph[imp.module].add(imp.target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_cycles_between_modules() -> None:
    """A package importing its own submodules (``backends/__init__`` -> ``backends.base``)
    is an edge like any other; the implicit import of a parent package is not."""
    graph = _graph()
    offences = []
    for component in _cycles(graph):
        members = set(component)
        edges = [
            str(imp)
            for imp in _all_imports()
            if imp.module in members and imp.target in members and imp.target != imp.module
        ]
        offences.append(" <-> ".join(component) + "\n    " + "\n    ".join(edges))
    _fail_if(offences, "import cycles")


def test_the_cycle_finder_finds_a_cycle() -> None:
    """The rule above can fail: a three-module ring and a self-contained tail."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []

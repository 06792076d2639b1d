"""The gateway's packages keep their layers (docs/architecture.md): the request's life (session/) and its text
(text/) never reach into an API's shapes (native/, openai/, responses/), and no import chain inside services/gateway is deeper
than MAX_DEPTH, so a module is understood from a few others. Read from the source (ast): nothing is imported."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

# The checkout's services/gateway, wherever in tests/ this file sits (its tier's folder, or tests/ itself).
GATEWAY = next(
    p / "services" / "gateway" for p in Path(__file__).resolve().parents if (p / "services" / "gateway").is_dir()
)
PACKAGE = "services.gateway"
MAX_DEPTH = 5  # import edges from the app down to the deepest leaf
CORE_LAYERS = ("session", "text")
API_PACKAGES = ("native", "openai", "responses")


def _module_name(path: Path) -> str:
    parts = path.relative_to(GATEWAY.parents[1]).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in GATEWAY.rglob("*.py")}


def _imported(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        return [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
    return []


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def imports(module: str, runtime_only: bool) -> set[str]:
    """The gateway modules `module` imports at module level (runtime_only: not under `if TYPE_CHECKING`; imports
    inside functions are never counted: they run later, not when the module is imported)."""
    found: set[str] = set()
    todo = list(ast.parse(MODULES[module].read_text()).body)
    while todo:
        node = todo.pop()
        if runtime_only and _is_type_checking(node):
            continue
        found.update(_imported(node))
        if isinstance(node, (ast.If, ast.Try)):
            todo += (
                node.body
                + node.orelse
                + getattr(node, "finalbody", [])
                + [n for h in getattr(node, "handlers", []) for n in h.body]
            )
    return {m for m in found if m in MODULES and m not in (module, PACKAGE)}


def test_the_request_s_life_and_its_text_import_no_api_package():
    wrong = {
        m: sorted(d for d in imports(m, runtime_only=False) if d.split(".")[2] in API_PACKAGES)
        for m in MODULES
        if m.count(".") >= 3 and m.split(".")[2] in CORE_LAYERS
    }
    assert not {m: d for m, d in wrong.items() if d}


def test_no_import_chain_inside_the_gateway_is_deeper_than_five():
    graph = {m: imports(m, runtime_only=True) for m in MODULES}

    @functools.cache
    def deepest(module: str, path: tuple[str, ...] = ()) -> tuple[str, ...]:
        assert module not in path, f"import cycle: {' -> '.join((*path, module))}"
        chains = [deepest(d, (*path, module)) for d in sorted(graph[module])]
        return (module, *max(chains, key=len, default=()))

    chain = max((deepest(m) for m in sorted(MODULES)), key=len)
    assert len(chain) - 1 <= MAX_DEPTH, " -> ".join(chain)


def test_the_check_sees_the_packages_it_guards():
    """The rules above would pass on an empty or moved tree: make sure they look at the real one."""
    layers = {m.split(".")[2] for m in MODULES if m.count(".") >= 2}
    assert {*CORE_LAYERS, *API_PACKAGES, "edge", "ops"} <= layers
    assert "services.gateway.session.core" in imports("services.gateway.app", runtime_only=True)

"""The gateway's packages keep their layers (docs/architecture.md): the request's life (session/) and its text
(text/) never reach into an API's shapes (native/, openai/, responses/), and no import chain inside services/gateway is deeper
than MAX_DEPTH, so a module is understood from a few others. Read from the source (ast): nothing is imported."""

from __future__ import annotations

import functools

from tests.support.layers import Package

GATEWAY = Package("services.gateway")
MODULES = GATEWAY.modules
MAX_DEPTH = 5  # import edges from the app down to the deepest leaf
CORE_LAYERS = ("session", "text")
API_PACKAGES = ("native", "openai", "responses")


def imports(module: str, runtime_only: bool) -> set[str]:
    """The gateway modules `module` imports at module level (runtime_only: not under `if TYPE_CHECKING`)."""
    return GATEWAY.imports(module, type_checking=not runtime_only)


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

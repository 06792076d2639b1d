"""shared/ and the engine keep the layers their folders show (README, "Layout"). Read from the source (ast):
nothing is imported. Imports inside functions count here: a layer that reaches up lazily still depends on it."""

from __future__ import annotations

import pytest

from tests.support.layers import Package

SHARED = Package("shared")
ENGINE = Package("services.worker.engine")
# engine layer -> the engine layers it may never import: the kernels stand alone; the KV cache and sampling are
# what a model runner uses, never the reverse; nothing of the real engine depends on the simulator.
ENGINE_FORBIDS = {
    "cpu": {"kv", "model", "sampling", "sim", ""},
    "kv": {"model", "cpu", "sampling", "sim"},
    "sampling": {"model", "kv", "sim"},
    "model": {"sim"},
}


def _wrong(package: Package, forbids: dict[str, set[str]]) -> dict[str, list[str]]:
    out = {}
    for module in package.modules:
        banned = forbids.get(package.layer(module), set())
        found = package.imports(module, type_checking=True, in_functions=True)
        if bad := sorted(d for d in found if package.layer(d) in banned):
            out[module] = bad
    return out


def test_shared_never_imports_services():
    wrong = {
        m: found
        for m in SHARED.modules
        if (found := SHARED.imports(m, type_checking=True, in_functions=True, inside="services"))
    }
    assert not wrong


def test_the_engine_s_layers_import_only_what_is_below_them():
    assert not _wrong(ENGINE, ENGINE_FORBIDS)


@pytest.mark.parametrize(
    "package, layers",
    [(SHARED, {"wire", "state", "redis_io", "process", "text", "settings"}), (ENGINE, {"", *ENGINE_FORBIDS})],
)
def test_the_check_sees_the_packages_it_guards(package, layers):
    """The rules above would pass on an empty or moved tree: make sure they look at the real one."""
    assert layers <= {package.layer(m) for m in package.modules}
    assert "services.worker.engine.cpu.cpu_ops" in ENGINE.imports(
        "services.worker.engine.sampling.sampler", type_checking=True, in_functions=True
    )

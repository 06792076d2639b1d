"""Reading a package's imports from its source (ast; nothing is imported), for the tests that keep its layers."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "services").is_dir() and (p / "shared").is_dir())


class Package:
    """The modules under one folder of the checkout (dotted names), and what each imports of them."""

    def __init__(self, dotted: str):
        self.name = dotted
        folder = ROOT.joinpath(*dotted.split("."))
        self.modules = {_module_name(p): p for p in folder.rglob("*.py")}

    def imports(self, module: str, *, type_checking: bool, in_functions: bool = False, inside: str = "") -> set[str]:
        """What `module` imports at module level (type_checking: under `if TYPE_CHECKING` too; in_functions: in
        function bodies too, which run later, not when the module is imported), kept to the modules of `inside`
        (a dotted prefix) or, by default, of this package."""
        tree = ast.parse(self.modules[module].read_text())
        found: set[str] = set()
        todo = list(ast.walk(tree)) if in_functions else list(tree.body)
        while todo:
            node = todo.pop()
            if not type_checking and _is_type_checking(node):
                continue
            found.update(_imported(node))
            if not in_functions and isinstance(node, (ast.If, ast.Try)):
                todo += [*node.body, *node.orelse, *getattr(node, "finalbody", [])]
                todo += [n for h in getattr(node, "handlers", []) for n in h.body]
        if inside:
            return {m for m in found if m == inside or m.startswith(inside + ".")}
        return {m for m in found if m in self.modules and m not in (module, self.name)}

    def layer(self, module: str) -> str:
        """The first folder under the package a module sits in ("" for the package's own top modules)."""
        rest = module[len(self.name) + 1 :].split(".")
        below = len(rest) > 1 or self.modules[module].name == "__init__.py"
        return rest[0] if below and rest[0] else ""


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        return [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
    return []


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)

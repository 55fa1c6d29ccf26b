"""The package structure holds: imports run one way between packages, and no function
imports an edgellm module (function-level imports are for optional heavy dependencies)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# source folder -> its import name (pyproject's package-dir)
FOLDERS = {
    "edgellm": "edgellm",
    "quantize": "edgellm.quantize",
    "backends": "edgellm.backends",
    "kernels": "edgellm.kernels",
    "models": "edgellm.models",
}
# lowest first: a package may import its own layer and the ones before it
LAYERS = [
    "base",  # edgellm.config, errors, registry, fsutil, version
    "kernels",
    "models",
    "loaders",
    "quantize",
    "distill",
    "backends",
    "sampling",
    "engine",
    "spec",
    "eval",
    "entrypoints",
]
FACADE = {"edgellm", "edgellm.__main__"}  # re-export the public API / run the CLI
# optional or heavy third-party libraries a function may import when it needs them
LAZY_OK = {"llama_cpp", "matplotlib", "triton", "mlx", "mlx_lm", "transformers"}


def modules() -> dict[str, Path]:
    out = {}
    for folder, name in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([name, *parts])] = path
    return out


def layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) >= 2 and parts[1] in LAYERS else "base"


def is_type_checking(node: ast.If) -> bool:
    test = node.test
    return isinstance(test, ast.Name) and test.id == "TYPE_CHECKING"


def module_level_imports(tree: ast.Module) -> list[str]:
    """edgellm modules imported when the module runs (not under `if TYPE_CHECKING`)."""
    found = []

    def visit(nodes):
        for node in nodes:
            if isinstance(node, ast.If) and is_type_checking(node):
                continue
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                found.append(node.module)
                found.extend(f"{node.module}.{a.name}" for a in node.names)
            elif isinstance(node, ast.Import):
                found.extend(a.name for a in node.names)
            elif isinstance(node, (ast.If, ast.Try, ast.With)):
                visit(getattr(node, "body", []) + getattr(node, "orelse", []))

    visit(tree.body)
    return [m for m in found if m == "edgellm" or m.startswith("edgellm.")]


def nested_imports(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, module) of every import inside a function or class body."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            for sub in ast.walk(node):
                if isinstance(sub, ast.ImportFrom):
                    out.append((sub.lineno, sub.module or ""))
                elif isinstance(sub, ast.Import):
                    out += [(sub.lineno, a.name) for a in sub.names]
    return out


def test_the_walk_sees_the_packages():
    mods = modules()
    assert {"edgellm.engine.engine", "edgellm.backends.registry", "edgellm.quantize.format"} <= set(
        mods
    )
    assert {layer(m) for m in mods} == set(LAYERS)


def test_no_function_level_imports_of_edgellm_or_light_libraries():
    bad = []
    for path in modules().values():
        for line, mod in nested_imports(ast.parse(path.read_text())):
            if mod.split(".")[0] not in LAZY_OK:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {mod} inside a function")
    assert not bad, "\n".join(bad)


def test_imports_run_one_way_between_packages():
    mods = modules()
    bad = []
    for name, path in mods.items():
        if name in FACADE:
            continue
        for target in module_level_imports(ast.parse(path.read_text())):
            if target not in mods or target in FACADE:
                continue  # `from pkg import name` also yields pkg.name, which may be no module
            src, dst = LAYERS.index(layer(name)), LAYERS.index(layer(target))
            if dst > src:
                bad.append(f"{name} ({layer(name)}) imports {target} ({layer(target)})")
    assert not bad, "\n".join(bad)


def test_no_import_cycle_between_modules():
    """Within a package too: a module-level cycle fails at import time in some orders."""
    mods = modules()
    graph = {
        name: {t for t in module_level_imports(ast.parse(p.read_text())) if t in mods}
        for name, p in mods.items()
        if name not in FACADE
    }
    state: dict[str, int] = {}

    def visit(node, stack):
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if nxt in FACADE or nxt == node:
                continue
            if state.get(nxt) == 1:
                raise AssertionError("import cycle: " + " -> ".join([*stack, node, nxt]))
            if nxt not in state:
                visit(nxt, [*stack, node])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])

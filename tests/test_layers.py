"""The layer rule of docs/architecture.md, read from the source: a layer imports only from the layers below it (imports
inside functions included, ``TYPE_CHECKING`` ones not), no two modules import each other (directly or through
others), and the kernels do not import the ops.

Layers, top to bottom: compile > parallel (and ``fastmesh/nn``, the plain-tensor modules) > recipes
(``fastmesh/fp8``) > ops > mesh > kernels. The utilities (``_log``, ``_cpp_lib``, ``_build_config``, ``settings``,
``version``) serve every layer and import only each other; the tools (the package's ``__init__``, ``__main__``,
``info``, ``tune``, ``testing``, and ``bench``) sit on top, with the adapters to other frameworks
(``fastmesh/integrations``). The plain-PyTorch references in ``kernels/`` are the tests' oracle, not kernels: they may
import the library.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
UTILITIES = {"fastmesh._log", "fastmesh._cpp_lib", "fastmesh._build_config", "fastmesh.settings", "fastmesh.version"}
TOOLS = {"fastmesh", "fastmesh.__main__", "fastmesh.info", "fastmesh.tune"}
ORACLES = {"fastmesh.kernels.fp8_reference", "fastmesh.kernels.mx_reference", "fastmesh.kernels.fused_reference"}
# Higher numbers sit above lower ones; -1: the utilities.
LAYERS = {"kernels": 0, "mesh": 1, "ops": 2, "recipes": 3, "parallel": 4, "compile": 5, "tools": 6}


def _modules() -> dict[str, pathlib.Path]:
    """Every module of the package, by its import name (kernels/ and bench/ are installed as fastmesh.kernels and
    fastmesh.bench)."""
    modules = {}
    for folder, package in (
        (ROOT / "fastmesh", "fastmesh"),
        (ROOT / "kernels", "fastmesh.kernels"),
        (ROOT / "bench", "fastmesh.bench"),
    ):
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            name = ".".join((package, *parts))
            modules[name.removesuffix(".__init__")] = path
    return modules


def _layer(module: str) -> int:
    if module in UTILITIES:
        return -1
    if module in TOOLS or module.startswith(("fastmesh.testing", "fastmesh.bench")) or module in ORACLES:
        return LAYERS["tools"]
    if module.startswith("fastmesh.integrations"):  # adapters to other frameworks, over the styles
        return LAYERS["tools"]
    for prefix, layer in (
        ("fastmesh.compile", "compile"),
        ("fastmesh.parallel", "parallel"),
        ("fastmesh.nn", "parallel"),  # the plain-tensor TP modules: the styles' peers, over the ops
        ("fastmesh.fp8", "recipes"),
        ("fastmesh.ops", "ops"),
        ("fastmesh.mesh", "mesh"),
        ("fastmesh.kernels", "kernels"),
    ):
        if module == prefix or module.startswith(prefix + "."):
            return LAYERS[layer]
    raise AssertionError(f"{module} is in no layer: add it to tests/test_layers.py and docs/architecture.md")


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(module: str, path: pathlib.Path, known: set[str]) -> set[str]:
    """The package's modules ``module`` imports at run time (at module level or in functions)."""
    found = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]

    def visit(node):
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            for alias in node.names:  # a submodule where the name is one, else the module it is taken from
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return {name for name in found if name in known and name != module}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, set(modules)) for name, path in modules.items()}


def test_every_import_goes_down_the_layers():
    wrong = []
    for module, imported in _graph().items():
        for target in imported:
            mine, theirs = _layer(module), _layer(target)
            if mine == -1 and theirs != -1:
                wrong.append(f"{module} (a utility) imports {target}")
            elif theirs > mine:
                wrong.append(f"{module} imports {target}, a layer above it")
    assert not wrong, "\n".join(sorted(wrong))


def test_no_import_circles():
    graph = _graph()
    # A circle among a package's modules through its __init__ (which imports them all) is not one: skip the edges
    # into a package from the modules below it.
    edges = {m: {t for t in ts if not m.startswith(t + ".")} for m, ts in graph.items()}
    circles, state, stack = [], {}, []

    def visit(module):
        state[module] = "open"
        stack.append(module)
        for target in sorted(edges[module]):
            if state.get(target) == "open":
                circles.append(" -> ".join(stack[stack.index(target) :] + [target]))
            elif target not in state:
                visit(target)
        stack.pop()
        state[module] = "done"

    for module in sorted(edges):
        if module not in state:
            visit(module)
    assert not circles, "import circles:\n" + "\n".join(circles)


def test_kernels_do_not_import_the_ops():
    for module, imported in _graph().items():
        if _layer(module) == LAYERS["kernels"]:
            assert not any(t.startswith("fastmesh.ops") for t in imported), (module, imported)

"""The package's layering: no two subpackages of nanoeuler/ (data, io, tokenizer, eval, train, model, infer,
check, and the top-level modules such as files.py and errors.py) import each other, and no modules import
each other in a circle. Imports are read from the source with ast, every one of them: a deferred import in a
function is still a dependency, and deferring one is how a circle usually hides."""
import ast
import os

from conftest import ROOT

PACKAGE = os.path.join(ROOT, "nanoeuler")


def module_files():
    """{dotted module name: path} of every .py file under nanoeuler/ (a package by its __init__.py)."""
    modules = {}
    for directory, _, names in os.walk(PACKAGE):
        for name in names:
            if name.endswith(".py"):
                path = os.path.join(directory, name)
                dotted = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                modules[dotted.removesuffix(".__init__")] = path
    return modules


def imported_modules(dotted, path, modules):
    """The modules of `modules` that the file imports anywhere in it (`from a import b` names module a.b when b
    is one, else module a)."""
    package = dotted if path.endswith("__init__.py") else dotted.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read(), path)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, up level - 1
                parent = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([node.module] if node.module else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return {name for name in found if name in modules and name != dotted}


def import_graph():
    modules = module_files()
    return {dotted: imported_modules(dotted, path, modules) for dotted, path in modules.items()}


def unit(dotted):
    """The layer a module belongs to: its subpackage of nanoeuler (model for nanoeuler.model.gpu.layers), the
    top-level module itself (files, errors, cli), or the package root."""
    parts = dotted.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def circles(graph):
    """The strongly connected components of more than one node (Tarjan's algorithm), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in graph.get(node, ()):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
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

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_circles_finds_a_circle_and_nothing_else():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert circles(graph) == [["a", "b", "c"]]


def test_no_module_imports_itself_back():
    graph = import_graph()
    assert "nanoeuler.model.losses" in graph["nanoeuler.train.objectives"]  # the reader sees real imports
    assert circles(graph) == [], "modules that import each other in a circle"


def test_no_two_subpackages_import_each_other():
    graph = import_graph()
    units = {}
    for module, imported in graph.items():
        for other in imported:
            if unit(other) != unit(module):
                units.setdefault(unit(module), set()).add(unit(other))
    found = circles(units)
    # name the imports that close each circle, so that the message says what to move
    edges = [f"{module} -> {other}" for module, imported in sorted(graph.items()) for other in sorted(imported)
             if any(unit(module) in circle and unit(other) in circle and unit(module) != unit(other)
                    for circle in found)]
    assert found == [], f"subpackages that import each other: {found}, through\n" + "\n".join(edges)

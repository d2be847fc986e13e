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


# ------------------------------------------------------------------------------- the command layer
CLI_LAYER = {"nanoeuler.cli", "nanoeuler.cli_help", "nanoeuler.__main__"}


def command_modules():
    """The modules whose main(args) runs a command: the values of cli.py's COMMANDS, read from its source."""
    tree = ast.parse(open(os.path.join(PACKAGE, "cli.py"), encoding="utf-8").read())
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "COMMANDS" for t in node.targets):
            return set(ast.literal_eval(node.value).values())
    raise AssertionError("cli.py has no COMMANDS table")


def namespace_reads(path):
    """Where a file reads a parsed command line: `args.NAME`, getattr(args, ...), vars(args), `import argparse`
    ([(line, what)])."""
    found = []
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read(), path)):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "args":
            found.append((node.lineno, f"args.{node.attr}"))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "vars",
                                                                                                   "hasattr")
              and node.args and isinstance(node.args[0], ast.Name) and node.args[0].id == "args"):
            found.append((node.lineno, f"{node.func.id}(args, ...)"))
        elif isinstance(node, ast.Import) and any(alias.name == "argparse" for alias in node.names):
            found.append((node.lineno, "import argparse"))
    return found


def own_program(path):
    """A module run as its own program (`python -m ...`, an `if __name__ == "__main__":` block) has a parser of
    its own."""
    return '__name__ == "__main__"' in open(path, encoding="utf-8").read()


def test_the_command_line_reader_sees_reads(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("import argparse\ndef f(args, x):\n    return args.steps, getattr(args, 'lr', 1), x.args\n")
    assert sorted(what for _, what in namespace_reads(str(path))) == ["args.steps", "getattr(args, ...)",
                                                                      "import argparse"]
    assert {"nanoeuler.train.pretrain", "nanoeuler.eval.main", "nanoeuler.infer.main"} <= command_modules()


def test_only_the_command_layer_reads_the_command_line():
    """The parsed command line (argparse.Namespace) is read by cli.py and by each command's main(args) (the
    modules of cli.COMMANDS) alone, and the training commands turn it into their typed options at once
    (train/options.py's from_args): nothing below them reads `args`."""
    commands = command_modules()
    training = {"nanoeuler.train.pretrain", "nanoeuler.train.sft", "nanoeuler.train.dpo"}
    # io/gguf.py's main(args) is `export --gguf`'s, which io/export.py's main hands the command line
    allowed = (CLI_LAYER | commands | {"nanoeuler.train.options", "nanoeuler.io.gguf"}) - training
    found = [f"{dotted} line {line}: {what}" for dotted, path in sorted(module_files().items())
             if dotted not in allowed and not own_program(path) for line, what in namespace_reads(path)]
    assert found == [], "modules below the command layer that read the parsed command line:\n" + "\n".join(found)


def test_no_command_module_is_imported_by_another_layer():
    """A command's module (the one whose main(args) runs it) is imported from another layer by cli.py alone
    (and cli_help.py, for the training commands' tables of defaults): what a command shares with another layer
    lives in a library module below both (infer/generate.py's generate for the training samples, eval/tasks.py's
    readers for --eval-task, io/report.py's reports)."""
    commands = command_modules()
    graph = import_graph()
    found = [f"{module} -> {other}" for module, imported in sorted(graph.items()) for other in sorted(imported)
             if other in commands and module not in CLI_LAYER and unit(module) != unit(other)]
    assert found == [], "command modules imported by other layers:\n" + "\n".join(found)

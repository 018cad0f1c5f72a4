"""The shape the code promises its readers (README: an afternoon): no function longer than a
screen, no module past 450 lines, and no import circle among nano's modules, counting the
imports made inside functions."""

import ast
from pathlib import Path

MODULES = {path.stem: ast.parse(path.read_text()) for path in (Path(__file__).parent.parent / "nano").glob("*.py")}


def test_functions_fit_on_a_screen_and_modules_stay_small():
    long = [f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines" for name, tree in MODULES.items()
            for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > 60]
    assert not long
    assert all(tree.body[-1].end_lineno <= 450 for tree in MODULES.values())


def imports(tree) -> set[str]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("nano."):
            found.add(node.module.removeprefix("nano."))
        elif isinstance(node, ast.ImportFrom) and node.module == "nano":
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name.removeprefix("nano.") for a in node.names if a.name.startswith("nano."))
    return found


def test_no_import_circle():
    graph = {name: imports(tree) for name, tree in MODULES.items()}
    done, path = set(), []

    def visit(module):
        assert module not in path, f"import circle: {' -> '.join(path[path.index(module):] + [module])}"
        if module in done:
            return
        path.append(module)
        for dep in graph.get(module, ()):
            visit(dep)
        path.pop()
        done.add(module)

    for module in graph:
        visit(module)

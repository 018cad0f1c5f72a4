"""The shape the code promises its readers (README: an afternoon): no function longer than a
screen, no module past 450 lines, and no import circle among nano's modules, counting the
imports made inside functions; and the list of bugs planted to show that the tests can fail
still fits the code."""

import ast
import importlib.util
import random
import sys
from pathlib import Path

import pytest

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


def _root(expr) -> str | None:
    """The leftmost name of a pointer expression: `w_ptr` of `w_ptr + rows[:, None] * stride + cols`."""
    while isinstance(expr, (ast.BinOp, ast.Subscript)):
        expr = expr.left if isinstance(expr, ast.BinOp) else expr.value
    return expr.id if isinstance(expr, ast.Name) else None


def _calls(node, name: str) -> list[ast.Call]:
    return [n for n in ast.walk(node) if isinstance(n, ast.Call) and ast.unparse(n.func) == name]


def test_every_kernel_waits_for_its_inputs_before_touching_them():
    """Programmatic dependent launch (triton_ops.py): a kernel may start before the one before it has
    finished, so until `wait_for_inputs()` it may read only what no kernel of the pass writes
    (weights, rope's table, the batch's metadata, and pointers into them) and write nothing. Every
    kernel launches so, and says so."""
    # the helpers a kernel may call before the wait: their pointers are checked, or they load nothing
    pre_wait_helpers = {"launch_dependents", "_load_tile", "_weight_tiles", "_split_range"}
    unwritten = {"w_ptr", "weight_ptr", "norm_weight_ptr", "v_proj", "cos_sin_ptr", "positions_ptr", "seq_lens", "num_kv_splits",
                 "req_pool_indices", "req_to_token", "out_cache_loc"}
    kernels = [(name, node) for name, tree in MODULES.items() for node in tree.body
               if isinstance(node, ast.FunctionDef) and node.name.endswith("_kernel")]
    assert len(kernels) >= 14
    for module, kernel in kernels:
        body = [s for s in kernel.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
        where = f"{module}.{kernel.name}"
        assert ast.unparse(body[0]) == "launch_dependents()", f"{where} does not let the next kernel start first"
        waits = [i for i, s in enumerate(body) if ast.unparse(s) == "wait_for_inputs()"]
        assert waits, f"{where} never waits for its inputs"
        readable = set(unwritten)
        for statement in body[:waits[0]]:
            assert not _calls(statement, "tl.store"), f"{where} writes before waiting"
            for call in (c for loader in ("tl.load", "_load_tile", "_weight_tiles") for c in _calls(statement, loader)):
                assert _root(call.args[0]) in readable, f"{where} reads {ast.unparse(call.args[0])} before waiting"
            # a helper that loads (rope's _rotate_heads, attention's _load_queries) hides its pointers
            helpers = {ast.unparse(n.func) for n in ast.walk(statement)
                       if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
            assert helpers <= pre_wait_helpers, f"{where} calls {helpers - pre_wait_helpers} before waiting"
            if isinstance(statement, ast.Assign) and _root(statement.value) in readable:  # a pointer into them
                readable.add(ast.unparse(statement.targets[0]))
    launches = [ast.unparse(n) for tree in MODULES.values() for n in ast.walk(tree)
                if isinstance(n, ast.Call) and isinstance(n.func, ast.Subscript) and ast.unparse(n.func.value).endswith("_kernel")]
    assert len(launches) == len(kernels) and all("launch_pdl=PDL" in launch for launch in launches)


def _script(name: str):
    """scripts/NAME.py, imported (scripts/ is no package)."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).parent.parent / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_planted_bugs_never_runs_pytest_on_no_tests(monkeypatch, tmp_path):
    """pytest given no test ids runs the whole suite: a filter that names no bug (a typo, --help) must
    stop with the list of names, and one whose bugs all need a GPU, on a machine without one, skip them."""
    planted_bugs = _script("planted_bugs")
    ran = []
    monkeypatch.setattr(planted_bugs, "pytest_exit_code", lambda repo, tests: ran.append(tests) or 0)
    monkeypatch.setattr(planted_bugs, "scratch_copy", lambda into: tmp_path)
    monkeypatch.setattr(planted_bugs.torch.cuda, "is_available", lambda: False)
    gpu_bug = random.choice([b for b in planted_bugs.BUGS if b.needs_cuda])
    for argv, status in ((["--help"], "no bug's name contains '--help'"), ([gpu_bug.name], 0)):
        monkeypatch.setattr(sys, "argv", ["planted_bugs.py", *argv])
        with pytest.raises(SystemExit) as exit_:
            planted_bugs.main()
        assert str(exit_.value.code).startswith(str(status)) and [] not in ran


def test_profile_throughput_defaults_to_bench_throughputs_model(monkeypatch):
    """Without --model it profiles the shape bench_throughput times (smollm2-135m on CPU, llama-3-8b on
    a GPU), with dummy weights, not the downloaded default model."""
    script, built = _script("profile_throughput"), []
    monkeypatch.setattr(script, "build_engine", lambda args, model_dir: built.append((model_dir, args)) or 1 / 0)
    monkeypatch.setattr(sys, "argv", ["profile_throughput.py", "--device", "cpu"])
    with pytest.raises(ZeroDivisionError):
        script.main()
    assert built[0][0].name == "smollm2-135m" and built[0][1].load_format == "dummy"


def test_planted_bugs_still_apply():
    """scripts/planted_bugs.py plants each bug by one text substitution and names the tests that must
    catch it. Code that moves leaves its substitution matching nothing, and the script stops at that
    bug after minutes of tests; here it shows in CI instead."""
    root = Path(__file__).parent.parent
    planted_bugs = _script("planted_bugs")
    assert len(planted_bugs.BUGS) >= 35
    for bug in planted_bugs.BUGS:
        planted_bugs.planted(bug, root)  # the script's own check: sys.exit, so a failure here, if it no longer applies
        for test in bug.tests:
            path, _, name = test.split("[")[0].partition("::")  # a whole file, or one test in it
            assert (root / path).is_file() and (not name or f"def {name}(" in (root / path).read_text()), \
                f"{bug.name}: no test {test}"

"""The package's shape: no import circle, and the mode read in one module."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "flashsac_opt"
MODES = {"eager", "compile", "graph"}


def _modules() -> dict[str, ast.Module]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = ast.parse(path.read_text(), str(path))
    return out


def _imports(tree: ast.Module, modules: set[str]) -> set[str]:
    """flashsac_opt modules a module imports, at any depth (function-level imports count too)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        found |= {n for n in names if n in modules}
    return found


def test_the_package_import_graph_has_no_cycle():
    trees = _modules()
    graph = {name: _imports(tree, set(trees)) - {name} for name, tree in trees.items()}
    # A package's __init__ importing its submodules is not a cycle of ideas; drop those edges.
    graph = {n: {m for m in deps if not m.startswith(n + ".")} for n, deps in graph.items()}
    assert graph["flashsac_opt.engine"].isdisjoint({"flashsac_opt.learner", "flashsac_opt.config"})
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(dep):] + [dep]))
            if dep not in state:
                visit(dep, path + [dep])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])


def test_only_the_engine_compares_against_a_mode_name():
    """A mode string compared (==, !=, in) anywhere but engine.py means the mode is decided twice.
    (The oracle harness in flashsac_opt.testing names the learners it compares by their mode;
    it builds learners, it does not decide how one runs.)"""
    readers = set()
    for name, tree in _modules().items():
        if name.startswith("flashsac_opt.testing"):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare):
                operands = [node.left, *node.comparators]
                if any(isinstance(o, ast.Constant) and o.value in MODES for o in operands):
                    readers.add(name)
    assert readers == {"flashsac_opt.engine"}


def _mode_readers(trees: dict[str, ast.Module]) -> set[str]:
    """Modules that read a config's learner_mode: the attribute, or the key of a mapping."""
    readers = set()
    for name, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr == "learner_mode":
                readers.add(name)
            elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and node.slice.value == "learner_mode":
                readers.add(name)
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                  and node.args and isinstance(node.args[0], ast.Constant) and node.args[0].value == "learner_mode"):
                readers.add(name)
    return readers


def test_the_mode_is_read_in_config_and_engine_only():
    """Everything else asks the engine what it can do (engine.compiled, engine.graph, engine.mode).
    The oracle harness builds learners of each mode (cfg.replace(learner_mode=...)): a keyword, not a read."""
    assert _mode_readers(_modules()) <= {"flashsac_opt.config", "flashsac_opt.engine"}
    # the check sees each way of reading it
    for source in ("x = cfg.learner_mode", "x = params['learner_mode']", "x = params.get('learner_mode')"):
        assert _mode_readers({"m": ast.parse(source)}) == {"m"}
    assert _mode_readers({"m": ast.parse("cfg = cfg.replace(learner_mode='graph')")}) == set()


MAX_CLASS_LINES = 350


def _long_classes(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    return [f"{path.name}:{n.name} ({n.end_lineno - n.lineno + 1} lines)" for n in ast.walk(tree)
            if isinstance(n, ast.ClassDef) and n.end_lineno - n.lineno + 1 > MAX_CLASS_LINES]


def test_no_class_is_over_350_lines(tmp_path):
    repo = PACKAGE.parent
    files = [p for d in ("flashsac_opt", "experiments", "tests") for p in (repo / d).rglob("*.py")]
    assert [c for p in files for c in _long_classes(p)] == []
    big = tmp_path / "big.py"
    big.write_text("class Big:\n" + "    x = 1\n" * MAX_CLASS_LINES)
    assert _long_classes(big) == ["big.py:Big (351 lines)"]


def _lines(folder: Path, pattern: str) -> int:
    return sum(len(p.read_text(errors="replace").splitlines()) for p in folder.rglob(pattern)
               if p.is_file() and "__pycache__" not in p.parts)


def test_experiments_are_no_larger_than_the_library():
    """experiments/ (every file: scripts, the device runs' table, READMEs) against the package's Python."""
    repo = PACKAGE.parent
    assert _lines(repo / "experiments", "*") <= _lines(PACKAGE, "*.py")

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

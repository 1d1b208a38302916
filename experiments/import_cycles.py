"""Import circles among Python modules, found from the source alone (ast, nothing imported).

Each ROOT is a folder its modules are imported from (its files named by their path under it,
as `sys.path` would name them): the repository root for flashsac_opt/, experiments/ for the
experiments (which put it on their path), tests/ for the tests. Every `import` and `from ...
import` in a file is an edge, also those inside functions (imported when the function runs),
except under `if TYPE_CHECKING:`; an edge goes to the module itself, not to the packages above
it (a package's __init__ importing its own modules is no circle). Prints each circle and exits
1 if there is one.

    python experiments/import_cycles.py . experiments tests
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path


def modules(root: Path, others: list[Path] = ()) -> dict[str, Path]:
    """{dotted name: file} of the .py files under root (a package by its __init__.py), but for
    those under another root inside it and hidden folders (.venv)."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if any(p.startswith(".") or not p.isidentifier() for p in parts[:-1]) or any(
                o != root and o.is_relative_to(root) and path.is_relative_to(o) for o in others):
            continue
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imported(tree: ast.AST, name: str, is_package: bool) -> list[str]:
    """The dotted names a module imports (a `from X import Y` gives X.Y and X: either may be a module)."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    out = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out += [[a.name] for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's own package upwards
                package = name.split(".") if is_package else name.split(".")[:-1]
                package = package[: len(package) - (node.level - 1)]
                base = ".".join(package + ([base] if base else []))
            out += [[f"{base}.{a.name}" if base else a.name, base] for a in node.names]
    return out


def import_graph(roots: list[Path]) -> dict[Path, set[Path]]:
    """{file: files it imports} over the modules of every root; an import is looked up in the
    importing file's own root first, then in the others."""
    tables = [modules(root, roots) for root in roots]
    graph: dict[Path, set[Path]] = {}
    for i, table in enumerate(tables):
        order = [table] + tables[:i] + tables[i + 1:]
        for name, path in table.items():
            edges = graph.setdefault(path, set())
            for candidates in _imported(ast.parse(path.read_text(), str(path)), name, path.name == "__init__.py"):
                for wanted in candidates:
                    target = next((t[wanted] for t in order if wanted in t), None)
                    if target is not None:
                        if target != path:
                            edges.add(target)
                        break
    return graph


def cycles(graph: dict[Path, set[Path]]) -> list[list[Path]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[Path, int] = {}
    low: dict[Path, int] = {}
    stack: list[Path] = []
    on_stack: set[Path] = set()
    found = []

    def visit(node: Path) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
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

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph) + 100))
    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def main(argv: list[str] | None = None) -> int:
    roots = [Path(r).resolve() for r in (argv if argv is not None else sys.argv[1:]) or ["."]]
    graph = import_graph(roots)
    found = cycles(graph)
    cwd = Path.cwd()
    show = lambda p: str(p.relative_to(cwd)) if p.is_relative_to(cwd) else str(p)  # noqa: E731
    print(f"{len(graph)} modules, {sum(map(len, graph.values()))} imports among them, {len(found)} circle(s)")
    for component in found:
        print("circle: " + " <-> ".join(show(p) for p in component))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())

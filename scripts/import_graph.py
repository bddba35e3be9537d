"""The package's import graph, read from the source: cycles, imports inside functions, layer coverage.

`lint-imports` (import-linter, configured in pyproject.toml) checks the layers; this script checks what
its contracts cannot say:

* no import cycle among the package's modules, counting imports inside functions (an `if TYPE_CHECKING:`
  import is not a run-time import and is left out);
* no import of the package's own modules inside a function, except of a module that needs torch_xla
  (it imports torch_xla, or a module that does, at its top level): that keeps `import torch_tpu_embedding`
  free of torch_xla. Each such import carries a comment on its line saying why;
* every module of the package is in a layer of the `layers` contract (a package's `__init__` aside).

Nothing is imported: the graph comes from the AST. Exit 0 when all three hold.
Usage: python scripts/import_graph.py [--verbose]
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "torch_tpu_embedding"
OPTIONAL = "torch_xla"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def under_type_checking(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return True
    return False


def in_function(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return True
    return False


def imported(node: ast.Import | ast.ImportFrom, current: str, is_package: bool, modules: set[str]) -> list[str]:
    """The modules an import statement names: `from m import x` names m.x when that is a module, else m
    (importing a submodule is not counted as using its package's `__init__`)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:
        base = current.split(".") if is_package else current.split(".")[:-1]
        base = base[: len(base) - node.level + 1]
        module = ".".join(base + ([node.module] if node.module else []))
    else:
        module = node.module or ""
    return [f"{module}.{a.name}" if f"{module}.{a.name}" in modules else module for a in node.names]


def main() -> int:
    verbose = "--verbose" in sys.argv
    files = {module_name(p): p for p in sorted((ROOT / PACKAGE).rglob("*.py"))}
    edges: dict[str, set[str]] = {m: set() for m in files}
    top_optional: set[str] = set()  # modules that import torch_xla at their top level
    local: list[tuple[str, int, str, bool]] = []  # (module, line, target, commented)
    for mod, path in files.items():
        source = path.read_text()
        lines = source.splitlines()
        tree = ast.parse(source)
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)) or under_type_checking(node, parents):
                continue
            names = imported(node, mod, path.name == "__init__.py", set(files))
            inside = in_function(node, parents)
            if not inside and any(n == OPTIONAL or n.startswith(OPTIONAL + ".") for n in names):
                top_optional.add(mod)
            for target in {n for n in names if n in files and n != mod}:
                edges[mod].add(target)
                if inside:
                    local.append((mod, node.lineno, target, "#" in lines[node.lineno - 1]))

    # A module "needs torch_xla" if it, or a module it imports at its top level, imports torch_xla.
    top_edges = {m: set(e) for m, e in edges.items()}
    for mod, _, target, _ in local:
        top_edges[mod].discard(target)
    needs = set(top_optional)
    changed = True
    while changed:
        changed = False
        for mod, targets in top_edges.items():
            if mod not in needs and targets & needs:
                needs.add(mod)
                changed = True

    cycles = strongly_connected(edges)
    bad_local = [x for x in local if x[2] not in needs or not x[3]]
    layers = layer_entries()
    uncovered = [m for m in files if not files[m].name == "__init__.py"
                 and not any(m == e or m.startswith(e + ".") for e in layers)]

    print(f"modules {len(files)}, import edges {sum(map(len, edges.values()))} (inside functions included), "
          f"import cycles {len(cycles)}")
    for cycle in cycles:
        print("  cycle:", " -> ".join(cycle))
    print(f"imports of the package's modules inside functions: {len(local)}, of modules that need "
          f"{OPTIONAL}: {len(local) - len([x for x in local if x[2] not in needs])}, others: "
          f"{len([x for x in local if x[2] not in needs])}, without a comment: {len([x for x in local if not x[3]])}")
    for mod, line, target, commented in local if verbose else bad_local:
        why = "needs torch_xla" if target in needs else "does NOT need torch_xla"
        print(f"  {files[mod].relative_to(ROOT)}:{line} -> {target} ({why}{'' if commented else ', no comment'})")
    print(f"modules in no layer of the `layers` contract: {len(uncovered)}")
    for mod in uncovered:
        print("  ", mod)
    return 0 if not cycles and not bad_local and not uncovered else 1


def layer_entries() -> list[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    contract = next(c for c in config if c.get("id") == "layers")
    return [part.strip() for layer in contract["layers"] for part in layer.replace("|", ":").split(":")]


def strongly_connected(edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm (iterative): the components of more than one module, i.e. the import cycles."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    for start in edges:
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


if __name__ == "__main__":
    sys.exit(main())

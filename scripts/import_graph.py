"""The package's import graph, read from the source: cycles, imports inside functions, layer coverage.

`lint-imports` (import-linter, configured in pyproject.toml) checks the layers; this script checks what
its contracts cannot say:

* no import cycle among the package's modules, counting imports inside functions (an `if TYPE_CHECKING:`
  import is not a run-time import and is left out);
* no import of the package's own modules inside a function, except of a module that needs torch_xla
  (it imports torch_xla, or a module that does, at its top level): that keeps `import torch_tpu_embedding`
  free of torch_xla. Each such import carries a comment on its line saying why;
* every module of the package is in a layer of the `layers` contract (a package's `__init__` aside);
* only modules of `xla/` name torch_xla, or a module of `xla/`, in an `importlib.import_module("...")` call
  (import-linter sees import statements only);
* the structure stays readable: at most 12 `.py` files at the top of the package, at most 15 modules in
  any subpackage.

Nothing is imported: the graph comes from the AST. Exit 0 when all of these hold.
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
#: the only subpackage that may load torch_xla (statements or importlib strings)
OPTIONAL_HOME = PACKAGE + ".xla"
MAX_TOP_FILES = 12
MAX_SUBPACKAGE_MODULES = 15


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
    hidden: list[tuple[str, int, str]] = []  # importlib.import_module("torch_xla...") outside xla/
    for mod, path in files.items():
        source = path.read_text()
        lines = source.splitlines()
        tree = ast.parse(source)
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for node in ast.walk(tree):
            dynamic = importlib_target(node)
            if dynamic is not None and not (mod == OPTIONAL_HOME or mod.startswith(OPTIONAL_HOME + ".")) and (
                    dynamic.split(".")[0] == OPTIONAL or dynamic == OPTIONAL_HOME
                    or dynamic.startswith(OPTIONAL_HOME + ".")):
                hidden.append((mod, node.lineno, dynamic))
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
    print(f"importlib loads of {OPTIONAL} or of {OPTIONAL_HOME} outside {OPTIONAL_HOME}: {len(hidden)}")
    for mod, line, target in hidden:
        print(f"  {files[mod].relative_to(ROOT)}:{line} -> {target}")
    sizes = structure(files)
    too_big = {pkg: n for pkg, n in sizes.items() if n > (MAX_TOP_FILES if pkg == PACKAGE else MAX_SUBPACKAGE_MODULES)}
    print(f"`.py` files at the top of the package: {sizes[PACKAGE]} (at most {MAX_TOP_FILES}); modules per subpackage: "
          + ", ".join(f"{pkg.removeprefix(PACKAGE + '.')} {n}" for pkg, n in sorted(sizes.items()) if pkg != PACKAGE)
          + f" (at most {MAX_SUBPACKAGE_MODULES})")
    for pkg, n in too_big.items():
        print(f"  too many modules in {pkg}: {n}")
    return 0 if not cycles and not bad_local and not uncovered and not hidden and not too_big else 1


def importlib_target(node: ast.AST) -> str | None:
    """The module an `importlib.import_module("...")` (or `import_module("...")`) call names, if a literal."""
    if not isinstance(node, ast.Call) or not node.args or not isinstance(node.args[0], ast.Constant):
        return None
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    value = node.args[0].value
    return value if name == "import_module" and isinstance(value, str) else None


def structure(files: dict[str, Path]) -> dict[str, int]:
    """`.py` files directly in each package folder (its `__init__` included), by package."""
    counts: dict[str, int] = {}
    for path in files.values():
        pkg = module_name(path.parent / "__init__.py")
        counts[pkg] = counts.get(pkg, 0) + 1
    return counts


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

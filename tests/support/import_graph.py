"""The import graph of the product's packages (``engine``, ``server``, ``shm``, ``proto``), read
from the source with :mod:`ast`, by module and by package. An import anywhere in a module
counts, a deferred one inside a function too (it still ties the two modules together); one
under ``if TYPE_CHECKING:`` does not. Cycles are strongly connected components (Tarjan)."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("engine", "server", "shm", "proto")


def modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the product."""
    out = {}
    for top in PRODUCT:
        for path in (ROOT / top).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The product modules ``name`` imports (``from a.b import c`` is ``a.b.c`` when that is a module,
    else ``a.b``)."""
    found: set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]

    def visit(node):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking(child):
                for sub in child.orelse:
                    visit(sub)
                continue
            if isinstance(child, ast.Import):
                found.update(a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")[:len(package.split(".")) - child.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                for a in child.names:
                    full = f"{base}.{a.name}"
                    found.add(full if full in known else base)
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    resolved = set()
    for target in found:
        while target and target not in known:
            target = target.rpartition(".")[0]
        if target and target != name and not name.startswith(target + "."):
            resolved.add(target)  # a module importing its own package's __init__ is no edge
    return resolved


def package_of(module: str, known: dict[str, Path]) -> str:
    """The package a module belongs to; a module directly under a top-level package that has
    subpackages (``server/config.py``) is a node of its own, as it sits on its own floor."""
    if known[module].name == "__init__.py":
        return module
    parent = module.rpartition(".")[0]
    return module if "." not in parent and parent in PRODUCT and any(
        m.startswith(parent + ".") and m.count(".") > 1 for m in known) else parent


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan's algorithm)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def strong(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def module_graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def package_graph() -> dict[str, set[str]]:
    known = modules()
    graph: dict[str, set[str]] = {}
    for name, targets in module_graph().items():
        src = package_of(name, known)
        graph.setdefault(src, set()).update(p for p in (package_of(t, known) for t in targets) if p != src)
    return graph


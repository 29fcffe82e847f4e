"""The package layout shows the design (README, Layout): imports go one way
between the subpackages of kvstore/, no module imports itself back through
others, the client loads nothing of the daemon, and every subpackage is
installed. Read from the source with ast: no module is imported to check."""
import ast
import os
import re
import subprocess
import sys

import pytest

from helpers import ROOT

TREES = {"kvstore": "kvstore", "kvstore.kernels": "kernels", "kvstore.client": "client"}

# What each part of kvstore may import (module-level or inside a function).
# tools/ may import anything; nothing imports tools/.
MAY_IMPORT = {
    "kvstore.errors": set(),
    "kvstore.core": {"kvstore.errors"},
    "kvstore.codec": {"kvstore.core", "kvstore.errors"},
    "kvstore.cuda": {"kvstore.errors"},
    "kvstore.protocol": {"kvstore.errors", "kvstore.v1"},
    "kvstore.tiers": {"kvstore.core", "kvstore.cuda", "kvstore.errors"},
    "kvstore.kernels": {"kvstore.cuda"},
    "kvstore.engine": {"kvstore.core", "kvstore.codec", "kvstore.tiers", "kvstore.cuda", "kvstore.kernels",
                       "kvstore.errors"},
    "kvstore.service": {"kvstore.core", "kvstore.codec", "kvstore.engine", "kvstore.tiers", "kvstore.cuda",
                        "kvstore.protocol", "kvstore.errors", "kvstore.v1"},
    # The thin client: the shared leaf and CUDA plumbing; mapped attend runs the kernels; the
    # HF adapter reads codebooks files and applies their transform (codec, lazily).
    "kvstore.client": {"kvstore.protocol", "kvstore.cuda", "kvstore.errors", "kvstore.v1", "kvstore.kernels",
                       "kvstore.codec"},
}
DAEMON_SIDE = ("kvstore.engine", "kvstore.kernels", "kvstore.tiers", "kvstore.service", "kvstore.tools")


def _modules() -> dict[str, str]:
    """dotted name -> path of every module of the three trees (generated stubs aside)."""
    out = {}
    for prefix, top in TREES.items():
        for d, _, files in os.walk(os.path.join(ROOT, top)):
            for f in files:
                if not f.endswith(".py"):
                    continue
                rel = os.path.relpath(os.path.join(d, f), os.path.join(ROOT, top))[:-3].split(os.sep)
                parts = rel[:-1] if rel[-1] == "__init__" else rel
                if prefix == "kvstore" and parts and parts[0] == "v1":
                    continue
                out[".".join([prefix, *parts])] = os.path.join(d, f)
    return out


MODULES = _modules()


def _resolve(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(name: str) -> tuple[set[str], set[str]]:
    """(modules imported at module level, modules imported anywhere) by a module of ours."""
    path = MODULES[name]
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    top, anywhere = set(), set()

    def targets(node):
        if isinstance(node, ast.Import):
            return [a.name for a in node.names]
        base = node.module or ""
        if node.level:
            pkg = package
            for _ in range(node.level - 1):
                pkg = pkg.rpartition(".")[0]
            base = pkg + ("." + base if base else "")
        return [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]

    def walk(node, in_function: bool):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                for t in targets(child):
                    if t.startswith("kvstore.v1") or t == "kvstore.v1":
                        anywhere.add("kvstore.v1")
                        continue
                    r = _resolve(t)
                    if r and r != name:
                        anywhere.add(r)
                        if not in_function:
                            top.add(r)
            walk(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))
    walk(ast.parse(open(path).read()), False)
    return top, anywhere


def _part(module: str) -> str:
    for part in sorted(MAY_IMPORT, key=len, reverse=True):
        if module == part or module.startswith(part + "."):
            return part
    return module


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
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
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


IMPORTS = {m: _imports(m) for m in MODULES}


def test_no_import_cycles():
    assert _cycles({m: top for m, (top, _) in IMPORTS.items()}) == []
    # Lazy imports (inside functions) too.
    lazy = {m: anywhere for m, (_, anywhere) in IMPORTS.items()}
    assert _cycles(lazy) == []


def test_subpackages_import_one_way():
    wrong = []
    for m, (_, anywhere) in IMPORTS.items():
        part = _part(m)
        if part not in MAY_IMPORT or m in ("kvstore",) or part == "kvstore.tools":
            continue
        for t in anywhere:
            tp = _part(t) if t != "kvstore.v1" else t
            if tp != part and tp not in MAY_IMPORT[part] and tp != "kvstore":
                wrong.append(f"{m} imports {t}")
    assert wrong == []


def test_client_loads_nothing_of_the_daemon():
    code = "import sys, kvstore.client; print('\\n'.join(sorted(m for m in sys.modules if m.startswith('kvstore'))))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                            cwd=ROOT).stdout.split()
    assert "kvstore.client.client" in loaded
    assert [m for m in loaded if m.startswith(DAEMON_SIDE)] == []


@pytest.mark.parametrize("package", sorted({m for m, p in MODULES.items() if p.endswith("__init__.py")}
                                           - {"kvstore", "kvstore.kernels", "kvstore.client"}))
def test_subpackage_init_is_a_docstring_only(package):
    """Importing one subpackage pulls in no other: its __init__ imports nothing."""
    tree = ast.parse(open(MODULES[package]).read())
    assert ast.get_docstring(tree), f"{package}: say its job in one line"
    assert [type(n).__name__ for n in tree.body] == ["Expr"]


def test_every_package_is_installed():
    text = open(os.path.join(ROOT, "pyproject.toml")).read()
    listed = set(re.findall(r'"(kvstore(?:\.[a-z0-9_]+)*)"', text.split("packages = [", 1)[1].split("]", 1)[0]))
    packages = {m for m, p in MODULES.items() if p.endswith("__init__.py")} | {"kvstore.v1"}
    assert packages - listed == set()


def test_modules_stay_small():
    """STYLE 14: under ~400 lines (kernels/ has its own owner and limits)."""
    long = {m: n for m, p in MODULES.items() if not m.startswith("kvstore.kernels")
            and (n := sum(1 for _ in open(p))) > 420}
    assert long == {}

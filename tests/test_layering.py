"""The package's import graph against the layers docs/ARCHITECTURE.md defines, read with `ast` (nothing
is executed). Every import counts, at module level or inside a function: a circle through a lazy
import is still a circle to a reader.

The layers come from the ```layers block of ARCHITECTURE.md, top to bottom, each a list of module
prefixes; a module belongs to the layer of its longest matching prefix. An import may go to its own
layer or any layer below. A layer marked `[no jax]` imports neither jax nor flax, directly or
through any module of ours it imports.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("infire_jax", "pallas_kernels", "sharding", "server", "router")
JAX = ("jax", "jaxlib", "flax")


def modules() -> dict[str, Path]:
    """Dotted name -> file of every module of the packages (a package is its __init__)."""
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


def imports(mods: dict[str, Path]) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(module -> modules of ours it imports, module -> the third-party top-level packages it imports)."""
    ours, theirs = defaultdict(set), defaultdict(set)

    def owner(name: str) -> str | None:  # the module of ours a dotted name lives in
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
                # `from pkg import sub` imports the submodule; `from mod import name` the module
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            for target in targets:
                mine = owner(target)
                if mine is not None:
                    if mine != name:
                        ours[name].add(mine)
                else:
                    theirs[name].add(target.partition(".")[0])
    return ours, theirs


def layers() -> list[tuple[str, bool, list[str]]]:
    """(name, no-jax, module prefixes) of each layer, top first, from ARCHITECTURE.md."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    block = re.search(r"```layers\n(.*?)```", text, re.S)
    assert block, "docs/ARCHITECTURE.md has no ```layers block"
    out = []
    for line in block.group(1).splitlines():
        if not line.strip():
            continue
        head, _, prefixes = line.partition(":")
        out.append((head.replace("[no jax]", "").strip(), "[no jax]" in head, prefixes.split()))
    return out


def layer_of(module: str, table) -> int | None:
    best, rank = -1, None
    for i, (_, _, prefixes) in enumerate(table):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best:
                best, rank = len(p), i
    return rank


@pytest.fixture(scope="module")
def graph():
    mods = modules()
    return mods, *imports(mods), layers()


def test_every_module_has_a_layer(graph):
    mods, _, _, table = graph
    missing = sorted(m for m in mods if layer_of(m, table) is None)
    assert not missing, f"add these modules to a layer of the ```layers block in docs/ARCHITECTURE.md: {missing}"


def test_no_import_runs_up_a_layer(graph):
    mods, ours, _, table = graph
    up = [f"{a} ({table[layer_of(a, table)][0]}) imports {b} ({table[layer_of(b, table)][0]})"
          for a in sorted(ours) for b in sorted(ours[a])
          if layer_of(b, table) is not None and layer_of(a, table) is not None
          and layer_of(b, table) < layer_of(a, table)]
    assert not up, "imports from a lower layer to a higher one:\n" + "\n".join(up)


def test_no_circles(graph):
    """Tarjan's strongly connected components: any with two or more modules is a circle."""
    mods, ours, _, _ = graph
    index, low, stack, on, circles = {}, {}, [], set(), []

    def visit(v):  # recursive: the import graph is a few dozen modules deep at most
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in ours.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(mods):
        if v not in index:
            visit(v)
    assert not circles, f"import circles: {circles}"


def test_host_layers_import_no_jax(graph):
    mods, ours, theirs, table = graph
    host = [m for m in mods if table[layer_of(m, table)][1]]
    bad = []
    for m in host:
        seen, todo = set(), [m]
        while todo:  # every module of ours it reaches
            v = todo.pop()
            if v not in seen:
                seen.add(v)
                todo.extend(ours.get(v, ()))
        via = sorted(v for v in seen if theirs.get(v, set()) & set(JAX))
        if via:
            bad.append(f"{m} reaches jax through {via}")
    assert not bad, "\n".join(bad)


def test_the_checks_see_a_planted_violation(graph, tmp_path):
    """The graph reader itself: a lazy import up a layer, and a circle, are both found."""
    mods, _, _, table = graph
    fake = {"infire_jax.scheduler": tmp_path / "scheduler.py", "infire_jax.engine": tmp_path / "engine.py"}
    fake["infire_jax.scheduler"].write_text("def f():\n    from infire_jax.engine import Engine\n")
    fake["infire_jax.engine"].write_text("from infire_jax import scheduler\n")
    ours, _ = imports(fake)
    assert ours == {"infire_jax.scheduler": {"infire_jax.engine"}, "infire_jax.engine": {"infire_jax.scheduler"}}
    assert layer_of("infire_jax.engine", table) < layer_of("infire_jax.scheduler", table)

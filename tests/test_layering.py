"""The package's import graph against the layers docs/ARCHITECTURE.md defines, read with `ast` (nothing
is executed). Every import counts, at module level or inside a function: a circle through a lazy
import is still a circle to a reader.

The layers come from the ```layers block of ARCHITECTURE.md, top to bottom, each a list of module
prefixes; a module belongs to the layer of its longest matching prefix. An import may go to its own
layer or any layer below. A layer marked `[no jax]` imports neither jax nor flax, directly or
through any module of ours it imports. The folders keep their roles too: `infire_jax.core` (the host
side) reaches no jax and imports nothing of the device side (`infire_jax.runner`) or the engine, and
the top of `infire_jax/` holds only the package's faces.
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


# The only modules at the top of infire_jax/: the faces (docs/ARCHITECTURE.md, "Folders").
TOP_LEVEL = {"__init__", "__main__", "cli", "llm", "errors", "outputs"}
# What the host side (infire_jax.core) may never import, directly or through another module.
ABOVE_CORE = ("infire_jax.runner", "infire_jax.engine", "infire_jax.sample.sampler")


def reach(module: str, ours) -> set[str]:
    """Every module of ours `module` imports, directly or through others (itself included)."""
    seen, todo = set(), [module]
    while todo:
        v = todo.pop()
        if v not in seen:
            seen.add(v)
            todo.extend(ours.get(v, ()))
    return seen


def unplaced(mods, table) -> list[str]:
    return sorted(m for m in mods if layer_of(m, table) is None)


def imports_up(ours, table) -> list[str]:
    return [f"{a} ({table[layer_of(a, table)][0]}) imports {b} ({table[layer_of(b, table)][0]})"
            for a in sorted(ours) for b in sorted(ours[a])
            if layer_of(b, table) is not None and layer_of(a, table) is not None
            and layer_of(b, table) < layer_of(a, table)]


def circles(mods, ours) -> list[list[str]]:
    """Tarjan's strongly connected components: any with two or more modules is a circle."""
    index, low, stack, on, found = {}, {}, [], set(), []

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
                found.append(sorted(component))

    for v in sorted(mods):
        if v not in index:
            visit(v)
    return found


def jax_in_host_layers(mods, ours, theirs, table) -> list[str]:
    bad = []
    for m in sorted(mods):
        if table[layer_of(m, table)][1] or m.startswith("infire_jax.core"):
            via = sorted(v for v in reach(m, ours) if theirs.get(v, set()) & set(JAX))
            if via:
                bad.append(f"{m} reaches jax through {via}")
    return bad


def core_reaching_up(mods, ours) -> list[str]:
    return [f"{m} reaches {sorted(v for v in reach(m, ours) if v.startswith(ABOVE_CORE))}"
            for m in sorted(mods) if m.startswith("infire_jax.core")
            and any(v.startswith(ABOVE_CORE) for v in reach(m, ours))]


def extra_top_level(mods) -> list[str]:
    return sorted(m for m in mods if m.count(".") == 1 and m.startswith("infire_jax.")
                  and mods[m].name != "__init__.py" and m.split(".")[1] not in TOP_LEVEL)


def test_every_module_has_a_layer(graph):
    mods, _, _, table = graph
    missing = unplaced(mods, table)
    assert not missing, f"add these modules to a layer of the ```layers block in docs/ARCHITECTURE.md: {missing}"


def test_no_import_runs_up_a_layer(graph):
    _, ours, _, table = graph
    up = imports_up(ours, table)
    assert not up, "imports from a lower layer to a higher one:\n" + "\n".join(up)


def test_no_circles(graph):
    mods, ours, _, _ = graph
    found = circles(mods, ours)
    assert not found, f"import circles: {found}"


def test_host_layers_import_no_jax(graph):
    mods, ours, theirs, table = graph
    bad = jax_in_host_layers(mods, ours, theirs, table)
    assert not bad, "\n".join(bad)


def test_core_imports_nothing_of_the_device_side(graph):
    mods, ours, _, _ = graph
    bad = core_reaching_up(mods, ours)
    assert not bad, "infire_jax.core is the host side:\n" + "\n".join(bad)


def test_top_level_holds_only_the_faces(graph):
    mods = graph[0]
    extra = extra_top_level(mods)
    assert not extra, f"infire_jax/ keeps only {sorted(TOP_LEVEL)} at its top; move these into a package: {extra}"
    assert len([m for m in mods if m.count(".") == 1 and m.startswith("infire_jax.")
                and mods[m].name != "__init__.py"]) <= 8


def test_the_checks_see_planted_violations(graph, tmp_path):
    """Each check on a planted graph: a lazy import up a layer, a circle, jax and the runner reached from
    core/ through another module, a new module at the top of infire_jax/, and one in no layer are found."""
    mods, _, _, table = graph
    files = {
        "infire_jax.core.scheduler": "def f():\n    from infire_jax.engine.engine import Engine\n",
        "infire_jax.engine.engine": "from infire_jax.core import scheduler\n",
        "infire_jax.core.request": "from infire_jax.runner.buckets import StepShape\n",
        "infire_jax.runner.buckets": "import jax.numpy as jnp\n",
        "infire_jax.helpers": "",
    }
    fake = {}
    for name, text in files.items():
        fake[name] = tmp_path / (name.replace(".", "_") + ".py")
        fake[name].write_text(text)
    ours, theirs = imports(fake)
    assert ours == {"infire_jax.core.scheduler": {"infire_jax.engine.engine"},
                    "infire_jax.engine.engine": {"infire_jax.core.scheduler"},
                    "infire_jax.core.request": {"infire_jax.runner.buckets"}}
    assert imports_up(ours, table) == [
        "infire_jax.core.request (host batching) imports infire_jax.runner.buckets (device)",
        "infire_jax.core.scheduler (host batching) imports infire_jax.engine.engine (engine)"]
    assert circles(fake, ours) == [["infire_jax.core.scheduler", "infire_jax.engine.engine"]]
    assert jax_in_host_layers(fake, ours, theirs, table) == [
        "infire_jax.core.request reaches jax through ['infire_jax.runner.buckets']"]
    assert core_reaching_up(fake, ours) == [
        "infire_jax.core.request reaches ['infire_jax.runner.buckets']",
        "infire_jax.core.scheduler reaches ['infire_jax.engine.engine']"]
    assert extra_top_level(fake) == ["infire_jax.helpers"]
    assert unplaced({"tools.stray": None, **mods}, table) == ["tools.stray"]


def test_the_router_command_imports_no_jax():
    """`infire-jax router` is a light process: importing the CLI and the router brings no jax, through
    package __init__ files too (which the import graph above does not follow)."""
    import subprocess
    import sys

    code = ("import sys, infire_jax.cli, router.app, router.fleet; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'flax')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.stdout.strip() == "[]", out.stdout + out.stderr

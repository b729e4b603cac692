"""The packages import downward only: the folders show the compiler's stages, lowest first.

Every import counts, module level or deferred inside a function (a deferred import is still a
dependency); only ``if TYPE_CHECKING:`` blocks, which never run, are left out. Importing a
module runs its parent packages' ``__init__`` first: those import lazily (or only below), so
they are not counted as the importer's dependencies; ``test_importing_a_low_layer_loads_nothing_above``
checks that at run time.
"""
from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("solver", "autopar", "cost_models", "codegen")

# (rank, group) per module prefix, the longest prefix deciding. A module may import its own group
# and groups of a lower rank; groups of one rank (cost_models, codegen, models) know nothing of
# each other.
LAYERS = {
    "solver": (0, "solver"),
    "autopar.core": (1, "core"),
    "cost_models": (2, "cost_models"),
    "codegen": (2, "codegen"),
    "autopar.models": (2, "models"),
    "autopar.planning": (3, "planning"),
    "autopar.profiling": (4, "profiling"),
    "autopar": (5, "api"),
}


def module_files(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    """Module name -> file, for every .py file of ``packages`` under ``root``."""
    out = {}
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(tree: ast.AST) -> list[tuple[str, tuple[str, ...], int]]:
    """(module, names, level) of every import statement outside ``if TYPE_CHECKING:`` blocks."""
    found = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.extend((alias.name, (), 0) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            found.append((node.module or "", tuple(a.name for a in node.names), node.level))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def import_graph(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> nx.DiGraph:
    """Module -> module edges between the project's files, one per import statement's target."""
    files = module_files(root, packages)
    graph = nx.DiGraph()
    graph.add_nodes_from(files)
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for module, names, level in _imports(ast.parse(path.read_text(), str(path))):
            if level:
                base = package.split(".")[: len(package.split(".")) - (level - 1)]
                module = ".".join(base + ([module] if module else []))
            targets = [f"{module}.{n}" for n in names if f"{module}.{n}" in files] or [module]
            for target in targets:
                while target and target not in files:   # `import a.b.c` names a.b.c's module
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph.add_edge(name, target)
    return graph


def layer_of(module: str) -> tuple[int, str]:
    prefix = max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len)
    return LAYERS[prefix]


def violations(graph: nx.DiGraph) -> list[str]:
    """Every cycle between files and every import that climbs a layer or crosses to a sibling group."""
    out = [f"import cycle: {' -> '.join(c + [c[0]])}" for c in nx.simple_cycles(graph)]
    for src, dst in graph.edges:
        (rank_s, group_s), (rank_d, group_d) = layer_of(src), layer_of(dst)
        if group_s != group_d and rank_d >= rank_s:
            out.append(f"{src} ({group_s}, layer {rank_s}) imports {dst} ({group_d}, layer {rank_d})")
    return sorted(out)


def test_the_project_imports_downward_only():
    graph = import_graph()
    assert graph.number_of_edges() > 50   # the parser finds the imports at all
    assert violations(graph) == []


def test_solver_imports_nothing_of_the_project():
    graph = import_graph()
    outside = [(s, d) for s, d in graph.edges if s.startswith("solver") and not d.startswith("solver")]
    assert outside == []


def test_the_checker_finds_cycles_deferred_imports_and_climbs(tmp_path):
    """A deferred import closing a cycle, and a core module importing the planner, are caught;
    a TYPE_CHECKING import is not a dependency."""
    files = {
        "autopar/__init__.py": "",
        "autopar/core/__init__.py": "",
        "autopar/core/a.py": "def f():\n    from autopar.core import b\n",
        "autopar/core/b.py": "from autopar.core.a import f\nfrom autopar.planning.p import g\n",
        "autopar/core/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from autopar.planning.p import g\n",
        "autopar/planning/__init__.py": "",
        "autopar/planning/p.py": "from ..core.c import *\ng = 1\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    graph = import_graph(tmp_path, ("autopar",))
    assert ("autopar.planning.p", "autopar.core.c") in graph.edges   # relative import resolved
    assert ("autopar.core.c", "autopar.planning.p") not in graph.edges
    found = violations(graph)
    assert any(v.startswith("import cycle") and "autopar.core.a" in v and "autopar.core.b" in v for v in found)
    assert "autopar.core.b (core, layer 1) imports autopar.planning.p (planning, layer 3)" in found
    assert len(found) == 2


def test_importing_a_low_layer_loads_nothing_above():
    """Package __init__ files stay lazy: the cost model's primitives load neither the solver's
    ortools nor the planner, and ``import autopar`` loads no stage at all."""
    code = textwrap.dedent("""
        import sys
        import cost_models.comm
        import autopar
        print(*sorted(m for m in sys.modules if m.startswith(("ortools", "autopar", "cost_models", "codegen", "solver"))))
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    # comm's own module, its neighbour compute, and what they use of the core: hardware, errors, sizes
    assert out.stdout.split() == ["autopar", "autopar.core", "autopar.core.errors", "autopar.core.hardware",
                                  "autopar.core.sizes", "cost_models", "cost_models.comm",
                                  "cost_models.compute"], out.stderr

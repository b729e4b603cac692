"""Every function of the package is short: at most ``MAX_LINES`` lines from its ``def`` (or first
decorator) to its last line, docstring included. A longer one is split into named steps with one
job each (issue 41). Static: parses the sources, imports nothing."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("autopar", "codegen", "cost_models", "solver")
MAX_LINES = 60


def _functions(tree: ast.AST, prefix: str = ""):
    """(qualified name, first line, lines) of every function in ``tree``, nested ones included."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            yield f"{prefix}{node.name}", first, node.end_lineno - first + 1
            yield from _functions(node, f"{prefix}{node.name}.")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, f"{prefix}{node.name}.")
        else:
            yield from _functions(node, prefix)


def long_functions(max_lines: int = MAX_LINES) -> list[str]:
    """``path:line name (N lines)`` of each function over ``max_lines`` lines."""
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            found += [f"{path.relative_to(ROOT)}:{line} {name} ({n} lines)"
                      for name, line, n in _functions(tree) if n > max_lines]
    return found


def test_the_check_sees_a_long_function():
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))
    tree = ast.parse(f"class C:\n  @staticmethod\n  def f():\n{body}\n")
    assert [(name, n) for name, _, n in _functions(tree)] == [("C.f", MAX_LINES + 2)]


def test_no_function_is_longer_than_the_limit():
    too_long = long_functions()
    assert not too_long, (f"functions over {MAX_LINES} lines (docstring included); split them into named "
                          "steps:\n  " + "\n  ".join(too_long))

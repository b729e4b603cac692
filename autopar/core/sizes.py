"""The larger or smaller of two sizes, either of which may be a sympy expression (a capture with
symbolic batch or sequence: ``autopar.planning.symbolic``): ops' memory hooks and the cost model
both compare such sizes."""
from __future__ import annotations

from typing import Any

import sympy


def maximum(a: Any, b: Any) -> Any:
    """``max`` of two numbers; ``sympy.Max`` when either is a sympy expression."""
    if isinstance(a, sympy.Basic) or isinstance(b, sympy.Basic):
        return sympy.Max(a, b)
    return max(a, b)


def minimum(a: Any, b: Any) -> Any:
    """``min`` of two numbers; ``sympy.Min`` when either is a sympy expression."""
    if isinstance(a, sympy.Basic) or isinstance(b, sympy.Basic):
        return sympy.Min(a, b)
    return min(a, b)

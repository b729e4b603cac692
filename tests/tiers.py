"""The test tiers: ``slow`` marks what ``python -m pytest -m "not slow"`` (the inner loop) leaves
out; CI runs everything. A sweep keeps one cheap case in the fast tier (``slow_except``)."""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pytest

slow = pytest.mark.slow


def slow_except(values: Iterable[Any], *fast: Any) -> list[Any]:
    """``values`` for ``pytest.mark.parametrize``, each but those in ``fast`` marked ``slow``: the
    inner loop runs a sweep's smoke case, CI every case."""
    return [v if v in fast else pytest.param(v, marks=slow) for v in values]

"""Human units for reports and error messages: adaptive bytes (B..TiB) and seconds (ns..s)."""
from __future__ import annotations

import math

_BYTE_UNITS = (("TiB", 2.0**40), ("GiB", 2.0**30), ("MiB", 2.0**20), ("KiB", 2.0**10))
_TIME_UNITS = (("s", 1.0), ("ms", 1e-3), ("us", 1e-6), ("ns", 1e-9))


def fmt(value: float | None, unit: str) -> str:
    """``value`` with an adaptive unit: ``unit`` is ``"B"`` (B/KiB/MiB/GiB/TiB) or ``"s"`` (ns/us/ms/s).

    Three significant digits: ``fmt(5151236, "B") == "4.91 MiB"``, ``fmt(0.0030029, "s") == "3.00 ms"``.
    """
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    if unit == "B":
        if abs(value) < 1024:
            return f"{value:.0f} B"
        units = _BYTE_UNITS
    elif unit == "s":
        if value == 0:
            return "0 s"
        units = _TIME_UNITS
    else:
        raise ValueError(f"unit must be 'B' or 's', got {unit!r}")
    for name, scale in units:
        if abs(value) >= scale or scale == units[-1][1]:
            x = value / scale
            digits = 2 if abs(x) < 10 else 1 if abs(x) < 100 else 0
            return f"{x:.{digits}f} {name}"
    raise AssertionError("unreachable")

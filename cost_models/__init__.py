"""Cost model primitives: hardware descriptions, collective and compute costs.

Units: seconds, bytes, bytes/s, FLOP/s (never mixed).
"""
# cost_models raises autopar's errors, and autopar's planner uses cost_models: loading the autopar
# package first keeps every import order free of cycles.
import autopar  # noqa: F401

from .comm import COLLECTIVE_KINDS, Link, collective_time, link_for_axis
from .compute import compute_time
from .hardware import PRESETS, Hardware, get_hardware, hardware_from_dict, hardware_to_dict

__all__ = [
    "COLLECTIVE_KINDS",
    "Hardware",
    "Link",
    "PRESETS",
    "collective_time",
    "compute_time",
    "get_hardware",
    "hardware_from_dict",
    "hardware_to_dict",
    "link_for_axis",
]

"""The line each benchmark's results file records about the machine that measured them."""
from __future__ import annotations

import platform
from pathlib import Path

import torch


def machine_line(load: bool = False) -> str:
    """``host (cpu, N threads)``; ``load``: with the load average (timings shared cores slow down)."""
    extra = f", load {Path('/proc/loadavg').read_text().split()[:3]}" if load else ""
    return f"{platform.node()} ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads{extra})"

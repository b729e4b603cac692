"""Each benchmark's results file: the machine that measured them, the command, the figures."""
from __future__ import annotations

import json
import platform
from pathlib import Path
from typing import Any

import torch


def machine_line(load: bool = False) -> str:
    """``host (cpu, N threads)``; ``load``: with the load average (timings shared cores slow down)."""
    extra = f", load {Path('/proc/loadavg').read_text().split()[:3]}" if load else ""
    return f"{platform.node()} ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads{extra})"


def save_results(path: Path, command: str, fields: dict[str, Any], machine: str | None = None) -> None:
    """Write ``fields`` to ``path`` (JSON) after the machine's line (``machine_line()`` unless
    given) and the command that reproduces them."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"machine": machine or machine_line(), "command": command, **fields}, indent=1))
    print(f"saved {path}")

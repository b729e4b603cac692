"""How fast this host runs now against how fast it usually runs: keeps measured seconds comparable.

A shared CPU host runs the same code up to ~1.8x slower in spells that last seconds (another
tenant on the cores; no steal time is reported, and thread CPU time equals wall time, so no clock
excludes it). Ops profiled in a slow spell and a training step measured in a fast one disagree by
that much, whatever the cost model. So every CPU measurement is taken in turns with a fixed probe
workload (:class:`HostClock`), and scaled by how much slower the probe ran then than on a nominal
host (``NOMINAL_PROBE_S``). The probe's own timings go into the profile (``host_probe_s``); their
median is the host's typical speed, and the profile's seconds are seconds at that speed. On a
2-core VM the speed of a small training step over one-second windows spread 1.7x (5th to 95th
percentile) and its ratio to the probe 1.2x.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch

#: Seconds of one probe call the clock scales to; only the ratio to the typical probe matters.
NOMINAL_PROBE_S = 1e-4
#: A probe run lasts about this long: long enough that its median over a few runs is steady.
PROBE_RUN_S = 1e-3


class HostClock:
    """Times a fixed probe (a tiny MLP's forward and backward: matmuls, element-wise ops,
    autograd, the mix a training step runs) and scales seconds measured beside it to the nominal
    host. ``samples``: seconds per probe call of every probe timing scaled so far."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self._weights = [torch.randn(64, 64, generator=g, requires_grad=True) for _ in range(3)]
        self._x = torch.randn(32, 64, generator=g)
        self._once()
        start = time.perf_counter()
        self._once()
        self.calls = max(1, round(PROBE_RUN_S / max(time.perf_counter() - start, 1e-7)))
        self.samples: list[float] = []

    def _once(self) -> None:
        h = self._x
        for w in self._weights:
            h = torch.tanh(h @ w)
        h.sum().backward()
        for w in self._weights:
            w.grad = None

    def probe(self) -> None:
        """One probe run: ``calls`` probe calls (about ``PROBE_RUN_S``)."""
        for _ in range(self.calls):
            self._once()

    def run_seconds(self, runs: int = 5) -> float:
        """The median seconds of ``runs`` probe runs, timed now."""
        times = []
        for _ in range(runs):
            start = time.perf_counter()
            self.probe()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    def scaled(self, seconds: Sequence[float], probe_run_s: float, to: float = NOMINAL_PROBE_S) -> list[float]:
        """``seconds`` measured in turns with probe runs of ``probe_run_s`` each, as they would
        be on a host where one probe call takes ``to`` seconds (default: the nominal host); the
        probe's speed is kept in ``samples``."""
        per_call = probe_run_s / self.calls
        self.samples.append(per_call)
        return [s * to / per_call for s in seconds]


def typical_probe_s(samples: Sequence[float]) -> float | None:
    """The host's usual seconds per probe call: the median of the samples (None without any)."""
    return statistics.median(samples) if samples else None

"""Alpha-beta (latency-bandwidth) cost of collectives over one group of ``n`` devices.

All times are in seconds, sizes in bytes, bandwidths in bytes/s per device.

Meaning of ``nbytes`` per collective (``N`` below), and the model used
(ring algorithms, ``a`` = ``link.latency``, ``B`` = ``link.bandwidth``):

=================  ==========================================================  ======================================
kind               N is                                                        time
=================  ==========================================================  ======================================
all_reduce         the tensor each rank holds (input size == output size)      2(n-1)*a + 2(n-1)/n * N/B
all_gather         the FULL gathered output; each rank contributes N/n         (n-1)*a + (n-1)/n * N/B
reduce_scatter     the FULL input each rank holds; each rank keeps N/n         (n-1)*a + (n-1)/n * N/B
all_to_all         each rank's whole send buffer (== its receive buffer);      (n-1)*a + (n-1)/n * N/B
                   it sends N/n to each of the n-1 peers and keeps N/n
all_to_all_single  as all_to_all                                               as all_to_all
broadcast          the FULL tensor, sent from the root to every rank;          (n-1)*a + N/B
                   pipelined (chunked) ring as NCCL does: every link
                   carries the whole tensor once, n-1 hops of start-up
send_recv          the message sent from one rank to another                   a + N/B
=================  ==========================================================  ======================================

``all_to_all`` is DTensor's ``Shard(i) -> Shard(j)`` redistribution, ``all_to_all_single`` the
``torch.distributed`` call an op's kernel runs itself (expert dispatch, Ulysses attention): the
same exchange, a kind of its own because a backend may run them differently (gloo has no
all-to-all for DTensor, which all-gathers and chunks instead: 1.7-2.7x the real one's time), and
a profile fits a link to each.

``n == 1`` costs 0 for every kind (no communication happens), as does ``N == 0``.
``N`` may be a sympy expression (symbolic costs, ``autopar.planning.symbolic``); the time then is one too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from .compute import is_amount

if TYPE_CHECKING:  # pragma: no cover
    from autopar.core.hardware import Hardware

__all__ = ["ALL_TO_ALLS", "Link", "COLLECTIVE_KINDS", "collective_time", "crosses_nodes", "link_for_axis"]

COLLECTIVE_KINDS: tuple[str, ...] = (
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "all_to_all_single",
    "send_recv",
    "broadcast",
)

#: The kinds whose ``nbytes`` is one rank's buffer, not the whole tensor.
ALL_TO_ALLS: tuple[str, ...] = ("all_to_all", "all_to_all_single")


@dataclass(frozen=True)
class Link:
    """A link as seen by one device: ``bandwidth`` in bytes/s per device (one direction),
    ``latency`` in seconds per message step."""

    bandwidth: float
    latency: float

    def __post_init__(self) -> None:
        if not (isinstance(self.bandwidth, (int, float)) and math.isfinite(self.bandwidth) and self.bandwidth > 0):
            raise ValueError(f"Link.bandwidth must be a positive finite number of bytes/s, got {self.bandwidth!r}")
        if not (isinstance(self.latency, (int, float)) and math.isfinite(self.latency) and self.latency >= 0):
            raise ValueError(f"Link.latency must be a non-negative finite number of seconds, got {self.latency!r}")


def collective_time(kind: str, nbytes: float, n: int, link: Link) -> float:
    """Seconds for collective ``kind`` moving ``nbytes`` (see the module docstring for what
    ``nbytes`` means per kind) over a group of ``n`` devices joined by ``link``."""
    if kind not in COLLECTIVE_KINDS:
        raise ValueError(f"unknown collective kind {kind!r}; valid kinds: {', '.join(COLLECTIVE_KINDS)}")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"group size n must be an integer >= 1, got {n!r}")
    if not is_amount(nbytes):
        raise ValueError(f"nbytes must be a non-negative finite number, got {nbytes!r}")
    if n == 1 or nbytes == 0:
        return 0.0

    a, bw = link.latency, link.bandwidth
    if kind == "all_reduce":
        return 2 * (n - 1) * a + 2 * (n - 1) / n * nbytes / bw
    if kind in ("all_gather", "reduce_scatter", *ALL_TO_ALLS):
        return (n - 1) * a + (n - 1) / n * nbytes / bw
    if kind == "broadcast":
        return (n - 1) * a + nbytes / bw
    # send_recv
    return a + nbytes / bw


def crosses_nodes(hw: "Hardware", axis_sizes: Sequence[int], axis: int) -> bool:
    """Do the groups along mesh axis ``axis`` span nodes?

    Devices are numbered row-major over ``axis_sizes`` (the last axis varies
    fastest) and fill nodes of ``hw.devices_per_node`` consecutive ranks.  A
    group along ``axis`` then spans ``prod(axis_sizes[axis:])`` consecutive
    ranks; the axis is intra-node when that span is <= ``devices_per_node``
    and no group straddles a node boundary (the span divides
    ``devices_per_node``, or the whole mesh fits in one node).
    """
    sizes = [int(s) for s in axis_sizes]
    if not sizes or any(s < 1 for s in sizes):
        raise ValueError(f"axis_sizes must be a non-empty sequence of positive ints, got {list(axis_sizes)!r}")
    ndim = len(sizes)
    if not -ndim <= axis < ndim:
        raise ValueError(f"axis {axis} out of range for a {ndim}-d mesh {tuple(sizes)}")
    span = math.prod(sizes[axis % ndim:])
    dpn = hw.devices_per_node
    return not (span <= dpn and (dpn % span == 0 or math.prod(sizes) <= dpn))


def link_for_axis(hw: "Hardware", axis_sizes: Sequence[int], axis: int) -> Link:
    """The link used by collectives along mesh axis ``axis``: the node's (NVLink) where its
    groups stay within a node, else the inter-node one (each device uses its own NIC, so the
    per-device inter-node bandwidth applies: a ring is bound by its slowest link). Its bandwidth
    is what NCCL's collectives reach of the datasheet's, where the hardware's efficiency table
    says (``cost_models.efficiency``)."""
    from cost_models.efficiency import efficiency_of  # efficiency imports this module's package

    eff = efficiency_of(hw)
    if crosses_nodes(hw, axis_sizes, axis):
        bandwidth, latency, fraction = hw.inter_node_bandwidth, hw.inter_node_latency, "inter_node"
    else:
        bandwidth, latency, fraction = hw.intra_node_bandwidth, hw.intra_node_latency, "intra_node"
    return Link(bandwidth=bandwidth * (eff.links[fraction] if eff is not None else 1.0), latency=latency)

"""The op registry: what sets an op apart from the rest, declared once, beside its sharding rule.

Most ops need no entry: a rule family of ``autopar.core.rules`` splits them, generated code calls
the ATen op on local tensors, profiling times that call and the cost model prices its FLOPs and
bytes. An op that differs anywhere gets an ``OpEntry``, filled in by decorators in its family's
module of this package (as DTensor registers a sharding strategy beside its op), each hook
optional:

* ``@rule(op)``: its sharding rule for one mesh axis (``rules.RuleFn``);
* ``@rule_key(op)``: what its rule reads of the node beyond shapes and arguments (a folded
  mask's kind): rules are cached by shapes and arguments, and by this;
* ``@emitter(op)``: how generated code runs it (``Emitter``, ``Site``), or False: as a plain call;
* ``@timed(op)``: the call profiling times for it, which the cost model then looks up;
* ``@collectives(op)``: collectives it runs inside itself, which the cost model prices;
* ``@saved(op)``: what its backward keeps, where running it on fake tensors would mislead;
* ``@working(op)``: bytes of the temporaries it holds while it runs, beyond its output, what it
  keeps and its inputs' gradients (a chunked kernel's chunks; all of them where ``Kept.by_parts``);
* ``@imbalance(op)``: how many times the mean work (compute, collectives, kept tensors) its
  busiest rank does under a placement, given ``PlanOptions.expert_skew`` (routed experts);
* ``@flop_share(op)``: the share of an even split of its counted FLOPs its busiest rank
  computes under a placement, for the roofline (a profile times the busiest rank's call,
  ``@timed``): a causal ring's, which FLOP counts count unmasked;
* ``@kernel``: a function generated code calls by its name (what ``@emitter`` emits), the op's
  runtime: the module that says how the op splits also says how a split op runs.

Hooks get a node's placements as ``Placed`` (a ``Strategy`` while planning, a ``NodePlan`` in
code generation). ``docs/ops.md`` walks through cross-entropy's entry.
"""
from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, Protocol, TypeVar

import torch
import torch.fx as fx

from autopar.core.errors import AutoparError
from autopar.core.placements import Placements

if TYPE_CHECKING:
    from autopar.core.plan import NodePlan
    from autopar.core.rules import RuleFn


class Placed(Protocol):
    """A node's placements under one choice: ``ins`` per flat tensor input, ``out``."""

    @property
    def ins(self) -> tuple[Placements, ...]: ...

    @property
    def out(self) -> Placements: ...


class LocalCall(NamedTuple):
    """One op call as a rank runs it: its target and arguments (meta tensors of local shapes)."""

    target: Any
    args: tuple
    kwargs: dict[str, Any]


#: The collective a kernel runs itself, where not DTensor's (``Collective.kind``).
CollectiveKind = Literal["all_to_all_single"]
#: The in-step factor a blocking collective is priced at (``Collective.in_step``).
InStep = Literal["comm", "experts"]


class Collective(NamedTuple):
    """A collective an op runs inside itself: a tensor of ``shape`` and ``dtype`` moved from
    placements ``src`` to ``dst`` (priced as ``CostModel.redistribute`` prices a move).
    ``hidden_by``: the share of the op's compute that runs while it is in flight (0: it blocks),
    which hides it as far as this host overlaps communication with compute. ``kind``: the
    collective the kernel runs (a ``cost_models.comm.COLLECTIVE_KINDS`` name) where it is not
    the one DTensor's redistribution from ``src`` to ``dst`` runs (None: that one): a kernel
    calling ``all_to_all_single`` itself is priced on that collective's link, not on DTensor's
    all-to-all (on gloo, an all-gather and a chunk). ``in_step``: which calibrated in-step factor
    prices it (``CostModel.redistribute``): "comm", that of blocking collectives, fitted on
    tensor-parallel steps whose collectives follow a matmul or two; "experts", the experts'
    dispatch and combine, which follow whole blocks of compute (attention and the router; the
    experts), after which ranks arrive further apart."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    src: Placements
    dst: Placements
    hidden_by: float = 0.0
    kind: CollectiveKind | None = None
    in_step: InStep = "comm"


class Kept(NamedTuple):
    """What an op's backward keeps: inputs by position, its output, and other bytes (whole op).
    ``by_parts``: its kernel is differentiated by autograd op by op (no backward formula of its
    own), so each of the other tensors is freed once its own part of the backward has run: the
    op never holds their gradients all at once, and its ``@working`` hook counts every temporary
    it holds, the buffers of its collectives among them."""

    inputs: frozenset[int]
    output: bool
    extra_bytes: Any
    by_parts: bool = False
    #: the share of ``extra_bytes`` one rank keeps, given its inputs' placements and the mesh's
    #: shape; None: the most split input's share (tensors kept per row of the split input)
    share: Callable[[Sequence[Placements], Sequence[int]], float] | None = None


@dataclass(frozen=True)
class Site:
    """One op as its emitter sees it: the node, its plan, its tensor inputs, the variable each is
    read from (``reads``: moves already emitted), its line's comment and positional arguments."""

    node: fx.Node
    plan: NodePlan
    inputs: list[fx.Node]
    reads: dict[str, str]
    comment: str
    args: str

    def read(self, node: fx.Node) -> str:
        """The variable holding this rank's part of input ``node``, placed as the op reads it."""
        return self.reads.get(node.name, node.name)


#: What a generated forward returns: every output whole on every rank, each rank's part, or the loss alone.
OutputMode = Literal["full", "sharded", "loss"]


class Emitter(Protocol):
    """What the code generator (``codegen.generate._Emitter``) offers an op's emitter."""

    axes: tuple[str, ...]              # mesh axis names
    sizes: Any                         # ``codegen.generate.LocalSizes``: this rank's sizes, as text
    outputs: OutputMode                # what the forward returns
    counted_loss: str | None           # the loss whose target count comes as ``loss_count``
    loss_with_gradients: str | None    # the loss ``train_step`` sums with the gradients
    counts_loss: bool                  # the code reads ``loss_count``
    loss_summed_over: tuple[int, ...]  # the loss returned is this rank's summand over these axes
    masked_attention: set[str]         # SDPA nodes reading a folded mask
    unlike_dtensor: set[str]           # values split as an uneven view splits them
    balanced: Any                      # ``seq_layout.BalancedLayout``: values held in a balanced ring's order, or None

    def emit(self, line: str, comment: str = "") -> None: ...

    def call_text(self, node: fx.Node, reads: dict[str, str], shape: str | None = None) -> str: ...


EmitFn = Callable[[Emitter, Site], bool]
TimedFn = Callable[[LocalCall, fx.Node, Placed, Sequence[int], Mapping[fx.Node, bool]], LocalCall]
CollectivesFn = Callable[[fx.Node, Placed, Sequence[int], bool, "str | None"], list[Collective]]
SavedFn = Callable[[fx.Node, tuple[bool, ...]], "Kept | None"]
WorkingFn = Callable[[fx.Node, Placed, Sequence[int]], float]
RuleKeyFn = Callable[[fx.Node], Hashable]
ImbalanceFn = Callable[[Placed, Callable[[int], float]], float]
FlopShareFn = Callable[[fx.Node, Placed, Sequence[int]], float]


@dataclass
class OpEntry:
    """One op's special handling (see the module docstring); None where it is like any op."""

    target: Any
    rule: RuleFn | None = None
    rule_key: RuleKeyFn | None = None
    emit: EmitFn | None = None
    timed: TimedFn | None = None
    collectives: CollectivesFn | None = None
    saved: SavedFn | None = None
    working: WorkingFn | None = None
    imbalance: ImbalanceFn | None = None
    flop_share: FlopShareFn | None = None


#: op -> its entry, filled in as the modules of ``autopar.core.ops`` are imported.
REGISTRY: dict[Any, OpEntry] = {}

F = TypeVar("F", bound=Callable)


def _registrar(hook: str) -> Callable[..., Callable[[F], F]]:
    """A decorator factory setting ``hook`` of the entries of the ops it names."""

    def register(*targets: Any) -> Callable[[F], F]:
        def decorate(fn: F) -> F:
            for target in targets:
                entry = REGISTRY.setdefault(target, OpEntry(target))
                if getattr(entry, hook) is not None:
                    raise AutoparError(f"{target} has two {hook} hooks: {getattr(entry, hook).__qualname__} "
                                       f"and {fn.__qualname__}; an op is declared in one module")
                setattr(entry, hook, fn)
            return fn
        return decorate

    register.__doc__ = f"Register the decorated function as the ``{hook}`` hook of ``targets``."
    return register


rule = _registrar("rule")
rule_key = _registrar("rule_key")
emitter = _registrar("emit")
timed = _registrar("timed")
collectives = _registrar("collectives")
saved = _registrar("saved")
working = _registrar("working")
imbalance = _registrar("imbalance")
flop_share = _registrar("flop_share")


#: name -> a function generated code calls as ``kernels.<name>``, filled in by ``@kernel`` as the
#: modules of ``autopar.core.ops`` are imported.
KERNELS: dict[str, Callable] = {}


#: name -> a ``TimedKernel``, filled in as the modules of ``autopar.core.ops`` are imported.
TIMED_KERNELS: dict[str, TimedKernel] = {}


class TimedKernel:
    """What profiling times for an op whose generated code runs a kernel the op's own call would
    misprice (an ``@timed`` hook's target): ``fn``, named ``name`` in profile keys and looked up by
    that name on the profiler's ranks (``TIMED_KERNELS``), as an op is in ``torch.ops``."""

    def __init__(self, name: str, fn: Callable) -> None:
        self.name, self.fn = name, fn
        TIMED_KERNELS[name] = self

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __repr__(self) -> str:
        return self.name


class Kernels:
    """``kernels`` in generated code: ``kernels.<name>`` is ``KERNELS[name]``, looked up at the call.
    One namespace, so that no graph value's name can shadow a kernel's."""

    def __getattr__(self, name: str) -> Callable:
        if name not in KERNELS:
            raise AttributeError(f"no op kernel is named {name!r}; kernels are declared with @kernel in autopar.core.ops")
        return KERNELS[name]


def kernel(fn: F) -> F:
    """Register ``fn`` as a runtime kernel, called by generated code as ``kernels.<its __name__>``."""
    if fn.__name__ in KERNELS:
        raise AutoparError(f"two kernels are named {fn.__name__!r}: {KERNELS[fn.__name__].__module__} and "
                           f"{fn.__module__}; generated code calls a kernel by its name")
    KERNELS[fn.__name__] = fn
    return fn

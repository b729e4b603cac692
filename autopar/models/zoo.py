"""A small model zoo for tests, the CLI (``autopar demo``, ``autopar plan --model NAME``) and benchmarks.

Each entry is a :class:`ZooEntry`: how to build the model and how to make example inputs for it.
Models are built on the *current default device*, so planning a huge model costs no memory::

    entry = get_model("gpt-175b")
    with torch.device("meta"):
        model = entry.build()
    args, kwargs = entry.example(device="meta")

Every entry's forward returns the training loss when given its example inputs
(``targets=`` for the hand-written GPT, ``labels=`` for the Hugging Face models).

Entries
-------
* ``gpt-tiny``, ``gpt-125m``, ``gpt-1.3b``, ``gpt-13b``, ``gpt-175b``: the hand-written GPT of
  :mod:`autopar.models.gpt` with the GPT-3 paper's shapes (``gpt-tiny`` is the demo model).
* ``gpt2-tiny``, ``gpt2-125m``: ``transformers.GPT2LMHeadModel``.
* ``llama-tiny``, ``llama-7b``, ``llama-70b``: ``transformers.LlamaForCausalLM`` (Llama-2 shapes; GQA).
* ``bert-tiny``, ``bert-base``: ``transformers.BertForMaskedLM``.

``get_model`` also accepts ``"pkg.module:factory"`` for user models (see :func:`get_model`).

Hugging Face models are made export-friendly (see :func:`_hf_build` and :func:`_prepare_hf_model`):

* random weights only (nothing is ever downloaded), training mode, ``use_cache=False``;
* dropout probabilities 0 (HF still emits ``aten.dropout(x, 0.0, True)`` nodes);
* untied input/output embeddings (BERT's then-unused ``cls.predictions.bias`` is removed);
* attention implementation ``autopar_sdpa``: SDPA with ``is_causal=True`` (BERT: ``False``) and
  no ``attn_mask``, instead of a ``[B, 1, T, T]`` mask that HF materialises under ``torch.export``
  (padding ``attention_mask`` arguments are therefore ignored; the zoo never passes one).

The rotary embedding's ``torch.no_grad`` region is kept: capture inlines it.

With ``labels`` the HF models return a ``ModelOutput``; an exported program's outputs are then
``(loss, logits)``, without labels ``(logits,)``.
"""

from __future__ import annotations

import difflib
import importlib
import types
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn

from autopar.core.errors import AutoparError
from autopar.models.gpt import GPT, GPTConfig

__all__ = ["ZooEntry", "get_model", "list_models"]

DeviceLike = torch.device | str


@dataclass(frozen=True)
class ZooEntry:
    """A model of the zoo: how to build it and how to make example inputs for it."""

    name: str
    description: str  # e.g. "GPT-3 175B: 96 layers, d=12288, 96 heads"
    # Builds the model on the current default device (use ``with torch.device("meta")`` to plan).
    build: Callable[[], nn.Module]
    # (batch, seq, device) -> positional args of forward.
    example_inputs: Callable[[int, int, torch.device], tuple]
    # (batch, seq, device) -> keyword args of forward (e.g. HF ``labels=``); may be empty.
    example_kwargs: Callable[[int, int, torch.device], dict]
    default_batch: int
    default_seq: int
    num_params: int | None = None  # parameter count (exact for the built-in entries)

    def example(
        self, batch: int | None = None, seq: int | None = None, device: DeviceLike = "cpu"
    ) -> tuple[tuple, dict]:
        """``(args, kwargs)`` for ``model(*args, **kwargs)``; defaults to ``default_batch``/``default_seq``."""
        batch = self.default_batch if batch is None else batch
        seq = self.default_seq if seq is None else seq
        device = torch.device(device)
        return self.example_inputs(batch, seq, device), self.example_kwargs(batch, seq, device)


# ---------------------------------------------------------------------------------------------
# Example inputs
# ---------------------------------------------------------------------------------------------


def _random_tokens(batch: int, seq: int, vocab: int, device: torch.device, seed: int = 0) -> torch.Tensor:
    """Deterministic random token ids of shape ``(batch, seq)`` (same values for the same arguments).

    Uses a private generator, so it neither reads nor advances torch's global RNG.
    On ``meta`` the values are meaningless, only the shape/dtype matter.
    """
    if device.type == "meta":
        return torch.empty(batch, seq, dtype=torch.long, device=device)
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=gen, dtype=torch.long).to(device)


def _no_kwargs(batch: int, seq: int, device: torch.device) -> dict:
    return {}


def _gpt_inputs(vocab: int) -> Callable[[int, int, torch.device], tuple]:
    # (idx, targets): targets are idx shifted by one token, as in language-model training.
    # Both are separate (non-aliasing) tensors: torch.export mis-captures inputs that alias.
    def example_inputs(batch: int, seq: int, device: torch.device) -> tuple:
        tokens = _random_tokens(batch, seq + 1, vocab, device)
        return tokens[:, :-1].clone(), tokens[:, 1:].clone()

    return example_inputs


def _hf_inputs(vocab: int) -> Callable[[int, int, torch.device], tuple]:
    def example_inputs(batch: int, seq: int, device: torch.device) -> tuple:
        return (_random_tokens(batch, seq, vocab, device),)

    return example_inputs


def _hf_labels(vocab: int) -> Callable[[int, int, torch.device], dict]:
    # labels == input_ids (HF shifts causal-LM labels itself), but as a separate tensor: if
    # labels aliased input_ids, torch.export would wire both graph inputs to the same one.
    def example_kwargs(batch: int, seq: int, device: torch.device) -> dict:
        return {"labels": _random_tokens(batch, seq, vocab, device).clone()}

    return example_kwargs


# ---------------------------------------------------------------------------------------------
# Hand-written GPT entries
# ---------------------------------------------------------------------------------------------


def _gpt_entry(
    name: str, title: str, cfg: GPTConfig, default_batch: int, default_seq: int
) -> ZooEntry:
    return ZooEntry(
        name=name,
        description=(
            f"{title}: {cfg.n_layer} layers, d={cfg.n_embd}, {cfg.n_head} heads, "
            f"vocab {cfg.vocab_size}, context {cfg.block_size} (hand-written GPT)"
        ),
        build=lambda: GPT(cfg),
        example_inputs=_gpt_inputs(cfg.vocab_size),
        example_kwargs=_no_kwargs,
        default_batch=default_batch,
        default_seq=default_seq,
        num_params=cfg.num_params(),
    )


def _gpt3(n_layer: int, n_embd: int, n_head: int) -> GPTConfig:
    # Shapes from the GPT-3 paper (Brown et al. 2020, table 2.1); context 2048, GPT-2 BPE vocab.
    return GPTConfig(vocab_size=50257, block_size=2048, n_layer=n_layer, n_head=n_head, n_embd=n_embd)


# ---------------------------------------------------------------------------------------------
# Hugging Face entries
# ---------------------------------------------------------------------------------------------

_HF_ATTN = "autopar_sdpa"


def _import_transformers() -> types.ModuleType:
    try:
        import transformers
    except ImportError as e:  # pragma: no cover - transformers is a test dependency
        raise AutoparError(
            "this zoo model needs Hugging Face transformers: pip install 'transformers>=4.50'"
        ) from e
    return transformers


def _register_hf_attention() -> None:
    """Register ``autopar_sdpa``: HF's SDPA attention, but with the mask left to SDPA.

    With ``attn_implementation="sdpa"``, HF decides at run time whether a mask is needed; under
    ``torch.export`` it always materialises a ``[B, 1, T, T]`` boolean mask from position ids
    (``diff``/``cumsum``/``index`` ops) and passes it as ``attn_mask``. Because ``autopar_sdpa``
    has no entry in HF's *mask* registry, HF builds no mask at all (``attention_mask`` becomes
    None) and its SDPA function calls ``F.scaled_dot_product_attention(..., is_causal=True)``
    for causal models (``is_causal=False`` for BERT) -- which is also what eager mode does.
    Consequence: a 2-D padding ``attention_mask`` passed to these models is ignored; the zoo
    never passes one.
    """
    _import_transformers()
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if _HF_ATTN not in AttentionInterface._global_mapping:
        AttentionInterface.register(_HF_ATTN, sdpa_attention_forward)


def _prepare_hf_model(model: nn.Module) -> nn.Module:
    model.config.use_cache = False
    if getattr(model, "loss_type", "") is None and type(model).__name__.endswith(("ForCausalLM", "LMHeadModel")):
        model.loss_type = "ForCausalLM"  # what HF falls back to anyway, minus its warning
    model.train()
    return model


def _hf_build(
    model_cls_name: str,
    config_cls_name: str,
    post_build: Callable[[nn.Module], None] | None = None,
    **config_kwargs: Any,
) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        transformers = _import_transformers()
        _register_hf_attention()
        config = getattr(transformers, config_cls_name)(
            use_cache=False,
            # Untied: one parameter used both by the embedding lookup and the output matmul
            # would force both uses to agree on a single sharding.
            tie_word_embeddings=False,
            attn_implementation=_HF_ATTN,
            **config_kwargs,
        )
        model = getattr(transformers, model_cls_name)(config)  # random init, no download
        if post_build is not None:
            post_build(model)
        return _prepare_hf_model(model)

    return build


def _hf_entry(
    name: str,
    description: str,
    build: Callable[[], nn.Module],
    vocab: int,
    default_batch: int,
    default_seq: int,
    num_params: int,
) -> ZooEntry:
    return ZooEntry(
        name=name,
        description=description,
        build=build,
        example_inputs=_hf_inputs(vocab),
        example_kwargs=_hf_labels(vocab),
        default_batch=default_batch,
        default_seq=default_seq,
        num_params=num_params,
    )


def _gpt2(name: str, title: str, n_layer: int, n_embd: int, n_head: int, vocab: int, n_positions: int,
          default_seq: int, num_params: int) -> ZooEntry:
    build = _hf_build(
        "GPT2LMHeadModel", "GPT2Config",
        n_layer=n_layer, n_embd=n_embd, n_head=n_head, vocab_size=vocab, n_positions=n_positions,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        # GPT-2's default bos/eos id 50256 must lie inside the (tiny) vocabulary.
        bos_token_id=min(50256, vocab - 1), eos_token_id=min(50256, vocab - 1),
    )
    desc = f"{title}: {n_layer} layers, d={n_embd}, {n_head} heads, vocab {vocab} (HF GPT2LMHeadModel, untied)"
    return _hf_entry(name, desc, build, vocab, 8, default_seq, num_params)


def _llama(name: str, title: str, n_layer: int, hidden: int, heads: int, kv_heads: int, inter: int,
           vocab: int, max_pos: int, default_seq: int, num_params: int) -> ZooEntry:
    build = _hf_build(
        "LlamaForCausalLM", "LlamaConfig",
        num_hidden_layers=n_layer, hidden_size=hidden, num_attention_heads=heads,
        num_key_value_heads=kv_heads, intermediate_size=inter, vocab_size=vocab,
        max_position_embeddings=max_pos,
    )
    desc = (f"{title}: {n_layer} layers, d={hidden}, {heads} heads ({kv_heads} kv), ffn {inter}, "
            f"vocab {vocab} (HF LlamaForCausalLM)")
    return _hf_entry(name, desc, build, vocab, 8, default_seq, num_params)


def _drop_unused_mlm_bias(model: nn.Module) -> None:
    # BertLMPredictionHead has a ``bias`` parameter that HF ties to ``decoder.bias`` only when
    # the word embeddings are tied too. Untied, it would be a parameter that no op reads (and
    # that never gets a gradient); the decoder keeps its own bias, so drop the unused one.
    del model.cls.predictions.bias


def _bert(name: str, title: str, n_layer: int, hidden: int, heads: int, inter: int, vocab: int,
          max_pos: int, default_seq: int, num_params: int) -> ZooEntry:
    build = _hf_build(
        "BertForMaskedLM", "BertConfig", post_build=_drop_unused_mlm_bias,
        num_hidden_layers=n_layer, hidden_size=hidden, num_attention_heads=heads,
        intermediate_size=inter, vocab_size=vocab, max_position_embeddings=max_pos,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    desc = (f"{title}: {n_layer} layers, d={hidden}, {heads} heads, ffn {inter}, vocab {vocab} "
            f"(HF BertForMaskedLM, MLM loss on all tokens, untied)")
    return _hf_entry(name, desc, build, vocab, 8, default_seq, num_params)


# ---------------------------------------------------------------------------------------------
# Registry
# ---------------------------------------------------------------------------------------------

_REGISTRY: dict[str, ZooEntry] = {}


def _register(entry: ZooEntry) -> None:
    assert entry.name not in _REGISTRY, entry.name
    _REGISTRY[entry.name] = entry


# The demo model: small enough to train on a laptop CPU in seconds.
_register(_gpt_entry("gpt-tiny", "Tiny GPT (demo)", GPTConfig(), default_batch=8, default_seq=32))
_register(_gpt_entry("gpt-125m", "GPT-3 Small 125M", _gpt3(12, 768, 12), 8, 2048))
_register(_gpt_entry("gpt-1.3b", "GPT-3 XL 1.3B", _gpt3(24, 2048, 16), 8, 2048))
_register(_gpt_entry("gpt-13b", "GPT-3 13B", _gpt3(40, 5120, 40), 8, 2048))
_register(_gpt_entry("gpt-175b", "GPT-3 175B", _gpt3(96, 12288, 96), 8, 2048))

# num_params of the HF entries were counted by building them on the meta device
# (tests/test_zoo.py checks the tiny ones).
_register(_gpt2("gpt2-tiny", "Tiny GPT-2", 2, 64, 4, vocab=256, n_positions=64, default_seq=32,
                num_params=136_960))
_register(_gpt2("gpt2-125m", "GPT-2 small 124M", 12, 768, 12, vocab=50257, n_positions=1024,
                default_seq=1024, num_params=163_037_184))

_register(_llama("llama-tiny", "Tiny Llama", 2, 64, 4, 2, 128, vocab=256, max_pos=64, default_seq=32,
                 num_params=106_816))
_register(_llama("llama-7b", "Llama-2 7B", 32, 4096, 32, 32, 11008, vocab=32000, max_pos=4096,
                 default_seq=4096, num_params=6_738_415_616))
_register(_llama("llama-70b", "Llama-2 70B", 80, 8192, 64, 8, 28672, vocab=32000, max_pos=4096,
                 default_seq=4096, num_params=68_976_648_192))

_register(_bert("bert-tiny", "Tiny BERT", 2, 64, 4, 128, vocab=256, max_pos=64, default_seq=32,
                num_params=108_608))
_register(_bert("bert-base", "BERT-base 110M", 12, 768, 12, 3072, vocab=30522, max_pos=512,
                default_seq=512, num_params=132_955_194))


def list_models() -> list[str]:
    """Names of the built-in zoo entries, in a stable order (tiny models of each family first)."""
    return list(_REGISTRY)


def get_model(name: str) -> ZooEntry:
    """The zoo entry ``name``, or a user model given as ``"pkg.module:factory"``.

    For ``"pkg.module:attr"``, ``attr`` (a dotted path inside the module is allowed) may be

    * a :class:`ZooEntry`, returned as is;
    * a zero-argument callable returning a :class:`ZooEntry` (returned) or an ``nn.Module``.
      For a module, the entry's ``build`` is the factory itself; example inputs come from
      optional module-level functions ``example_inputs(batch, seq, device) -> tuple`` and
      ``example_kwargs(batch, seq, device) -> dict``, defaults from ``DEFAULT_BATCH`` /
      ``DEFAULT_SEQ`` (else 8 and 32).

    To tell the two apart, the factory is called once here under ``torch.device("meta")``,
    so no real memory is allocated.

    Raises :class:`~autopar.core.errors.AutoparError` for an unknown name (listing the available ones)
    or a factory that cannot be imported or returns something else.
    """
    if name in _REGISTRY:
        return _REGISTRY[name]
    if ":" in name:
        return _entry_from_factory(name)
    close = difflib.get_close_matches(name, list(_REGISTRY), n=3)
    hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    raise AutoparError(
        f"unknown model {name!r}.{hint} Available models: {', '.join(_REGISTRY)}. "
        "A user model can be given as 'pkg.module:factory'."
    )


def _entry_from_factory(spec: str) -> ZooEntry:
    module_name, _, attr_path = spec.partition(":")
    if not module_name or not attr_path:
        raise AutoparError(f"model {spec!r}: expected 'pkg.module:factory'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise AutoparError(
            f"model {spec!r}: cannot import module {module_name!r} ({e}); "
            "is it installed or on PYTHONPATH?"
        ) from e
    obj: Any = module
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise AutoparError(f"model {spec!r}: module {module_name!r} has no attribute {attr_path!r}") from None

    if isinstance(obj, ZooEntry):
        return obj
    if not callable(obj):
        raise AutoparError(f"model {spec!r}: {attr_path!r} is neither a ZooEntry nor a callable factory")

    factory: Callable[[], Any] = obj
    try:
        with torch.device("meta"):
            probe = factory()
    except Exception as e:
        raise AutoparError(
            f"model {spec!r}: calling {attr_path}() on the meta device failed: {type(e).__name__}: {e}"
        ) from e
    if isinstance(probe, ZooEntry):
        return probe
    if not isinstance(probe, nn.Module):
        raise AutoparError(
            f"model {spec!r}: {attr_path}() returned {type(probe).__name__}; "
            "expected an nn.Module or a ZooEntry"
        )

    def missing_inputs(batch: int, seq: int, device: torch.device) -> tuple:
        raise AutoparError(
            f"model {spec!r} has no example inputs: define example_inputs(batch, seq, device) -> tuple "
            f"in module {module_name!r}, or make {attr_path}() return a ZooEntry"
        )

    num_params = sum(p.numel() for p in probe.parameters())
    return ZooEntry(
        name=spec,
        description=f"user model {spec} ({type(probe).__name__}, {num_params:,} parameters)",
        build=factory,
        example_inputs=getattr(module, "example_inputs", missing_inputs),
        example_kwargs=getattr(module, "example_kwargs", _no_kwargs),
        default_batch=int(getattr(module, "DEFAULT_BATCH", 8)),
        default_seq=int(getattr(module, "DEFAULT_SEQ", 32)),
        num_params=num_params,
    )

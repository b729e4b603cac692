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
* Hugging Face architectures, each at a tiny size (``NAME-tiny``: tests and CPU runs) and at a
  published size (planning on ``meta``): GPT-2 (``gpt2-125m``), Llama-2 (``llama-7b``,
  ``llama-70b``), BERT (``bert-base``), OPT (``opt-1.3b``), BLOOM (``bloom-560m``), Falcon
  (``falcon-7b``), GPT-J (``gpt-j-6b``), GPT-NeoX (``gpt-neox-tiny``, ``pythia-1.4b``), Mistral
  (``mistral-7b``), Qwen2 (``qwen2-1.5b``), Gemma (``gemma-2b``), Phi (``phi-2``), Mixtral
  (``mixtral-8x7b``), RoBERTa (``roberta-base``), T5 (``t5-base``), ViT (``vit-base``; its
  ``seq`` is the image side).

``get_model`` also accepts ``"pkg.module:factory"`` for user models (see :func:`get_model`).

Hugging Face models are exactly what a user's ``AutoModel....from_config(config)`` builds:
default attention implementation, tied embeddings where the config ties them, key/value cache on
by default (the example inputs pass ``use_cache=False``, as training does), random weights
(nothing is ever downloaded). The configs set sizes and dropout 0 (the models still call
``dropout(x, 0.0, True)``, which capture drops), nothing else. With ``labels`` they return a ``ModelOutput``; an
exported program's outputs are then ``(loss, logits)``.
"""

from __future__ import annotations

import difflib
import importlib
import types
from dataclasses import dataclass
from typing import Any, Callable, TypeAlias

import torch
import torch.nn as nn

from autopar.core.errors import AutoparError
from autopar.models.gpt import GPT, GPTConfig

__all__ = ["ZooEntry", "get_model", "list_models"]

DeviceLike: TypeAlias = "torch.device | str"


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


@dataclass(frozen=True)
class HFFamily:
    """A Hugging Face architecture: the auto class ``from_config`` builds it with, its config
    class, and the inputs its training forward takes (``causal``: token ids and labels;
    ``masked``: masked-LM labels; ``seq2seq``: labels the decoder shifts itself; ``image``:
    pixels and class labels). ``no_dropout``: the config's dropout fields, set to 0."""

    arch: str
    auto: str
    config: str
    inputs: str
    no_dropout: tuple[str, ...] = ()


def _import_transformers() -> types.ModuleType:
    try:
        import transformers
    except ImportError as e:  # pragma: no cover - transformers is a test dependency
        raise AutoparError(
            "this zoo model needs Hugging Face transformers: pip install 'transformers>=5.23,<6'"
        ) from e
    return transformers


def _hf_build(family: HFFamily, config_kwargs: dict[str, Any]) -> Callable[[], nn.Module]:
    """``AutoModel...from_config(Config(**config_kwargs))``: exactly what a user writes, with
    random weights (nothing is downloaded) and dropout 0."""

    def build() -> nn.Module:
        transformers = _import_transformers()
        config = getattr(transformers, family.config)(**{k: 0.0 for k in family.no_dropout}, **config_kwargs)
        return getattr(transformers, family.auto).from_config(config)

    return build


def _hf_example(family: HFFamily, vocab: int, image: tuple[int, int] | None) -> tuple[Callable, Callable]:
    """(example_inputs, example_kwargs) of a family's training forward. Labels are separate
    tensors: torch.export wires graph inputs that alias to the same placeholder."""
    if family.inputs == "image":
        side, classes = image

        def pixels(batch: int, seq: int, device: torch.device) -> tuple:
            if seq != side:
                raise AutoparError(f"{family.arch} takes {side}x{side} images: pass seq={side} (the image side)")
            if device.type == "meta":
                return (torch.empty(batch, 3, side, side, device=device),)
            return (torch.randn(batch, 3, side, side, generator=torch.Generator().manual_seed(0)).to(device),)

        def classes_of(batch: int, seq: int, device: torch.device) -> dict:
            return {"labels": _random_tokens(1, batch, classes, device).view(batch)}

        return pixels, classes_of

    def tokens(batch: int, seq: int, device: torch.device) -> tuple:
        return (_random_tokens(batch, seq, vocab, device),)

    def labels(batch: int, seq: int, device: torch.device) -> dict:
        # Causal LMs shift their labels themselves, so labels == input_ids (as a separate tensor);
        # training wants no key/value cache, which from_config's models return by default.
        kwargs = {"labels": _random_tokens(batch, seq, vocab, device, seed=int(family.inputs == "seq2seq")).clone()}
        return kwargs | ({"use_cache": False} if family.inputs in ("causal", "seq2seq") else {})

    return tokens, labels


_CAUSAL_DROPOUT = ("attention_dropout", "hidden_dropout")
GPT2 = HFFamily("GPT-2", "AutoModelForCausalLM", "GPT2Config", "causal", ("resid_pdrop", "embd_pdrop", "attn_pdrop"))
OPT = HFFamily("OPT", "AutoModelForCausalLM", "OPTConfig", "causal", ("dropout", "attention_dropout", "layerdrop"))
BLOOM = HFFamily("BLOOM", "AutoModelForCausalLM", "BloomConfig", "causal", _CAUSAL_DROPOUT)
FALCON = HFFamily("Falcon", "AutoModelForCausalLM", "FalconConfig", "causal", _CAUSAL_DROPOUT)
GPTJ = HFFamily("GPT-J", "AutoModelForCausalLM", "GPTJConfig", "causal", ("resid_pdrop", "embd_pdrop", "attn_pdrop"))
GPT_NEOX = HFFamily("GPT-NeoX", "AutoModelForCausalLM", "GPTNeoXConfig", "causal", ("attention_dropout", "hidden_dropout"))
LLAMA = HFFamily("Llama", "AutoModelForCausalLM", "LlamaConfig", "causal")
MISTRAL = HFFamily("Mistral", "AutoModelForCausalLM", "MistralConfig", "causal")
QWEN2 = HFFamily("Qwen2", "AutoModelForCausalLM", "Qwen2Config", "causal")
GEMMA = HFFamily("Gemma", "AutoModelForCausalLM", "GemmaConfig", "causal")
PHI = HFFamily("Phi", "AutoModelForCausalLM", "PhiConfig", "causal", ("resid_pdrop", "embd_pdrop", "attention_dropout"))
MIXTRAL = HFFamily("Mixtral (MoE)", "AutoModelForCausalLM", "MixtralConfig", "causal")
GPT_OSS = HFFamily("gpt-oss (MoE)", "AutoModelForCausalLM", "GptOssConfig", "causal")
_BERT_DROPOUT = ("hidden_dropout_prob", "attention_probs_dropout_prob")
BERT = HFFamily("BERT", "AutoModelForMaskedLM", "BertConfig", "masked", _BERT_DROPOUT)
ROBERTA = HFFamily("RoBERTa", "AutoModelForMaskedLM", "RobertaConfig", "masked", _BERT_DROPOUT)
T5 = HFFamily("T5", "AutoModelForSeq2SeqLM", "T5Config", "seq2seq", ("dropout_rate",))
VIT = HFFamily("ViT", "AutoModelForImageClassification", "ViTConfig", "image", _BERT_DROPOUT)


def _hf_entry(name: str, title: str, family: HFFamily, default_batch: int, default_seq: int, num_params: int,
              **config_kwargs: Any) -> ZooEntry:
    vocab = config_kwargs.get("vocab_size", 0)
    image = (config_kwargs["image_size"], config_kwargs["num_labels"]) if family.inputs == "image" else None
    inputs, kwargs = _hf_example(family, vocab, image)
    shape = ", ".join(f"{k}={v}" for k, v in config_kwargs.items() if not k.endswith("token_id"))
    return ZooEntry(
        name=name,
        description=f"{title} (HF {family.arch}, {family.auto}.from_config: {shape})",
        build=_hf_build(family, config_kwargs),
        example_inputs=inputs,
        example_kwargs=kwargs,
        default_batch=default_batch,
        default_seq=default_seq,
        num_params=num_params,
    )


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

# Hugging Face models: for each architecture a tiny size (tests, CPU runs) and a published size
# (planning on the meta device; shapes from the authors' configs). num_params were counted by
# building each entry on the meta device (tests/test_corpus.py checks them all).
_TINY = dict(default_batch=8, default_seq=32)
_TINY_SHAPE = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128, vocab_size=256,
                   max_position_embeddings=64)   # the tiny size of the families whose configs name it alike
_reg = _register
_reg(_hf_entry("gpt2-tiny", "Tiny GPT-2", GPT2, **_TINY, num_params=120_576, n_layer=2, n_embd=64, n_head=4,
               vocab_size=256, n_positions=64, bos_token_id=255, eos_token_id=255))
_reg(_hf_entry("gpt2-125m", "GPT-2 small 124M", GPT2, 8, 1024, 124_439_808, n_layer=12, n_embd=768, n_head=12,
               vocab_size=50257, n_positions=1024))
_reg(_hf_entry("llama-tiny", "Tiny Llama", LLAMA, **_TINY, **_TINY_SHAPE, num_params=106_816, num_key_value_heads=2))
_reg(_hf_entry("llama-7b", "Llama-2 7B", LLAMA, 8, 4096, 6_738_415_616, num_hidden_layers=32, hidden_size=4096,
               num_attention_heads=32, num_key_value_heads=32, intermediate_size=11008, vocab_size=32000,
               max_position_embeddings=4096))
_reg(_hf_entry("llama-70b", "Llama-2 70B", LLAMA, 8, 4096, 68_976_648_192, num_hidden_layers=80, hidden_size=8192,
               num_attention_heads=64, num_key_value_heads=8, intermediate_size=28672, vocab_size=32000,
               max_position_embeddings=4096))
_reg(_hf_entry("bert-tiny", "Tiny BERT", BERT, **_TINY, **_TINY_SHAPE, num_params=92_224))
_reg(_hf_entry("bert-base", "BERT-base 110M", BERT, 8, 512, 109_514_298, num_hidden_layers=12, hidden_size=768,
               num_attention_heads=12, intermediate_size=3072, vocab_size=30522, max_position_embeddings=512))
_reg(_hf_entry("opt-tiny", "Tiny OPT", OPT, **_TINY, num_params=87_680, num_hidden_layers=2, hidden_size=64, ffn_dim=128,
               num_attention_heads=4, vocab_size=256, max_position_embeddings=64, word_embed_proj_dim=64))
_reg(_hf_entry("opt-1.3b", "OPT 1.3B", OPT, 8, 2048, 1_315_758_080, num_hidden_layers=24, hidden_size=2048, ffn_dim=8192,
               num_attention_heads=32, vocab_size=50272, max_position_embeddings=2048, word_embed_proj_dim=2048))
_reg(_hf_entry("bloom-tiny", "Tiny BLOOM", BLOOM, **_TINY, num_params=116_608, n_layer=2, hidden_size=64, n_head=4,
               vocab_size=256))
_reg(_hf_entry("bloom-560m", "BLOOM 560M", BLOOM, 8, 2048, 559_214_592, n_layer=24, hidden_size=1024, n_head=16,
               vocab_size=250880))
_reg(_hf_entry("falcon-tiny", "Tiny Falcon", FALCON, **_TINY, num_params=102_784, num_hidden_layers=2, hidden_size=64,
               num_attention_heads=4, vocab_size=256))
_reg(_hf_entry("falcon-7b", "Falcon 7B", FALCON, 8, 2048, 6_921_720_704, num_hidden_layers=32, hidden_size=4544,
               num_attention_heads=71, vocab_size=65024))
_reg(_hf_entry("gptj-tiny", "Tiny GPT-J", GPTJ, **_TINY, num_params=132_352, n_layer=2, n_embd=64, n_head=4, rotary_dim=8,
               vocab_size=256, n_positions=64, bos_token_id=255, eos_token_id=255))
_reg(_hf_entry("gpt-j-6b", "GPT-J 6B", GPTJ, 8, 2048, 6_050_882_784, n_layer=28, n_embd=4096, n_head=16, rotary_dim=64,
               vocab_size=50400, n_positions=2048))
_reg(_hf_entry("gpt-neox-tiny", "Tiny GPT-NeoX", GPT_NEOX, **_TINY, **_TINY_SHAPE, num_params=99_840))
_reg(_hf_entry("pythia-1.4b", "Pythia 1.4B", GPT_NEOX, 8, 2048, 1_414_647_808, num_hidden_layers=24, hidden_size=2048,
               num_attention_heads=16, intermediate_size=8192, vocab_size=50304, max_position_embeddings=2048))
_reg(_hf_entry("mistral-tiny", "Tiny Mistral", MISTRAL, **_TINY, **_TINY_SHAPE, num_params=106_816, num_key_value_heads=2))
_reg(_hf_entry("mistral-7b", "Mistral 7B", MISTRAL, 8, 4096, 7_241_732_096, num_hidden_layers=32, hidden_size=4096,
               num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336, vocab_size=32000,
               max_position_embeddings=32768, sliding_window=4096))
_reg(_hf_entry("qwen2-tiny", "Tiny Qwen2", QWEN2, **_TINY, **_TINY_SHAPE, num_params=107_072, num_key_value_heads=2))
_reg(_hf_entry("qwen2-1.5b", "Qwen2 1.5B", QWEN2, 8, 4096, 1_543_714_304, num_hidden_layers=28, hidden_size=1536,
               num_attention_heads=12, num_key_value_heads=2, intermediate_size=8960, vocab_size=151936,
               max_position_embeddings=32768, tie_word_embeddings=True))
_reg(_hf_entry("gemma-tiny", "Tiny Gemma", GEMMA, **_TINY, **_TINY_SHAPE, num_params=86_336, num_key_value_heads=1,
               head_dim=16))
_reg(_hf_entry("gemma-2b", "Gemma 2B", GEMMA, 8, 4096, 2_506_172_416, num_hidden_layers=18, hidden_size=2048,
               num_attention_heads=8, num_key_value_heads=1, head_dim=256, intermediate_size=16384,
               vocab_size=256000, max_position_embeddings=8192))
_reg(_hf_entry("phi-tiny", "Tiny Phi", PHI, **_TINY, **_TINY_SHAPE, num_params=99_840))
_reg(_hf_entry("phi-2", "Phi-2 2.7B", PHI, 8, 2048, 2_779_683_840, num_hidden_layers=32, hidden_size=2560,
               num_attention_heads=32, intermediate_size=10240, vocab_size=51200, max_position_embeddings=2048,
               partial_rotary_factor=0.4))
_reg(_hf_entry("mixtral-tiny", "Tiny Mixtral", MIXTRAL, **_TINY, **_TINY_SHAPE, num_params=254_784, num_key_value_heads=2,
               num_local_experts=4, num_experts_per_tok=2))
_reg(_hf_entry("mixtral-8x7b", "Mixtral 8x7B", MIXTRAL, 8, 4096, 46_702_792_704, num_hidden_layers=32, hidden_size=4096,
               num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336, vocab_size=32000,
               max_position_embeddings=32768, num_local_experts=8, num_experts_per_tok=2))
_reg(_hf_entry("gpt-oss-tiny", "Tiny gpt-oss", GPT_OSS, **_TINY, num_params=108_752, num_hidden_layers=2, hidden_size=64,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=32, vocab_size=256,
               num_local_experts=4, num_experts_per_tok=2, sliding_window=8))
_reg(_hf_entry("gpt-oss-120b", "gpt-oss-120b", GPT_OSS, 8, 4096, 116_829_156_672))   # transformers' defaults
_reg(_hf_entry("roberta-tiny", "Tiny RoBERTa", ROBERTA, **_TINY, num_params=92_352, num_hidden_layers=2, hidden_size=64,
               num_attention_heads=4, intermediate_size=128, vocab_size=256, max_position_embeddings=66))
_reg(_hf_entry("roberta-base", "RoBERTa-base 125M", ROBERTA, 8, 512, 124_697_433, num_hidden_layers=12, hidden_size=768,
               num_attention_heads=12, intermediate_size=3072, vocab_size=50265, max_position_embeddings=514,
               type_vocab_size=1))
_reg(_hf_entry("t5-tiny", "Tiny T5", T5, **_TINY, num_params=181_248, num_layers=2, d_model=64, d_ff=128, num_heads=4, d_kv=16,
               vocab_size=256, decoder_start_token_id=0))
_reg(_hf_entry("t5-base", "T5-base 220M", T5, 8, 512, 222_903_552, num_layers=12, d_model=768, d_ff=3072, num_heads=12, d_kv=64,
               vocab_size=32128, decoder_start_token_id=0))
_reg(_hf_entry("vit-tiny", "Tiny ViT", VIT, 8, 32, 81_226, num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
               intermediate_size=128, image_size=32, patch_size=8, num_labels=10))
_reg(_hf_entry("vit-base", "ViT-base/16 86M", VIT, 8, 224, 86_567_656, num_hidden_layers=12, hidden_size=768,
               num_attention_heads=12, intermediate_size=3072, image_size=224, patch_size=16, num_labels=1000))


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

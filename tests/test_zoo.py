"""Tests of the model zoo (autopar.models.zoo) and the hand-written GPT (autopar.models.gpt)."""

from __future__ import annotations

import operator
import sys
import textwrap
import time

import pytest
import torch
import torch.nn as nn

from autopar.core.capture import capture
from autopar.core.errors import AutoparError
from autopar.models import GPT, GPTConfig
from autopar.models.zoo import ZooEntry, get_model, list_models

TINY = ["gpt-tiny", "gpt2-tiny", "llama-tiny", "bert-tiny"]
HF_TINY = ["gpt2-tiny", "llama-tiny", "bert-tiny"]

EXPECTED_NAMES = [
    "gpt-tiny", "gpt-125m", "gpt-1.3b", "gpt-13b", "gpt-175b",
    "gpt2-tiny", "gpt2-125m", "llama-tiny", "llama-7b", "llama-70b", "bert-tiny", "bert-base",
    "opt-tiny", "opt-1.3b", "bloom-tiny", "bloom-560m", "falcon-tiny", "falcon-7b", "gptj-tiny", "gpt-j-6b",
    "gpt-neox-tiny", "pythia-1.4b", "mistral-tiny", "mistral-7b", "qwen2-tiny", "qwen2-1.5b",
    "gemma-tiny", "gemma-2b", "phi-tiny", "phi-2", "mixtral-tiny", "mixtral-8x7b", "gpt-oss-tiny", "gpt-oss-120b",
    "roberta-tiny", "roberta-base", "t5-tiny", "t5-base", "vit-tiny", "vit-base",
]


def _loss(out) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out.loss


def _logits(out) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out.logits


def _other_batch(entry: ZooEntry, batch: int, seq: int) -> tuple[tuple, dict]:
    """Inputs with other values than entry.example(), and labels that differ from input_ids."""
    vocab = 256
    g = torch.Generator().manual_seed(123)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    labels = torch.randint(0, vocab, (batch, seq), generator=g)
    if kwargs := entry.example_kwargs(batch, seq, torch.device("cpu")):
        return (ids,), kwargs | {"labels": labels}
    return (ids, labels), {}


def test_registry_names():
    assert list_models() == EXPECTED_NAMES
    for name in EXPECTED_NAMES:
        entry = get_model(name)
        assert entry.name == name
        assert entry.description and entry.default_batch > 0 and entry.default_seq > 0
        assert entry.num_params and entry.num_params > 0


def test_example_inputs_deterministic_and_not_aliased():
    entry = get_model("gpt2-tiny")
    (ids,), kwargs = entry.example()
    (ids2,), kwargs2 = entry.example()
    assert ids.shape == (entry.default_batch, entry.default_seq) and ids.dtype == torch.long
    assert torch.equal(ids, ids2) and torch.equal(kwargs["labels"], kwargs2["labels"])
    # torch.export mis-wires graph inputs that share storage, so labels must be a separate tensor.
    assert kwargs["labels"].untyped_storage().data_ptr() != ids.untyped_storage().data_ptr()

    idx, targets = get_model("gpt-tiny").example(batch=2, seq=5)[0]
    assert idx.shape == targets.shape == (2, 5)
    assert idx.untyped_storage().data_ptr() != targets.untyped_storage().data_ptr()


@pytest.mark.parametrize("name", TINY)
def test_tiny_model_train_step_and_export(name):
    entry = get_model(name)
    torch.manual_seed(0)
    model = entry.build()
    assert model.training
    assert sum(p.numel() for p in model.parameters()) == entry.num_params
    args, kwargs = entry.example()

    # forward + backward
    loss = _loss(model(*args, **kwargs))
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None, pname
    model.zero_grad(set_to_none=True)

    # capture (non-strict export, training mode, with labels/targets): loss equals eager
    ep = capture(model, args, kwargs).program
    exported = ep.module()
    torch.testing.assert_close(_loss(exported(*args, **kwargs)), _loss(model(*args, **kwargs)))
    # ... also on other values (catches graph inputs wired to the wrong placeholder)
    args2, kwargs2 = _other_batch(entry, entry.default_batch, entry.default_seq)
    torch.testing.assert_close(_loss(exported(*args2, **kwargs2)), _loss(model(*args2, **kwargs2)))

    # The graphs are plain ATen: no higher-order ops (torch.no_grad regions are inlined).
    for node in ep.graph.nodes:
        if node.op == "call_function":
            assert isinstance(node.target, torch._ops.OpOverload) or node.target is operator.getitem, node.target


@pytest.mark.parametrize("name", HF_TINY)
def test_hf_tiny_export_logits(name):
    entry = get_model(name)
    torch.manual_seed(0)
    model = entry.build()
    args, kwargs = entry.example(batch=2, seq=16)
    kwargs.pop("labels")
    ep = torch.export.export(model, args, kwargs, strict=False)
    out = _logits(ep.module()(*args, **kwargs))
    assert out.shape == (2, 16, 256)
    torch.testing.assert_close(out, _logits(model(*args, **kwargs)))


@pytest.mark.parametrize("name", HF_TINY)
def test_hf_models_are_what_from_config_builds(name):
    """No zoo workaround: default attention, embeddings tied as the config says, cache on by default."""
    model = get_model(name).build()
    config = model.config
    assert config._attn_implementation == "sdpa" and config.use_cache is True
    tied = model.get_input_embeddings().weight is model.get_output_embeddings().weight
    assert tied == config.tie_word_embeddings == (name != "llama-tiny")   # Llama's config unties them
    assert type(model).__module__.startswith("transformers.models.")


def test_gpt_deterministic_init_and_names():
    cfg = GPTConfig()
    torch.manual_seed(0)
    a = GPT(cfg)
    torch.manual_seed(0)
    b = GPT(cfg)
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert na == nb and torch.equal(pa, pb)
    names = dict(a.named_parameters())
    for n in [
        "transformer.wte.weight", "transformer.wpe.weight", "transformer.h.0.ln_1.weight",
        "transformer.h.0.attn.c_attn.weight", "transformer.h.0.attn.c_proj.weight",
        "transformer.h.0.ln_2.weight", "transformer.h.0.mlp.c_fc.weight",
        "transformer.h.0.mlp.c_proj.weight", "transformer.ln_f.weight", "lm_head.weight",
    ]:
        assert n in names, n
    assert a.lm_head.weight is not a.transformer.wte.weight  # not weight-tied
    assert cfg.num_params() == a.num_params()
    idx = torch.zeros(2, 7, dtype=torch.long)
    assert a(idx).shape == (2, 7, cfg.vocab_size)


def test_gpt_tiny_exports_on_meta():
    entry = get_model("gpt-tiny")
    with torch.device("meta"):
        model = entry.build()
    args, kwargs = entry.example(device="meta")
    ep = torch.export.export(model, args, kwargs, strict=False)
    assert ep.module()(*args).is_meta


def test_big_model_on_meta_exports_quickly():
    entry = get_model("gpt-1.3b")
    start = time.perf_counter()
    with torch.device("meta"):
        model = entry.build()
    assert all(p.is_meta for p in model.parameters())
    assert all(b.is_meta for b in model.buffers())
    assert sum(p.numel() for p in model.parameters()) == entry.num_params > 1_000_000_000
    args, kwargs = entry.example(device="meta")
    assert args[0].shape == (8, 2048) and args[0].is_meta
    ep = torch.export.export(model, args, kwargs, strict=False)
    elapsed = time.perf_counter() - start
    sdpa = [n for n in ep.graph.nodes if n.target is torch.ops.aten.scaled_dot_product_attention.default]
    assert len(sdpa) == 24
    assert elapsed < 60, f"meta build + export of gpt-1.3b took {elapsed:.1f}s"


def test_hf_big_model_builds_on_meta():
    entry = get_model("llama-70b")
    with torch.device("meta"):
        model = entry.build()
    assert all(p.is_meta for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == entry.num_params


def test_unknown_model_lists_names():
    with pytest.raises(AutoparError) as info:
        get_model("gpt-tinny")
    msg = str(info.value)
    for name in EXPECTED_NAMES:
        assert name in msg
    assert "'gpt-tiny'" in msg  # close-match suggestion


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    modname = "autopar_test_user_models"
    (tmp_path / f"{modname}.py").write_text(textwrap.dedent(
        """
        import torch
        import torch.nn as nn
        from autopar.models.zoo import ZooEntry

        DEFAULT_SEQ = 6
        CALLS = []

        class MLP(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(4, 3)

            def forward(self, x):
                return self.fc(x).sum()

        def factory():
            CALLS.append(torch.get_default_device().type)
            return MLP()

        def example_inputs(batch, seq, device):
            return (torch.ones(batch, seq, 4, device=device),)

        def entry_factory():
            return ZooEntry(
                name="my-mlp", description="my MLP", build=MLP,
                example_inputs=example_inputs, example_kwargs=lambda b, s, d: {},
                default_batch=2, default_seq=3,
            )

        class Namespace:
            ENTRY = entry_factory()

        NOT_A_MODEL = 42

        def returns_junk():
            return "junk"
        """
    ))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield modname
    sys.modules.pop(modname, None)


def test_get_model_from_factory(user_module):
    entry = get_model(f"{user_module}:factory")
    mod = sys.modules[user_module]
    assert mod.CALLS == ["meta"]  # probed on meta only
    assert entry.name == f"{user_module}:factory"
    assert entry.num_params == 4 * 3 + 3
    assert (entry.default_batch, entry.default_seq) == (8, 6)
    model = entry.build()
    assert isinstance(model, nn.Module) and not next(model.parameters()).is_meta
    args, kwargs = entry.example(batch=2)
    assert args[0].shape == (2, 6, 4) and kwargs == {}
    assert model(*args, **kwargs).dim() == 0


def test_get_model_from_zoo_entry_factory(user_module):
    entry = get_model(f"{user_module}:entry_factory")
    assert entry.name == "my-mlp" and entry.default_seq == 3
    assert get_model(f"{user_module}:Namespace.ENTRY").name == "my-mlp"


@pytest.mark.parametrize(
    "spec",
    ["autopar_no_such_module_xyz:factory", "{mod}:missing", "{mod}:NOT_A_MODEL", "{mod}:returns_junk", ":x"],
)
def test_get_model_bad_factory(user_module, spec):
    with pytest.raises(AutoparError):
        get_model(spec.format(mod=user_module))

"""Four-block versions of test models, as their authors build them (sizes and dropout 0 set,
nothing else), for pipelines of four stages (two per rank): autopar's GPT, Hugging Face GPT-2
(tied embeddings), Llama and OPT (tied embeddings, learned positions, ReLU). Zoo names
``tests.pipeline_models:gpt``, ``...:gpt2``, ``...:llama``, ``...:opt``."""
from __future__ import annotations

from dataclasses import replace

import transformers

from autopar.models.gpt import GPT, GPTConfig
from autopar.models.zoo import ZooEntry, get_model

LAYERS = 4


def gpt() -> ZooEntry:
    return replace(get_model("gpt-tiny"), name=f"{__name__}:gpt", build=lambda: GPT(GPTConfig(n_layer=LAYERS)))


def gpt2() -> ZooEntry:
    def build():
        config = transformers.GPT2Config(n_layer=LAYERS, n_embd=64, n_head=4, vocab_size=256, n_positions=64,
                                         bos_token_id=255, eos_token_id=255, resid_pdrop=0.0, embd_pdrop=0.0,
                                         attn_pdrop=0.0)
        return transformers.AutoModelForCausalLM.from_config(config)
    return replace(get_model("gpt2-tiny"), name=f"{__name__}:gpt2", build=build)


def llama() -> ZooEntry:
    def build():
        config = transformers.LlamaConfig(num_hidden_layers=LAYERS, hidden_size=64, num_attention_heads=4,
                                          num_key_value_heads=2, intermediate_size=128, vocab_size=256,
                                          max_position_embeddings=64)
        return transformers.AutoModelForCausalLM.from_config(config)
    return replace(get_model("llama-tiny"), name=f"{__name__}:llama", build=build)


def opt() -> ZooEntry:
    def build():
        config = transformers.OPTConfig(num_hidden_layers=LAYERS, hidden_size=64, num_attention_heads=4, ffn_dim=128,
                                        vocab_size=256, max_position_embeddings=64, word_embed_proj_dim=64,
                                        dropout=0.0)
        return transformers.AutoModelForCausalLM.from_config(config)
    return replace(get_model("opt-tiny"), name=f"{__name__}:opt", build=build)

"""Tiny random configs of Hugging Face causal-LM families (no downloads), for init tests.

``tiny_config(family)`` returns a fresh config each call: ``from_config`` writes the dtype
into the config it is given, so two models must not share one.
"""

from __future__ import annotations

from transformers import AutoConfig

_LLAMA_LIKE = dict(
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=97,
    max_position_embeddings=64,
    pad_token_id=3,
)

FAMILIES: dict[str, dict] = {
    "llama": dict(_LLAMA_LIKE),
    "llama_tied": dict(_LLAMA_LIKE, tie_word_embeddings=True),
    "mistral": dict(_LLAMA_LIKE),
    "qwen2": dict(_LLAMA_LIKE),
    "qwen3": dict(_LLAMA_LIKE, head_dim=8),
    "gemma": dict(_LLAMA_LIKE, head_dim=8),
    "stablelm": dict(_LLAMA_LIKE),
    "phi": dict(_LLAMA_LIKE),
    "mixtral": dict(_LLAMA_LIKE, num_local_experts=4, num_experts_per_tok=2),
    "gpt_neox": dict(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, vocab_size=97,
        max_position_embeddings=64,
    ),
    "gpt2": dict(n_embd=32, n_layer=2, n_head=4, vocab_size=97, n_positions=64, bos_token_id=1, eos_token_id=2),
    "gpt_bigcode": dict(
        n_embd=32, n_layer=2, n_head=4, vocab_size=97, n_positions=64, bos_token_id=1, eos_token_id=2
    ),
    "opt": dict(
        hidden_size=32, ffn_dim=48, num_hidden_layers=2, num_attention_heads=4, vocab_size=97,
        max_position_embeddings=64, word_embed_proj_dim=32, pad_token_id=1,
    ),
    "falcon": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, vocab_size=97),
    # trunc_normal_ init: a rejection sampler whose draws depend on the values drawn
    "modernbert-decoder": dict(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, vocab_size=97,
        max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2,
    ),
    # orthogonal_ init (torch skips it on meta tensors) and literals made on the weights' device
    "rwkv": dict(
        hidden_size=32, attention_hidden_size=32, intermediate_size=48, num_hidden_layers=2, vocab_size=97,
        context_length=64,
    ),
}


def model_type(family: str) -> str:
    return family.removesuffix("_tied")


def tiny_config(family: str, **overrides):
    return AutoConfig.for_model(model_type(family), **{**FAMILIES[family], **overrides})

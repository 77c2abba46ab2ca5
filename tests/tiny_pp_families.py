"""Tiny random-init causal LMs of many families for the pipeline parity tests.

Four blocks (pp = 2 with two virtual stages still gets a block per chunk, and interleaving puts
blocks 0 and 2 on rank 0, so per-layer-type masks are looked up by global index), hidden 32,
the vocabulary of :mod:`tests.tiny_pp`'s micro-batches. Each family sets what makes it
different to a value that shows when it is lost: Granite's four multipliers away from 1,
Gemma 2's soft-capping low enough to bend the logits, sliding windows shorter than the
sequence, partial rotary for Phi and StableLM. Dropout is off and zero-initialized params are
randomized, so every gradient is generic.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from tests.tiny import _randomize_zero_init
from tests.tiny_pp import VOCAB, micro_batches

STEPS, M, LR = 3, 2, 0.5  # SGD steps of M micro-batches each, for the parity runs

_DENSE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
_WINDOW = 4  # < the 8 tokens of a micro-batch, > its 3 padded ones (no query without a key)

_MLA = dict(num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
            v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, moe_intermediate_size=16,
            n_shared_experts=1)

# spec -> (config overrides, attention implementation); a spec is a model type or one of VARIANTS
SPECS: dict[str, tuple[dict, str]] = {
    "gemma": (dict(head_dim=8), "sdpa"),  # sqrt(hidden) normalizer inside the embedding
    "gemma2": (dict(head_dim=8, final_logit_softcapping=0.5, attn_logit_softcapping=2.0, sliding_window=_WINDOW,
                    query_pre_attn_scalar=8), "eager"),  # soft-capping is eager-only in HF
    "gemma3_text": (dict(head_dim=8, sliding_window=_WINDOW, layer_types=["sliding_attention", "full_attention"] * 2,
                         final_logit_softcapping=0.5), "sdpa"),
    "phi": (dict(partial_rotary_factor=0.5, resid_pdrop=0.0, embd_pdrop=0.0), "sdpa"),  # parallel block
    "mistral": (dict(sliding_window=_WINDOW), "sdpa"),
    "qwen3": (dict(head_dim=8), "sdpa"),
    "olmo2": (dict(), "sdpa"),
    "granite": (dict(embedding_multiplier=3.0, logits_scaling=2.5, residual_multiplier=0.5,
                     attention_multiplier=0.2), "sdpa"),
    "cohere": (dict(logit_scale=0.5, use_qk_norm=True), "sdpa"),  # tied head, parallel block
    "cohere2": (dict(logit_scale=0.5, sliding_window=_WINDOW,
                     layer_types=["sliding_attention", "full_attention"] * 2), "sdpa"),
    "stablelm": (dict(partial_rotary_factor=0.5), "sdpa"),  # declared plan: its config has none
    "phi3": (dict(pad_token_id=0, sliding_window=_WINDOW), "sdpa"),
    "starcoder2": (dict(sliding_window=_WINDOW, residual_dropout=0.0, embedding_dropout=0.0), "sdpa"),
    "mixtral": (dict(num_local_experts=4, num_experts_per_tok=2), "sdpa"),
    # the router's load-balancing loss added to the token loss
    "mixtral_aux": (dict(num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
                         router_aux_loss_coef=0.3), "sdpa"),
    "qwen2_moe": (dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                       shared_expert_intermediate_size=24, decoder_sparse_step=1), "sdpa"),
    "qwen3_moe": (dict(head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                       decoder_sparse_step=1), "sdpa"),
    # multi-head latent attention (q and kv compressed to a rank, a rotary slice shared by every
    # head) with routed and shared experts after a dense first layer. DeepSeek V3's plan splits
    # only the MLPs; DeepSeek V2's also the attention, through kv_a_proj_with_mqa's 'mla_kv_a_proj'.
    "deepseek_v3": (dict(_MLA, first_k_dense_replace=1), "eager"),
    "deepseek_v2": (dict(_MLA, first_k_dense_replace=1), "eager"),
    # families whose configs carry no plans: zero3d's records (models/families.py)
    "falcon": (dict(num_kv_heads=4, multi_query=False, new_decoder_architecture=False, parallel_attn=True,
                    ffn_hidden_size=48), "sdpa"),  # classic layout [heads, (q, k, v), head_dim]
    "falcon_mqa": (dict(multi_query=True, new_decoder_architecture=False, parallel_attn=True,
                        ffn_hidden_size=48), "eager"),  # [query heads | k | v]: gathered
    "falcon_new": (dict(num_kv_heads=2, new_decoder_architecture=True, ffn_hidden_size=48), "sdpa"),  # kv groups
    "falcon_alibi": (dict(num_kv_heads=4, multi_query=False, alibi=True, parallel_attn=False,
                          ffn_hidden_size=48), "eager"),
    # num_key_value_heads as the config derives it from multi_query (a keyword would override it)
    "gpt_bigcode": (dict(n_inner=48, multi_query=True, num_key_value_heads=1), "sdpa"),
    "gpt_bigcode_mha": (dict(n_inner=48, multi_query=False, num_key_value_heads=4), "eager"),
    "opt": (dict(ffn_dim=48, word_embed_proj_dim=16, enable_bias=True), "sdpa"),  # project_in / project_out
    "bloom": (dict(), "eager"),  # ALiBi, embedding LayerNorm
    "gptj": (dict(n_inner=48, rotary_dim=4), "eager"),  # parallel block
    "codegen": (dict(hidden_size=64, num_attention_heads=8, n_inner=48, rotary_dim=4), "eager"),  # 4 head groups
    "stablelm_qk": (dict(qk_layernorm=True, use_parallel_residual=True), "sdpa"),  # a LayerNorm per head
}

_MOE = {"mixtral", "mixtral_aux", "qwen2_moe", "qwen3_moe", "deepseek_v3", "deepseek_v2"}


# specs that are another layout of a family
VARIANTS = {"falcon_mqa": "falcon", "falcon_new": "falcon", "falcon_alibi": "falcon", "gpt_bigcode_mha": "gpt_bigcode",
            "stablelm_qk": "stablelm", "mixtral_aux": "mixtral"}


def model_type(kind: str) -> str:
    """The transformers model type of a spec (``falcon_mqa`` is a Falcon)."""
    return VARIANTS.get(kind, kind)


def make_family_model(kind: str, seed: int = 0, **overrides) -> torch.nn.Module:
    """A tiny causal LM of spec ``kind``; the same seed gives the same weights on every rank."""
    extra, attn = SPECS[kind]
    defaults = AutoConfig.for_model(model_type(kind))  # sizes it does not know would become stray attributes
    dense = {k: v for k, v in _DENSE.items() if hasattr(defaults, k)}
    config = AutoConfig.for_model(model_type(kind), **{**dense, **extra, **overrides})
    for key in ("attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop",
                "embedding_dropout", "residual_dropout", "dropout", "activation_dropout"):
        if hasattr(config, key):
            setattr(config, key, 0.0)
    torch.manual_seed(seed)
    # the experts' loop instead of grouped_mm, which has no float64 kernel
    experts = {"experts_implementation": "eager"} if kind in _MOE else {}
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, **experts)
    return _randomize_zero_init(model)


def sgd_train(params: Iterable[torch.nn.Parameter], step: Callable[[list[dict]], float]) -> list[float]:
    """STEPS plain-SGD steps; ``step(micro_batches)`` accumulates one step's gradients and returns
    its loss. The same micro-batches (right padding, ignored labels) for every layout."""
    opt = torch.optim.SGD(params, lr=LR)
    losses = []
    for s in range(STEPS):
        opt.zero_grad(set_to_none=True)
        losses.append(step(micro_batches(M, seed=5 + s)))
        opt.step()
    return losses

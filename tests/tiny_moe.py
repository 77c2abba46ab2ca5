"""Tiny Mixtral and Qwen3-MoE models (8 experts, top 2, router auxiliary loss on) for expert parallelism.

Random init and random tokens: each rank's tokens choose their own experts, so routing differs
by rank and by step, and some experts get no token on a rank.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from tests.tiny import VOCAB

EXPERTS = 8


def make_moe(kind: str, seed: int = 0, meta: bool = False, **overrides) -> nn.Module:
    """A tiny ``mixtral`` or ``qwen3_moe`` causal LM with its load-balancing loss in the loss (``meta``: built on
    the meta device after the same seed, so a meta start replays the eager values)."""
    torch.manual_seed(seed)
    with torch.device("meta") if meta else contextlib.nullcontext():
        return _build_moe(kind, **overrides)


def _build_moe(kind: str, **overrides) -> nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  num_experts_per_tok=2, max_position_embeddings=64, output_router_logits=True,
                  router_aux_loss_coef=0.05)
    if kind == "mixtral":
        cfg = MixtralConfig(**{**common, "intermediate_size": 32, "num_local_experts": EXPERTS, **overrides})
        return MixtralForCausalLM(cfg)
    if kind == "qwen3_moe":
        cfg = Qwen3MoeConfig(**{**common, "intermediate_size": 48, "moe_intermediate_size": 32, "num_experts": EXPERTS,
                                "head_dim": 8, **overrides})
        return Qwen3MoeForCausalLM(cfg)
    raise ValueError(f"unknown tiny MoE {kind!r}")


def make_deepseek_v3(seed: int = 0, meta: bool = False) -> nn.Module:
    """A tiny DeepSeek V3 (8 routed experts in 2 groups, top 2, one shared expert, MLA attention) whose routers
    carry ``e_score_correction_bias``; routers drawn wide enough (std 0.1) that choices are not near ties."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=EXPERTS,
                           num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1, first_k_dense_replace=0,
                           q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
                           max_position_embeddings=64, initializer_range=0.1)
    torch.manual_seed(seed)
    with torch.device("meta") if meta else contextlib.nullcontext():
        return DeepseekV3ForCausalLM(cfg)


def ep_config(stage: int, gas: int, dp: int, ep: int, **zero) -> dict:
    """tests.tiny.ds_config with ``expert_parallel`` at ``ep`` ranks (off at 1)."""
    from tests.tiny import ds_config

    config = ds_config(stage, gas, dp, **zero)
    if ep > 1:
        config["expert_parallel"] = {"enabled": True, "autoep_size": ep}
    return config

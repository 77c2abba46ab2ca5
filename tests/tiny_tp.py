"""Tiny random-init models for the tensor-parallel tests, and a tp group helper.

Shapes are chosen so that tp = 2 and 4 split every head count and intermediate size, and a
vocabulary of 127 forces vocab padding at both (128 for Qwen2 has none). Dropout is off and
zero-initialized params are randomized (as in ``tests.tiny``) so every gradient is generic.
"""

from __future__ import annotations

import torch
import transformers
from transformers import (
    ApertusConfig,
    ApertusForCausalLM,
    CohereConfig,
    CohereForCausalLM,
    GPT2Config,
    Olmo2Config,
    Olmo2ForCausalLM,
    GPT2LMHeadModel,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from tests.tiny import _randomize_zero_init

transformers.logging.set_verbosity_error()

SEQ = 8
BATCH = 2

_LLAMA_LIKE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=8,
                   num_key_value_heads=4, head_dim=4, max_position_embeddings=64, attention_dropout=0.0)


def make_tp_model(kind: str, seed: int = 0, **overrides) -> torch.nn.Module:
    """A tiny causal LM of family ``kind``; the same seed gives the same weights on every rank.

    Built under ``torch.device("meta")`` it has shapes only, and nothing is randomized: a meta
    start replays the model's own init, which equals this eager model where no parameter of
    the family starts at zero.
    """
    torch.manual_seed(seed)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**{**_LLAMA_LIKE, "vocab_size": 127, **overrides}))
    elif kind == "llama_tied":
        model = LlamaForCausalLM(LlamaConfig(**{**_LLAMA_LIKE, "vocab_size": 127, "tie_word_embeddings": True,
                                                **overrides}))
    elif kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**{**_LLAMA_LIKE, "vocab_size": 128, "tie_word_embeddings": True,
                                                **overrides}))
    elif kind == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**{**_LLAMA_LIKE, "vocab_size": 127, **overrides}))
    elif kind == "gemma2":  # final logit softcapping, tied embeddings, scaled input embeddings
        model = Gemma2ForCausalLM(Gemma2Config(**{**_LLAMA_LIKE, "vocab_size": 127, "pad_token_id": 0, **overrides}))
    elif kind == "phi3":  # fused qkv / gate_up: colwise_gather_output + rowwise_split_input plan
        cfg = {**_LLAMA_LIKE, "vocab_size": 127, "pad_token_id": 0}
        cfg.pop("head_dim")
        model = Phi3ForCausalLM(Phi3Config(**{**cfg, **overrides}))
    elif kind == "apertus":  # learnable xIELU activation scalars between up_proj and down_proj
        model = ApertusForCausalLM(ApertusConfig(**{**_LLAMA_LIKE, "vocab_size": 127, **overrides}))
    elif kind == "cohere":  # q/k LayerNorms of shape [heads, head_dim], no plan entry for them
        model = CohereForCausalLM(CohereConfig(**{**_LLAMA_LIKE, "vocab_size": 127, "use_qk_norm": True,
                                                 "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
                                                 **overrides}))
    elif kind == "olmo2":  # q/k projections gathered: its full-width q/k norms see replicated features
        model = Olmo2ForCausalLM(Olmo2Config(**{**_LLAMA_LIKE, "vocab_size": 127, "pad_token_id": 0, **overrides}))
    elif kind == "mixtral":  # experts split by moe_tp_experts; the experts' loop (grouped_mm is not in every build)
        model = MixtralForCausalLM(MixtralConfig(**{**_LLAMA_LIKE, "vocab_size": 127, "num_local_experts": 4,
                                                    "num_experts_per_tok": 2, "experts_implementation": "eager",
                                                    **overrides}))
    elif kind == "gpt_neox":
        cfg = dict(vocab_size=127, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                   max_position_embeddings=64, attention_dropout=0.0, hidden_dropout=0.0, tie_word_embeddings=False)
        model = GPTNeoXForCausalLM(GPTNeoXConfig(**{**cfg, **overrides}))
    elif kind == "gpt2":
        cfg = dict(vocab_size=127, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0,
                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = GPT2LMHeadModel(GPT2Config(**{**cfg, **overrides}))
    else:
        raise ValueError(f"unknown tiny tp model {kind!r}")
    return model if next(model.parameters()).is_meta else _randomize_zero_init(model)


def tp_batch(vocab: int, seed: int = 3) -> dict[str, torch.Tensor]:
    """Input ids, labels with ignored (-100) positions, and a right-padded attention mask."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (BATCH, SEQ), generator=g)
    labels = ids.clone()
    labels[0, 2] = -100
    labels[1, -2:] = -100
    mask = torch.ones_like(ids)
    mask[1, -2:] = 0
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def tp_group(tp: int):
    """The tp group of a (pp=1, dp=world/tp, tp) mesh; build inside each dist call."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dp = dist.get_world_size() // tp
    return init_device_mesh("cpu", (1, dp, tp), mesh_dim_names=("pp", "dp", "tp"))["tp"].get_group()

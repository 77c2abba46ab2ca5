"""Tiny random-init causal LMs for the pipeline tests, with their micro-batches.

Eight blocks, so pp = 4 with two virtual stages still has a block per chunk. Llama and GPT-NeoX
have separate heads; Qwen2 (``tie_word_embeddings``) and GPT-2 tie the head to the embedding,
which crosses pp ranks 0 and P-1. Dropout is off and zero-initialized params are randomized
(as in ``tests.tiny``), so every gradient is generic.
"""

from __future__ import annotations

import torch
import transformers
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from tests.tiny import _randomize_zero_init

transformers.logging.set_verbosity_error()

VOCAB = 96
LAYERS = 8
SEQ = 8
MICRO = 2
FAMILIES = ("llama", "qwen2", "gpt_neox", "gpt2")

_LLAMA_LIKE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, attention_dropout=0.0)


def make_pp_model(kind: str, seed: int = 0, attn: str = "sdpa", **overrides) -> torch.nn.Module:
    """A tiny causal LM of family ``kind``; the same seed gives the same weights on every rank."""
    torch.manual_seed(seed)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**{**_LLAMA_LIKE, **overrides}))
    elif kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**{**_LLAMA_LIKE, "tie_word_embeddings": True, **overrides}))
    elif kind == "gpt_neox":
        cfg = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                   num_attention_heads=4, max_position_embeddings=64, attention_dropout=0.0, hidden_dropout=0.0,
                   tie_word_embeddings=False)
        model = GPTNeoXForCausalLM(GPTNeoXConfig(**{**cfg, **overrides}))
    elif kind == "gpt2":
        cfg = dict(vocab_size=VOCAB, n_embd=32, n_layer=LAYERS, n_head=4, n_positions=64, bos_token_id=0,
                   eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = GPT2LMHeadModel(GPT2Config(**{**cfg, **overrides}))
    else:
        raise ValueError(f"unknown tiny pp model {kind!r}")
    model.config._attn_implementation = attn
    return _randomize_zero_init(model)


def micro_batches(m: int, seed: int = 5, padded: bool = True) -> list[dict[str, torch.Tensor]]:
    """``m`` micro-batches of [MICRO, SEQ]; with ``padded`` some carry ignored labels (-100)
    and a right-padded attention mask, so token counts differ between micro-batches."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(m):
        ids = torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)
        mb = {"input_ids": ids, "labels": ids.clone()}
        if padded and i % 2 == 1:
            mask = torch.ones_like(ids)
            mask[1, -3:] = 0
            mb["labels"][1, -3:] = -100
            mb["labels"][0, 1] = -100
            mb["attention_mask"] = mask
        out.append(mb)
    return out


def oracle(model: torch.nn.Module, batches: list[dict]) -> tuple[float, dict[str, torch.Tensor]]:
    """Single process: mean micro-batch loss and the gradient of it, by HF parameter name
    (every alias of a tied tensor listed)."""
    model.zero_grad(set_to_none=True)
    loss = accumulate(model, batches)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
    model.zero_grad(set_to_none=True)
    return loss, grads


def accumulate(model: torch.nn.Module, batches: list[dict]) -> float:
    """Backward of the mean micro-batch loss (into ``.grad``); returns that mean."""
    total = 0.0
    for mb in batches:
        loss = model(**mb).loss
        (loss / len(batches)).backward()
        total += loss.item()
    return total / len(batches)


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def pp_group(pp: int):
    """The pp group of a (pp, world / pp, 1) mesh over the harness's default group."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dp = dist.get_world_size() // pp
    return init_device_mesh("cpu", (pp, dp, 1), mesh_dim_names=("pp", "dp", "tp"))["pp"].get_group()

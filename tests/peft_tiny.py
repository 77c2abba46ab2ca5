"""Tiny PEFT (LoRA) models for the fine-tuning tests: the tiny Llama of ``tests.tiny`` with
adapters around attention and MLP projections, adapters initialized at random on both sides
(``init_lora_weights=False``) so that every trained parameter is generic from the first step."""

from __future__ import annotations

import torch

from tests.tiny import make_model

TARGETS = ("q_proj", "v_proj", "o_proj", "down_proj")


def make_peft_model(seed: int = 0, targets=TARGETS, rank: int = 4, adapter_seed: int | None = None,
                    **overrides) -> torch.nn.Module:
    """The tiny Llama (``tests.tiny.make_model``) wrapped by ``peft.get_peft_model`` with LoRA, its
    adapters drawn under ``adapter_seed`` (default ``seed + 1``)."""
    from peft import LoraConfig, get_peft_model

    base = make_model("llama", seed=seed, **overrides)
    torch.manual_seed(seed + 1 if adapter_seed is None else adapter_seed)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=list(targets),
                        init_lora_weights=False)
    return get_peft_model(base, config)


def frozen_values(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Copies of the model's untrained parameters by name."""
    return {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}


def hf_name(peft_name: str) -> str:
    """A ``PeftModel`` parameter's name inside its HF model (the engine's names)."""
    return peft_name.removeprefix("base_model.model.")

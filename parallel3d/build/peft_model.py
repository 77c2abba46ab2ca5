"""PEFT models (``peft.PeftModel``) as ``initialize`` takes them.

A ``PeftModel`` wraps a ``LoraModel`` that wraps the Hugging Face causal LM, whose projections
``peft`` has replaced in place by LoRA layers (the base layer plus its adapters). The parallel
steps (tensor parallel plans, pipeline anatomy, stage-3 fetch units) all read the HF model's
own structure, so the engine trains the inner HF model (``get_base_model()``, adapters inside)
and the user's ``PeftModel`` stays a view of the same modules. Parameter names in checkpoints
and ``engine.full_parameters()`` are the HF model's (``model.layers.0.self_attn.q_proj.lora_A.
default.weight``), which ``peft`` maps to its adapter files' keys (parallel3d/export/adapter.py).

Only adapters that ``peft`` injects into the model's modules can be trained this way; prompt
learning (prefix tuning, prompt tuning, p-tuning) changes the inputs in ``PeftModel.forward``
and is refused.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from parallel3d.errors import ConfigError


def is_peft_model(model: Any) -> bool:
    """A ``peft.PeftModel`` (recognised without importing peft)."""
    return isinstance(model, nn.Module) and hasattr(model, "peft_config") and callable(
        getattr(model, "get_base_model", None)) and type(model).__module__.startswith("peft")


def unwrap_peft(model: nn.Module) -> nn.Module:
    """The HF model inside a ``PeftModel`` (its adapters in place); any other model as it is."""
    if not is_peft_model(model):
        return model
    configs = dict(model.peft_config)
    prompt = [name for name, c in configs.items() if getattr(c, "is_prompt_learning", False)]
    if prompt:
        kind = getattr(configs[prompt[0]], "peft_type", "prompt learning")
        raise ConfigError(f"PEFT adapter {prompt[0]!r} is {getattr(kind, 'value', kind)}, a prompt-learning method that "
                          "changes the model's inputs in PeftModel.forward; zero3d trains adapters that peft injects "
                          "into the model's layers (LoRA and its kind)")
    return model.get_base_model()


def adapter_configs(model: nn.Module) -> dict[str, dict] | None:
    """The JSON form of each adapter's ``peft`` config (``adapter_config.json``'s content) of the HF
    model inside a ``PeftModel`` (``peft`` keeps them on it as ``peft_config``); None for a model
    without adapters."""
    configs = getattr(model, "peft_config", None)
    if not isinstance(configs, dict) or not any(is_adapter_module(m) for m in model.modules()):
        return None
    return {name: _json_config(config) for name, config in configs.items()}


def is_adapter_module(module: nn.Module) -> bool:
    """A module ``peft`` injected (its layers carry ``base_layer`` and adapter dicts)."""
    return isinstance(getattr(module, "base_layer", None), nn.Module) and hasattr(module, "active_adapters")


def _json_config(config: Any) -> dict:
    """``config.to_dict()`` as ``PeftConfig.save_pretrained`` writes it (sets as lists, enums as values)."""
    out = {}
    for key, value in config.to_dict().items():
        if isinstance(value, set):
            value = sorted(value)
        out[key] = getattr(value, "value", value) if type(value).__module__.startswith("peft") else value
    return out

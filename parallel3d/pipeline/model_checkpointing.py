"""What the model's own activation checkpointing (transformers' ``gradient_checkpointing_enable``)
means to a pipeline schedule that splits backward (ZB-H1's input- and weight-gradient passes).

Transformers checkpoints each layer that has ``gradient_checkpointing`` set through the function it
was given (``_gradient_checkpointing_func``, a ``functools.partial`` of ``torch.utils.checkpoint``).
The split backward calls ``torch.autograd.grad`` for the input gradient and
``torch.autograd.backward(..., inputs=params)`` for the weight gradients; torch's reentrant
checkpointing refuses both, mid-step on every stage but the first, while the first stage waits for
it. Non-reentrant checkpointing works, and like the pipeline's own (``pipeline.activation_checkpointing``)
recomputes a layer once per autograd call that needs it: its weight pass takes one call per layer.
"""

from __future__ import annotations

import functools

from torch import nn
from torch.utils.checkpoint import checkpoint


def hf_checkpointed(layer: nn.Module) -> bool:
    """Whether transformers checkpoints ``layer`` itself (``gradient_checkpointing_enable``)."""
    return getattr(layer, "gradient_checkpointing", False) is True and \
        getattr(layer, "_gradient_checkpointing_func", None) is not None


def reentrant_checkpointing(model: nn.Module) -> str | None:
    """The name of a module of ``model`` that transformers checkpoints with torch's reentrant
    checkpointing (``use_reentrant`` true, or not given to ``torch.utils.checkpoint.checkpoint``:
    torch's default), or None. A function that does not say is not judged."""
    for name, module in model.named_modules():
        func = module._gradient_checkpointing_func if hf_checkpointed(module) else None
        if not isinstance(func, functools.partial):
            continue
        reentrant = func.keywords.get("use_reentrant", True if func.func is checkpoint else None)
        if reentrant is not None and bool(reentrant):
            return name or type(model).__name__
    return None

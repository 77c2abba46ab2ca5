"""transformers' causal LM loss in float64 for float64 logits, for the oracles of the suite.

``ForCausalLMLoss`` casts the logits with ``.float()``: for a float64 model that is a cast
*down* to float32, so an oracle in float64 carried float32 rounding into every gradient
(1e-5 of a scalar parameter's gradient summed over many elements, more or less by CPU). The
suite compares algorithms in float64, so :func:`install` wraps the loss of ``LOSS_MAPPING``
(read by every model's ``loss_function``): float64 logits keep float64, every other dtype
goes to transformers' own function unchanged. The vocabulary-parallel loss upcasts the same
way (``parallel3d.tensor_parallel.cross_entropy``). Installed in the test process
(``conftest``) and in every rank of the test harness.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

_KEYS = ("ForCausalLM", "ForConditionalGeneration")


def _wrap(original: Any) -> Any:
    if getattr(original, "_zero3d_float64", False):
        return original

    def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int,
                       num_items_in_batch: torch.Tensor | None = None, ignore_index: int = -100,
                       shift_labels: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
        if logits.dtype != torch.float64:
            return original(logits, labels, vocab_size, num_items_in_batch=num_items_in_batch,
                            ignore_index=ignore_index, shift_labels=shift_labels, **kwargs)
        if shift_labels is None:
            shift_labels = nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        reduction = "sum" if num_items_in_batch is not None else "mean"
        loss = nn.functional.cross_entropy(logits.reshape(-1, vocab_size), shift_labels.reshape(-1).to(logits.device),
                                           ignore_index=ignore_index, reduction=reduction)
        if reduction == "sum":
            loss = loss / (num_items_in_batch.to(loss.device) if torch.is_tensor(num_items_in_batch)
                           else num_items_in_batch)
        return loss

    causal_lm_loss._zero3d_float64 = True  # type: ignore[attr-defined]
    causal_lm_loss.__wrapped__ = original  # type: ignore[attr-defined]
    return causal_lm_loss


def install() -> None:
    """Wrap the causal LM losses of transformers' ``LOSS_MAPPING`` (idempotent)."""
    from transformers.loss.loss_utils import LOSS_MAPPING

    wrapped: dict[int, object] = {}  # keys that share transformers' function share one wrapper
    for key in _KEYS:
        if key in LOSS_MAPPING:
            original = LOSS_MAPPING[key]
            LOSS_MAPPING[key] = wrapped.setdefault(id(original), _wrap(original))

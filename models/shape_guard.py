"""A tensor whose shape, dtype and device may be read but whose values may not.

A pipeline stage after the first runs the part of the base model's ``forward`` before the
blocks (masks, rotary embeddings, position ids) without the embeddings: those were computed on
stage 0 and only the hidden states arrive. What that part may take from the embeddings is
their metadata (``create_causal_mask`` reads the shape, dtype and device, a rotary module the
dtype and device). Passing a :class:`ShapeOnly` view of the received hidden states in their
place makes any read of values raise :class:`ValueRead` instead of silently computing with the
wrong tensor, so a model whose blocks depend on something derived from the embedding values
(Gemma 3n's per-layer inputs, for one) is refused when it is split.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["ShapeOnly", "ValueRead", "shape_only"]

_METADATA = {
    torch.Tensor.size, torch.Tensor.dim, torch.Tensor.__len__, torch.Tensor.is_floating_point,
    torch.Tensor.shape.__get__, torch.Tensor.dtype.__get__, torch.Tensor.device.__get__,  # type: ignore[attr-defined]
    torch.Tensor.ndim.__get__, torch.Tensor.layout.__get__, torch.Tensor.is_meta.__get__,  # type: ignore[attr-defined]
    torch.Tensor.requires_grad.__get__,  # type: ignore[attr-defined]
}


class ValueRead(RuntimeError):
    """Code read the values of a :class:`ShapeOnly` tensor."""


class ShapeOnly(torch.Tensor):
    """See the module docstring; made with :func:`shape_only`."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        raise ValueRead(getattr(func, "__qualname__", repr(func)))


def shape_only(t: torch.Tensor) -> ShapeOnly:
    """A :class:`ShapeOnly` view of ``t`` (no copy)."""
    return t.detach().as_subclass(ShapeOnly)

"""Tensors with a shape and no storage of their size: parameters of a meta-device model before they are filled.

A storage-less tensor is an ordinary tensor on the device whose every element is one NaN (a
zero-stride view of a one-element tensor, as ZeRO's shape-only placeholders are): it holds no
memory of its size, and its shape, dtype and device can be planned with. It is made without
ever allocating its size (allocating and then freeing would ask the device, or the host's
overcommit, for the whole tensor at once: DeepSeek V3's stacked experts are 15-30 GB each).
Its data must never be read (a read sees NaN), so code that copies parameters while planning
(tensor-parallel sharding) calls ``clone`` here, and ``initialize`` fills every one of them
before anything runs.
"""

from __future__ import annotations

import torch


def storageless(shape: torch.Size | tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if not dtype.is_floating_point and not dtype.is_complex:
        return torch.zeros((), dtype=dtype, device=device).expand(shape)
    return torch.full((), float("nan"), dtype=dtype, device=device).expand(shape)


def is_storageless(t: torch.Tensor) -> bool:
    """A tensor with more elements than its storage holds (made by :func:`storageless`)."""
    return t.numel() > 1 and not t.is_meta and t.untyped_storage().nbytes() < t.numel() * t.element_size()


def clone(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t``; for a storage-less ``t``, another storage-less tensor of its shape."""
    return storageless(t.shape, t.dtype, t.device) if is_storageless(t) else t.clone()

"""Tensors with a shape and no storage: parameters of a meta-device model before they are filled.

A storage-less tensor is an ordinary tensor on the device whose storage has been resized to 0
(ZeRO-3 frees gathered blocks the same way): it holds no memory and its shape and dtype can be
planned with, but its data must never be read (a read can crash the process), so code that
copies parameters while planning (tensor-parallel sharding) calls ``clone`` here, and
``initialize`` fills every one of them before anything runs.
"""

from __future__ import annotations

import torch


def storageless(shape: torch.Size | tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype, device=device)
    t.untyped_storage().resize_(0)
    return t


def is_storageless(t: torch.Tensor) -> bool:
    return t.numel() > 0 and not t.is_meta and t.untyped_storage().size() == 0


def clone(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t``; for a storage-less ``t``, another storage-less tensor of its shape."""
    return storageless(t.shape, t.dtype, t.device) if is_storageless(t) else t.clone()

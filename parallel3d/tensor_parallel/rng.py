"""Dropout under tensor parallelism: one random stream for replicated activations, one per rank for split ones.

Every tp rank starts from the same seed, so the default generator draws the same numbers on
each of them: dropout on replicated activations (embeddings, residuals, the output of a row
layer) gets the same mask everywhere, as it must, or the ranks' copies of the hidden state
would part. Inside a *split region* (from the entry of an attention/MLP module whose column
outputs stay split, up to its row layer) each rank holds different heads or features, and
their masks must be independent: there the default generator of the activations' device is
swapped for a stream offset by the tp rank (Megatron's ``get_cuda_rng_tracker().fork()``),
and swapped back when the row layer starts. Under sequence parallelism the blocks between
regions hold sequence shards, so they run in a rank stream too.

How the rank stream is seeded, and why: at each region entry one 62-bit number is drawn from
the CPU default generator (the same on every tp rank) and offset by the tp rank; the device's
default generator is seeded with it for the region and restored afterwards. Megatron keeps a
separate tracked state instead, and therefore needs its own checkpoint function to save and
restore it. Deriving the rank stream from the CPU generator at entry means that activation
recomputation (``torch.utils.checkpoint``, which restores the CPU and device generators at the
start of the recomputed block) replays the same masks with no extra state, on CPU and CUDA
alike, and the draw is a CPU op, so it costs no device synchronization. A region in eval mode
draws nothing. The rank streams are seeded afresh at every entry, so they never overlap one
another or the default stream in any way that depends on how much a region drew.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import unset_fake_temporarily

_STRIDE = 0x9E3779B97F4A7C15  # odd (golden-ratio) stride: tp ranks' seeds land far apart
_SEED_RANGE = 1 << 62


def _get_state(device: torch.device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


def _seed(device: torch.device, seed: int) -> None:
    if device.type == "cuda":
        with torch.cuda.device(device):
            torch.cuda.manual_seed(seed)
    else:
        torch.manual_seed(seed)


class SplitRegionRNG:
    """Swaps the device's default generator for this tp rank's stream between ``enter`` and ``leave``.

    Entries nest (a region inside the sequence-parallel span of the blocks); each ``leave``
    names the owner of the entry it closes, so a second row layer in one region, or a region's
    exit after its row layer already closed it, does nothing.
    """

    def __init__(self, tp_rank: int) -> None:
        self.tp_rank = tp_rank
        self._open: list[tuple[int, torch.device, torch.Tensor]] = []
        # False where the blocks draw no random numbers and are compiled (parallel3d/build/compiled_blocks.py):
        # the swaps would be graph breaks inside every block, and change no number
        self.active = True

    def enter(self, owner: nn.Module, device: torch.device) -> None:
        with unset_fake_temporarily():  # a real draw also while the planner runs the model on fake tensors
            base = int(torch.randint(_SEED_RANGE, (1,)).item())  # CPU generator: same on every tp rank
        self._open.append((id(owner), device, _get_state(device)))
        _seed(device, (base + self.tp_rank * _STRIDE) % (1 << 63))

    def leave(self, owner: nn.Module) -> None:
        if self._open and self._open[-1][0] == id(owner):
            _, device, state = self._open.pop()
            _set_state(device, state)

    def entry_hook(self) -> Callable:
        """Forward pre-hook (with kwargs) of a module that opens a rank stream while training."""

        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if module.training and self.active:
                self.enter(module, _device_of(args, kwargs))

        return hook

    def exit_hook(self, owner: nn.Module) -> Callable:
        """A forward pre- or post-hook that closes ``owner``'s stream (the row layer's start, the owner's end)."""

        def hook(module: nn.Module, *_: Any) -> None:
            self.leave(owner)

        return hook


def _device_of(args: tuple, kwargs: dict) -> torch.device:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.device
    return torch.device("cpu")

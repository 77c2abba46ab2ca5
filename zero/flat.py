"""Flat, padded, sharded storage for a group of parameters (a *unit*).

A unit is the grain of every ZeRO collective: its parameters are laid end to end in one
flat buffer, padded to a multiple of the data-parallel size, and rank ``r`` owns the
contiguous slice ``[r * shard_size, (r + 1) * shard_size)``. A parameter may straddle two
owners. Because every unit is padded on its own, each reduce-scatter and all-gather moves
equal chunks (see zero/comm.py), and a bucket of
gradients, a stage-3 fetch unit and an all-gather bucket are the same object.

A *persistent* unit keeps its full working buffer alive (stages 0-2, and stage-3 params
under the persistence threshold); a non-persistent unit keeps only its shard and
materializes the full buffer while it is gathered (stage 3).

A non-persistent unit owns one full buffer for its life; releasing it frees the buffer's
*storage* (``resize_(0)``) and gathering gives it back and all-gathers into it (FSDP's
approach). Only swapping ``param.data`` would free nothing between forward and backward:
autograd keeps views such as ``weight.t()`` of the gathered buffer alive, and they must see
the re-gathered values in backward. Released params also point at an empty tensor, so code
that touches them between uses gets an empty tensor rather than freed memory.
"""

from __future__ import annotations

import torch
from torch import nn

from zero.sizing import padded_numel

_EMPTY: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _empty(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A shared zero-element tensor that released stage-3 params point at."""
    key = (dtype, device)
    if key not in _EMPTY:
        _EMPTY[key] = torch.empty(0, dtype=dtype, device=device)
    return _EMPTY[key]


_ZERO: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _zero_scalar(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A shared one-element zero that :meth:`FlatUnit.shapes_only` placeholders expand."""
    key = (dtype, device)
    if key not in _ZERO:
        _ZERO[key] = torch.zeros((), dtype=dtype, device=device)
    return _ZERO[key]


class FlatUnit:
    """A list of parameters stored as one padded flat buffer, sharded over ``world`` ranks.

    Args:
        params: the parameters, in layout order; their current ``.data`` is the initial value.
        group_index: index of the optimizer param group they belong to.
        dtype: working precision of the flat buffer (the params are converted to it).
        rank, world: this rank's position in the sharding group (world 1 = unsharded).
        persistent: keep the full buffer materialized (stages 0-2) or only the shard (stage 3).
        device: where the buffers live.

    ``master`` is the fp32 master shard: a copy taken *before* the conversion to ``dtype``
    under mixed precision, an alias of the working shard (no extra bytes) under fp32. A
    ``frozen`` unit (set before its values are installed) has none.
    """

    def __init__(
        self,
        params: list[nn.Parameter],
        group_index: int,
        dtype: torch.dtype,
        rank: int,
        world: int,
        persistent: bool,
        device: torch.device,
    ) -> None:
        self.params = params
        self.group_index = group_index
        self.dtype = dtype
        self.rank = rank
        self.world = world
        self.persistent = persistent
        self.model_parallel = False  # split across a tensor-parallel group (for the grad norm)
        self.count_in_norm = True  # False for copies whose gradient another rank counts
        self.frozen = False  # untrained params: no master, no gradient, released after each use
        self.expert = False  # expert-parallel params: sharded over ``comm_group`` (the ranks with the same experts)
        self.comm_group = None  # an expert unit's shard group (zero.flat.shard_group_of)
        self.shapes = [p.shape for p in params]
        self.numels = [p.numel() for p in params]
        self.offsets = [0]
        for n in self.numels[:-1]:
            self.offsets.append(self.offsets[-1] + n)
        self.numel = sum(self.numels)
        self.padded = padded_numel(self.numel, world)
        self.shard_size = self.padded // world
        self.device = device
        self.full: torch.Tensor | None = None
        self.shard: torch.Tensor = torch.empty(0, dtype=dtype, device=device)
        self.master: torch.Tensor | None = None
        self.grad_full: torch.Tensor | None = None  # stages 0-1: full flat gradient buffer
        self.grad_shard: torch.Tensor | None = None  # the reduced gradients this rank owns
        self._materialized = persistent
        self._shapes_only = False  # released, params pointing at shape-only placeholders

    @property
    def shard_range(self) -> tuple[int, int]:
        start = self.rank * self.shard_size
        return start, start + self.shard_size

    def flatten_current(self) -> torch.Tensor:
        """A new padded fp32 flat copy of the params' current values (used once, at setup)."""
        flat = torch.zeros(self.padded, dtype=torch.float32, device=self.device)
        for p, off, n in zip(self.params, self.offsets, self.numels):
            flat[off : off + n].copy_(p.data.reshape(-1))
        return flat

    @property
    def kept_range(self) -> tuple[int, int]:
        """The part of the flat layout this rank stores: all of it (persistent) or its shard."""
        return (0, self.padded) if self.persistent else self.shard_range

    def param_ranges(self, lo: int, hi: int) -> list[tuple[int, int, int]]:
        """``(param index, start, stop)``: each param's part of flat range [lo, hi) (may be empty)."""
        out = []
        for pi, (off, n) in enumerate(zip(self.offsets, self.numels)):
            start = max(off, lo)
            out.append((pi, start, max(start, min(off + n, hi))))
        return out

    def install(self, full_fp32: torch.Tensor) -> None:
        """Take ``full_fp32`` (identical on all ranks) as the unit's value and lay out storage."""
        start, end = self.kept_range
        kept = full_fp32[start:end]
        self.install_kept(kept if self.persistent else kept.clone())  # a shard must not pin the full buffer

    def install_kept(self, kept_fp32: torch.Tensor) -> None:
        """Take ``kept_fp32`` (the fp32 values of ``kept_range``) as the unit's value.

        ``kept_fp32`` is handed over: under fp32 it becomes the unit's storage (the full
        buffer, or the shard), so no second copy is made. Creates the fp32 master shard (an
        alias of the working shard when ``dtype`` is fp32), the working shard, and for
        persistent units the full buffer the params view into.
        """
        start, end = self.shard_range
        fp32 = self.dtype == torch.float32
        if self.persistent:
            self.full = kept_fp32 if fp32 else kept_fp32.to(self.dtype)
            self.shard = self.full[start:end]
            self.point_params_at(self.full)
            self.master = self.shard if fp32 else kept_fp32[start:end].clone()
        else:
            self.shard = kept_fp32 if fp32 else kept_fp32.to(self.dtype)
            self.full = torch.empty(self.padded, dtype=self.dtype, device=self.device)
            self._materialized = True
            self.release()
            self.master = kept_fp32
        if self.frozen:
            self.master = None

    def point_params_at(self, full: torch.Tensor) -> None:
        """Make each param's ``.data`` a view into ``full``."""
        for p, off, n, shape in zip(self.params, self.offsets, self.numels, self.shapes):
            p.data = full[off : off + n].view(shape)

    def release(self) -> None:
        """Free the full buffer's storage of a non-persistent unit; its params point at an empty tensor."""
        if self.persistent or not (self._materialized or self._shapes_only):
            return
        if self._materialized:
            self.full.untyped_storage().resize_(0)
            self._materialized = False
        self._shapes_only = False
        empty = _empty(self.dtype, self.full.device)
        for p in self.params:
            p.data = empty

    def shapes_only(self) -> None:
        """Give a released unit's params their shapes back without their values: each points at a
        zero-stride view of one shared zero. Autograd then accumulates a gradient into a param
        whose backward reads no weights (an embedding's: it needs only the indices) without the
        unit being gathered; :meth:`release` points them at the empty tensor again."""
        if self.persistent or self._materialized or self._shapes_only:
            return
        self._shapes_only = True
        zero = _zero_scalar(self.dtype, self.full.device)
        for p, shape in zip(self.params, self.shapes):
            p.data = zero.expand(shape)

    def allocate_full(self) -> torch.Tensor:
        """Give the full buffer its storage back (uninitialized) and return it to gather into."""
        storage = self.full.untyped_storage()
        if storage.size() == 0:
            storage.resize_(self.padded * self.full.element_size())
        return self.full

    def mark_materialized(self) -> None:
        """The gather into ``full`` has completed: the params view it again."""
        if not self._materialized:
            self.point_params_at(self.full)
        self._materialized = True
        self._shapes_only = False

    @property
    def is_materialized(self) -> bool:
        return self._materialized

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Per-param views into a flat buffer of this unit's layout."""
        return [flat[off : off + n].view(shape) for off, n, shape in zip(self.offsets, self.numels, self.shapes)]


def shard_group_of(unit: FlatUnit, default):
    """The group ``unit`` is sharded and reduced over: an expert unit's own, else ``default`` (the optimizer's)."""
    return unit.comm_group if unit.expert else default

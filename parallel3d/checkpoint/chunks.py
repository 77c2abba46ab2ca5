"""Where a rank's pieces of training state lie in the whole, unsharded tensors.

A mesh-free checkpoint stores every tensor under its Hugging Face name in the shape the
unmodified model gives it, as a set of rectangular *chunks* (torch.distributed.checkpoint's
``ChunkStorageMetadata``: offsets and sizes). What a rank holds of a parameter is a ZeRO
*piece*: a contiguous range of the flattened tensor-parallel shard, which may start and end
mid-row. This module turns such a range into chunks of the global tensor, each paired with a
strided view of the rank's memory:

1. ``flat_range_boxes``: a flat range of a contiguous tensor is at most ``2 * ndim - 1``
   boxes (for a matrix: the tail of the first row, the whole rows, the head of the last row);
2. ``to_global``: a box of the tensor-parallel shard maps to one box of the full tensor per
   packed block it touches (``ShardSpec.source_runs``), the vocabulary padding to none;
3. ``piece_chunks``: both, with views into the piece's 1-D tensor (masters or an optimizer
   state), so saving copies nothing but the chunks and loading writes straight into place.

The alternative, gathering each unit inside the dp group while saving, moves the whole state
over the network once more and needs a buffer of a unit per rank; chunks need neither.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from parallel3d.tensor_parallel.sharding import ShardSpec

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


@dataclass(frozen=True)
class Chunk:
    """One rectangle of the global tensor ``name`` and the rank's memory that holds it."""

    name: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    global_shape: tuple[int, ...]
    view: torch.Tensor

    @property
    def key(self) -> tuple[str, tuple[int, ...]]:
        return self.name, self.offsets


def flat_range_boxes(shape: Sequence[int], lo: int, hi: int) -> list[Box]:
    """Boxes, in flat order, that exactly cover elements ``[lo, hi)`` of a contiguous ``shape``."""
    shape = tuple(shape)
    if lo >= hi:
        return []
    if not shape:
        return [((), ())]
    if len(shape) == 1:
        return [((lo,), (hi - lo,))]
    inner = math.prod(shape[1:])
    rest = (0,) * (len(shape) - 1)
    first, last = divmod(lo, inner), divmod(hi, inner)

    def within(row: int, a: int, b: int) -> list[Box]:
        return [((row, *o), (1, *s)) for o, s in flat_range_boxes(shape[1:], a, b)]

    if first[0] == last[0]:
        return within(first[0], first[1], last[1])
    boxes, full_start = [], first[0]
    if first[1]:
        boxes += within(first[0], first[1], inner)
        full_start += 1
    if last[0] > full_start:
        boxes.append(((full_start, *rest), (last[0] - full_start, *shape[1:])))
    if last[1]:
        boxes += within(last[0], 0, last[1])
    return boxes


def to_global(box: Box, spec: ShardSpec | None, tp_rank: int, tp_world: int) -> list[tuple[Box, int, int]]:
    """``(global box, local start, count)`` along the split dim for each part of a shard's ``box``.

    Without a spec (a replicated parameter) the box is its own global box.
    """
    offsets, sizes = box
    if spec is None:
        return [(box, 0, sizes[0] if sizes else 0)]
    d = spec.dim
    lo = offsets[d]
    out = []
    for shard_start, full_start, count in spec.source_runs(lo, lo + sizes[d], tp_rank, tp_world):
        g_off, g_size = list(offsets), list(sizes)
        g_off[d], g_size[d] = full_start, count
        out.append(((tuple(g_off), tuple(g_size)), shard_start - lo, count))
    return out


def _box_view(flat: torch.Tensor, flat_start: int, shape: Sequence[int], box: Box) -> torch.Tensor:
    """The view of ``box`` of a contiguous ``shape`` whose elements from ``flat_start`` on are ``flat``."""
    offsets, sizes = box
    strides = [math.prod(shape[i + 1 :]) for i in range(len(shape))]
    first = sum(o * s for o, s in zip(offsets, strides)) - flat_start
    return flat.as_strided(sizes, strides, flat.storage_offset() + first)


def piece_chunks(
    name: str,
    flat: torch.Tensor,
    start: int,
    local_shape: Sequence[int],
    global_shape: Sequence[int],
    spec: ShardSpec | None = None,
    tp_rank: int = 0,
    tp_world: int = 1,
) -> list[Chunk]:
    """Chunks of global tensor ``name`` held by ``flat``: elements ``[start, start + len(flat))``
    of the (tensor-parallel shard of the) parameter, whose shape here is ``local_shape``."""
    chunks = []
    for box in flat_range_boxes(local_shape, start, start + flat.numel()):
        view = _box_view(flat, start, local_shape, box)
        for (g_off, g_size), local_start, count in to_global(box, spec, tp_rank, tp_world):
            part = view.narrow(spec.dim, local_start, count) if spec is not None else view
            chunks.append(Chunk(name, g_off, g_size, tuple(global_shape), part))
    return chunks

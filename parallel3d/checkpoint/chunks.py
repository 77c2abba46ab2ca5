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
   packed block it touches (``ShardSpec.source_runs``), the vocabulary padding to none; an
   expert-parallel rank's experts are one more split (dim 0 of the stacked weight);
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


Split = tuple[ShardSpec, int, int]  # (spec, rank, ranks): how a rank's tensor is cut from the whole along spec.dim


def to_global(box: Box, splits: Sequence[Split] = ()) -> list[tuple[Box, tuple[tuple[int, int, int], ...]]]:
    """``(global box, ((dim, local start, count), ...))`` for each part of a shard's ``box``.

    Each split maps the box along its own dim (``ShardSpec.source_runs``): tensor parallelism's,
    and an expert-parallel rank's slice of dim 0 of a stacked expert weight (both, under expert
    tensor parallelism). Without a split (a replicated parameter) the box is its own global box.
    """
    parts: list[tuple[Box, tuple[tuple[int, int, int], ...]]] = [(box, ())]
    for spec, rank, ranks in splits:
        d, mapped = spec.dim, []
        for (offsets, sizes), narrows in parts:
            lo = offsets[d]
            for shard_start, full_start, count in spec.source_runs(lo, lo + sizes[d], rank, ranks):
                g_off, g_size = list(offsets), list(sizes)
                g_off[d], g_size[d] = full_start, count
                mapped.append(((tuple(g_off), tuple(g_size)), (*narrows, (d, shard_start - lo, count))))
        parts = mapped
    return parts


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
    splits: Sequence[Split] = (),
) -> list[Chunk]:
    """Chunks of global tensor ``name`` held by ``flat``: elements ``[start, start + len(flat))``
    of the (sharded) parameter, whose shape here is ``local_shape``, cut from the whole by ``splits``."""
    chunks = []
    for box in flat_range_boxes(local_shape, start, start + flat.numel()):
        view = _box_view(flat, start, local_shape, box)
        for (g_off, g_size), narrows in to_global(box, splits):
            part = view
            for dim, local_start, count in narrows:
                part = part.narrow(dim, local_start, count)
            chunks.append(Chunk(name, g_off, g_size, tuple(global_shape), part))
    return chunks

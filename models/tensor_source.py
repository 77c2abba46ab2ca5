"""The protocol shared by every source of a model's tensor values.

A rank that holds only part of a model asks a source for *rectangles* of tensors: index ranges,
one per leading dimension, in the tensor's original (unsplit Hugging Face) shape. Two sources
implement it: :class:`models.materialize.InitReplay` (the values eager construction would give)
and :class:`models.pretrained.SafetensorsSource` (a Hugging Face safetensors directory).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Protocol, runtime_checkable

import torch

#: A rectangle of a tensor in its original shape: one ``slice`` (step 1) per leading dimension;
#: dimensions left out are taken whole, so ``()`` is the whole tensor.
Rect = tuple[slice, ...]

#: ``{name: [rect, ...]}``: what a rank asks a source for.
Requests = Mapping[str, Sequence[Rect]]


@runtime_checkable
class TensorSource(Protocol):
    """Values for a model's tensors, read by rectangles."""

    def names(self) -> list[str]:
        """Every tensor name the source provides (tied aliases resolved to one canonical name)."""
        ...

    def shape(self, name: str) -> torch.Size: ...

    def read(self, requests: Requests) -> Iterator[tuple[str, list[torch.Tensor]]]:
        """Yield ``(name, [one new contiguous CPU tensor per requested rect])`` once per name."""
        ...


class RectError(ValueError):
    """A requested rectangle does not fit the tensor it names."""


def normalize_rect(name: str, shape: Sequence[int], rect: Rect) -> tuple[slice, ...]:
    """``rect`` with every dimension spelled out as ``slice(start, stop)``; checks the bounds.

    A rectangle is a tuple of ``slice`` objects with step 1 and bounds inside the shape
    (``None`` means the dimension's start or end). Anything else raises :class:`RectError`
    naming the tensor: silently clamping an out-of-range slice would hide a planning bug.
    """
    if not isinstance(rect, tuple):
        raise RectError(f"{name}: a rectangle is a tuple of slices, got {rect!r}")
    if len(rect) > len(shape):
        raise RectError(f"{name}: rectangle {rect!r} has more dimensions than shape {tuple(shape)}")
    out = []
    for dim, size in enumerate(shape):
        s = rect[dim] if dim < len(rect) else slice(None)
        if not isinstance(s, slice):
            raise RectError(f"{name}: dimension {dim} of rectangle {rect!r} is not a slice")
        if s.step not in (None, 1):
            raise RectError(f"{name}: rectangle {rect!r} has a step; rectangles are contiguous ranges")
        start = 0 if s.start is None else s.start
        stop = size if s.stop is None else s.stop
        if not (isinstance(start, int) and isinstance(stop, int) and 0 <= start <= stop <= size):
            raise RectError(
                f"{name}: rectangle {rect!r} is outside shape {tuple(shape)} (dimension {dim}: "
                f"wanted [{start}, {stop}) of {size})"
            )
        out.append(slice(start, stop))
    return tuple(out)


def rect_shape(rect: tuple[slice, ...]) -> tuple[int, ...]:
    """The shape of a normalized rectangle."""
    return tuple(s.stop - s.start for s in rect)


def whole(names: Sequence[str]) -> dict[str, list[Rect]]:
    """Requests for whole tensors: ``{name: [()]}``."""
    return {n: [()] for n in names}

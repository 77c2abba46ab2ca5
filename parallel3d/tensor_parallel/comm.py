"""The conjugate collectives of tensor (and sequence) parallelism as autograd functions.

Megatron's pairs, each a forward collective whose backward is its adjoint:

======================  =============================  ==================================
function                forward                        backward
======================  =============================  ==================================
``copy_to_tp``          identity                       all-reduce (sum)
``reduce_from_tp``      all-reduce (sum)               identity
``split_to_tp``         keep this rank's chunk of dim  all-gather along dim
``gather_from_tp``      all-gather along dim           keep this rank's chunk (split)
``gather_seq``          all-gather along dim           reduce-scatter along dim
``reduce_scatter_seq``  reduce-scatter along dim       all-gather along dim
======================  =============================  ==================================

Why explicit functions rather than DTensor: every collective is visible and countable, the
tp group is an argument (no module-level process-group state), and they run unchanged on
gloo. ``gather_from_tp`` and ``gather_seq`` share a forward and differ in what the
gradient arriving from downstream means: ``gather_from_tp`` is for a downstream that every
rank computes identically (its gradient is whole, so each rank keeps its chunk);
``gather_seq`` is for a downstream that is itself tensor-parallel (each rank's gradient is a
partial sum, so the chunks are summed over ranks: reduce-scatter). On gloo every
reduce-scatter is an all-reduce and a local slice (faster there, see ``_reduce_scatter``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from zero.comm import all_gather_single, reduce_scatter_single


def _all_reduce(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    out = x.contiguous().clone() if x.is_contiguous() else x.contiguous()
    dist.all_reduce(out, group=group)
    return out


def _all_gather(x: torch.Tensor, group: ProcessGroup, dim: int) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (rank order)."""
    world = dist.get_world_size(group)
    front = x.movedim(dim, 0).contiguous()
    out = front.new_empty((world * front.shape[0], *front.shape[1:]))
    all_gather_single(out, front, group=group)
    # contiguous: the consumers (a region's q, k, v) would each make, and save, their own copy
    return out.movedim(0, dim).contiguous()


def _reduce_scatter(x: torch.Tensor, group: ProcessGroup, dim: int) -> torch.Tensor:
    """Sum ``x`` over ranks and keep this rank's chunk of ``dim``.

    On gloo an all-reduce and a local slice: gloo's reduce-scatter of 2 MiB between two ranks
    takes 2.9 ms against 0.9 ms for an all-reduce, before the 0.8 ms copy into ``dim``-major
    order it needs (docs/benchmarks.md, "against their peers"; zero/comm.py does the same for
    ZeRO's shards). Twice the ring bytes, a third of the time there.
    """
    world = dist.get_world_size(group)
    if x.shape[dim] % world:
        raise ValueError(f"reduce-scatter: size {x.shape[dim]} of dim {dim} is not divisible by {world} ranks")
    if dist.get_backend(group) == "gloo":
        n = x.shape[dim] // world
        return _all_reduce(x, group).narrow(dim, dist.get_rank(group) * n, n).contiguous()
    front = x.movedim(dim, 0).contiguous()
    out = front.new_empty((front.shape[0] // world, *front.shape[1:]))
    reduce_scatter_single(out, front, group=group)
    return out.movedim(0, dim).contiguous()


def _split(x: torch.Tensor, group: ProcessGroup, dim: int) -> torch.Tensor:
    """This rank's chunk of ``dim`` (no communication)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if x.shape[dim] % world:
        raise ValueError(f"split: size {x.shape[dim]} of dim {dim} is not divisible by {world} ranks")
    return x.chunk(world, dim=dim)[rank].contiguous()


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return grad, None


class _SplitToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup, dim: int) -> torch.Tensor:  # type: ignore[override]
        ctx.group, ctx.dim = group, dim
        return _split(x, group, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return _all_gather(grad, ctx.group, ctx.dim), None, None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup, dim: int, reduce_grad: bool) -> torch.Tensor:  # type: ignore[override]
        ctx.group, ctx.dim, ctx.reduce_grad = group, dim, reduce_grad
        return _all_gather(x, group, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        if ctx.reduce_grad:
            return _reduce_scatter(grad, ctx.group, ctx.dim), None, None, None
        return _split(grad, ctx.group, ctx.dim), None, None, None


class _ReduceScatterSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup, dim: int) -> torch.Tensor:  # type: ignore[override]
        ctx.group, ctx.dim = group, dim
        return _reduce_scatter(x, group, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return _all_gather(grad, ctx.group, ctx.dim), None, None


def copy_to_tp(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Enter a tensor-parallel region: identity forward, all-reduce of the gradient backward."""
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Leave a tensor-parallel region: all-reduce (sum) forward, identity backward."""
    return _ReduceFromTP.apply(x, group)


def split_to_tp(x: torch.Tensor, group: ProcessGroup, dim: int = -1) -> torch.Tensor:
    """Keep this rank's chunk of ``dim`` forward; all-gather the gradient backward."""
    return _SplitToTP.apply(x, group, dim)


def gather_from_tp(x: torch.Tensor, group: ProcessGroup, dim: int = -1) -> torch.Tensor:
    """All-gather along ``dim`` forward; keep this rank's chunk of the (whole) gradient backward."""
    return _GatherFromTP.apply(x, group, dim, False)


def gather_seq(x: torch.Tensor, group: ProcessGroup, dim: int = 1) -> torch.Tensor:
    """Sequence parallel -> tensor parallel: all-gather forward, reduce-scatter backward."""
    return _GatherFromTP.apply(x, group, dim, True)


def reduce_scatter_seq(x: torch.Tensor, group: ProcessGroup, dim: int = 1) -> torch.Tensor:
    """Tensor parallel -> sequence parallel: reduce-scatter forward, all-gather backward."""
    return _ReduceScatterSeq.apply(x, group, dim)


def all_gather_tokens(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Every rank's ``x`` concatenated along dim 0, without autograd (indices, masks)."""
    return _all_gather(x, group, 0)


def all_reduce_grad_hook(group: ProcessGroup, piece: int = 0, pieces: int = 1):
    """A tensor hook that sums a gradient over the ranks of ``group`` holding the same piece.

    ``pieces == 1``: a plain all-reduce (replicated params with partial grads). Otherwise the
    ranks hold ``pieces`` different tensors, each replicated on several ranks (key/value
    heads when tp exceeds their count), and each is summed over its own holders: one
    all-reduce over the whole group of a [pieces, ...] buffer in which every rank fills its
    row. Why not a sub-group per piece: creating groups is a collective over the whole world,
    and these tensors are small (kv projections).
    """

    def hook(grad: torch.Tensor) -> torch.Tensor:
        if pieces == 1:
            return _all_reduce(grad, group)
        rows = grad.new_zeros((pieces, *grad.shape))
        rows[piece] = grad
        dist.all_reduce(rows, group=group)
        return rows[piece]

    return hook

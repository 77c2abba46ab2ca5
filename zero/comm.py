"""ZeRO's two collectives: reduce a full buffer into this rank's shard, gather shards into full.

On NCCL (and any backend but gloo) they are ``reduce_scatter_single`` and
``all_gather_single`` (``reduce_scatter_tensor`` / ``all_gather_into_tensor`` before torch
2.13). Gloo implements those two slowly: measured on 2 ranks with 55 MB (docs/benchmarks.md),
a reduce-scatter costs more than an all-reduce of the same buffer, and an all-gather about
three times one broadcast per owner. So on gloo the shard is taken from an in-place
all-reduce, and the gather is a broadcast from each owner into its chunk.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

AVG = dist.ReduceOp.AVG


class Pending:
    """Collectives in flight and what to do once they are done (``wait`` does both)."""

    def __init__(self, works: list, then: Callable[[], object] | None = None) -> None:
        self.works = works
        self.then = then

    def is_completed(self) -> bool:
        """Whether every collective has finished (``wait`` would not block)."""
        return all(work.is_completed() for work in self.works)

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        if self.then is not None:
            self.then()
            self.then = None


def _gloo(group: dist.ProcessGroup | None) -> bool:
    return dist.get_backend(group) == "gloo"


def reduce_to_shard(full: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup | None, *, accumulate: bool) -> Pending:
    """Start averaging ``full`` over ``group`` into this rank's chunk, written to (or added to) ``shard``.

    ``full`` may be overwritten; it must stay untouched until ``wait``.
    """
    rank, n = dist.get_rank(group), shard.numel()
    if _gloo(group):
        work = dist.all_reduce(full, op=AVG, group=group, async_op=True)
        mine = full[rank * n : (rank + 1) * n]
        if accumulate:
            return Pending([work], lambda: shard.add_(mine))
        if shard.data_ptr() == mine.data_ptr():
            return Pending([work])
        return Pending([work], lambda: shard.copy_(mine))
    if accumulate:
        received = torch.empty_like(shard)
        work = reduce_scatter_single(received, full, op=AVG, group=group, async_op=True)
        return Pending([work], lambda: shard.add_(received))
    return Pending([reduce_scatter_single(shard, full, op=AVG, group=group, async_op=True)], lambda: full)


def gather_shards(full: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup | None) -> Pending:
    """Start filling ``full`` with every rank's ``shard`` in rank order (``shard`` may be a chunk of ``full``).

    A ``shard`` in host memory (ZeRO-Offload) is first copied into this rank's chunk of ``full``,
    which then serves as the collective's input: the gather needs no other device buffer.
    """
    if shard.device != full.device:
        n = shard.numel()
        own = full[dist.get_rank(group) * n : (dist.get_rank(group) + 1) * n]
        own.copy_(shard, non_blocking=shard.is_pinned())
        shard = own
    if not _gloo(group):
        return Pending([all_gather_single(full, shard, group=group, async_op=True)])
    rank, world, n = dist.get_rank(group), dist.get_world_size(group), shard.numel()
    works = []
    for owner in range(world):
        chunk = full[owner * n : (owner + 1) * n]
        if owner == rank and chunk.data_ptr() != shard.data_ptr():
            chunk.copy_(shard)
        works.append(dist.broadcast(chunk, src=dist.get_global_rank(group, owner) if group is not None else owner,
                                    group=group, async_op=True))
    return Pending(works)

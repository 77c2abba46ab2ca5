"""ZeRO's data-parallel ranks as shard groups and replicas of them (MiCS, FSDP's HSDP).

Flat ZeRO shards over every data-parallel rank. Hybrid sharding splits them into replicas of
``S`` ranks each: states are sharded inside a replica (``shard``, size S), and the replicas hold
the same shards (``replica``, the ranks at one shard position, size dp / S). Gradients are then
reduced inside a replica and their shard averaged across replicas; parameters are gathered
inside a replica only, over the fast links of a node.

A rank's index over all of them is ``replica_rank x S + shard_rank``: the mesh's ``dp`` view,
or with context parallelism (whose ranks share ZeRO's shard group) its ``dp_cp`` view.
What must hold over all of them (a start from equal values, an agreement on which params got
gradients) goes in two hops: inside the replica, then across replicas.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


def _size(group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def _rank(group: dist.ProcessGroup | None) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


@dataclass(frozen=True)
class DataParallelGroups:
    """The shard group and (hybrid sharding) the group of the replicas at this shard position."""

    shard: dist.ProcessGroup | None
    replica: dist.ProcessGroup | None = None

    @property
    def shard_world(self) -> int:
        return _size(self.shard)

    @property
    def shard_rank(self) -> int:
        return _rank(self.shard)

    @property
    def replicas(self) -> int:
        return _size(self.replica) if self.replica is not None else 1

    @property
    def replica_rank(self) -> int:
        return _rank(self.replica) if self.replica is not None else 0

    @property
    def world(self) -> int:
        """Every data-parallel rank: shard size x replicas."""
        return self.shard_world * self.replicas

    @property
    def rank(self) -> int:
        return self.replica_rank * self.shard_world + self.shard_rank

    def _hops(self) -> list[dist.ProcessGroup | None]:
        hops = [self.shard] if self.shard_world > 1 else []
        return hops + ([self.replica] if self.replicas > 1 else [])

    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> None:
        """Reduce ``tensor`` in place over every data-parallel rank (SUM, MAX, MIN or AVG: each
        composes over the two hops, the replicas being of equal size)."""
        for group in self._hops():
            dist.all_reduce(tensor, op=op, group=group)

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        """Give every data-parallel rank data-parallel rank ``src``'s ``tensor``: across replicas
        from ``src``'s replica, then inside each replica from ``src``'s shard position."""
        src_replica, src_shard = divmod(src, self.shard_world)
        if self.replicas > 1:
            dist.broadcast(tensor, src=dist.get_global_rank(self.replica, src_replica), group=self.replica)
        if self.shard_world > 1:
            owner = dist.get_global_rank(self.shard, src_shard) if self.shard is not None else src_shard
            dist.broadcast(tensor, src=owner, group=self.shard)

"""How one full tensor maps to T tensor-parallel shards, and back.

A ``ShardSpec`` is the whole recipe, so the same code builds the layers, slices the
single-process gradients in tests, and reassembles full tensors for checkpoints/export:

- ``dim``: the split dimension (a Linear's output features are dim 0 of its weight, a
  Conv1D's are dim 1: Conv1D stores weights [in, out]).
- ``packed``: the dim holds ``packed`` equal blocks that are each split across ranks, so
  every rank gets its slice of every block (GPT-2's c_attn holds [q | k | v]: each rank
  needs its heads' q, k and v; fused gate_up projections hold [gate | up]).
- ``full_size`` / ``padded_size``: a vocabulary not divisible by T is zero-padded at the end
  to a multiple of T (Megatron); padded rows are never looked up and their logits are
  masked out of the loss, so their gradient is exactly zero.
- ``replicas``: how many consecutive tp ranks hold the same shard. Key/value heads when T
  exceeds their count K (T a multiple of K): the tensor is cut into K pieces and ranks
  ``r * T/K ... (r + 1) * T/K - 1`` all hold piece r, the kv head their query heads use.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from parallel3d.build.storageless import is_storageless, storageless


@dataclass(frozen=True)
class ShardSpec:
    """Where a tp-sharded parameter comes from in its full tensor (see module docstring)."""

    dim: int
    full_size: int
    padded_size: int
    packed: int = 1
    replicas: int = 1

    def pieces(self, rank: int, world: int) -> tuple[int, int]:
        """(which piece, how many pieces) rank ``rank`` of ``world`` holds."""
        return rank // self.replicas, world // self.replicas

    def is_first_replica(self, rank: int) -> bool:
        """Whether ``rank`` is the lowest tp rank holding its piece (the one the grad norm counts)."""
        return rank % self.replicas == 0

    def shard(self, full: torch.Tensor, rank: int, world: int) -> torch.Tensor:
        """Rank ``rank``'s shard of ``full`` (a copy, contiguous; storage-less if ``full`` is)."""
        if full.shape[self.dim] != self.full_size:
            raise ValueError(f"expected size {self.full_size} along dim {self.dim}, got {tuple(full.shape)}")
        rank, world = self.pieces(rank, world)
        if is_storageless(full):
            shape = list(full.shape)
            shape[self.dim] = self.padded_size // world
            return storageless(shape, full.dtype, full.device)
        if self.padded_size > self.full_size:
            pad_shape = list(full.shape)
            pad_shape[self.dim] = self.padded_size - self.full_size
            full = torch.cat([full, full.new_zeros(pad_shape)], dim=self.dim)
        blocks = full.chunk(self.packed, dim=self.dim)
        return torch.cat([b.chunk(world, dim=self.dim)[rank] for b in blocks], dim=self.dim).contiguous()

    def source_runs(self, lo: int, hi: int, rank: int, world: int) -> list[tuple[int, int, int]]:
        """Where indices [lo, hi) of rank ``rank``'s shard (along ``dim``) come from in the full tensor.

        ``(shard_start, full_start, count)`` runs, one per packed block the range touches; the
        zero padding of the vocabulary has no source and is left out.
        """
        rank, world = self.pieces(rank, world)
        block = self.padded_size // self.packed
        chunk = block // world
        runs = []
        for b in range(self.packed):
            a, z = max(lo, b * chunk), min(hi, (b + 1) * chunk)
            full_start = b * block + rank * chunk + (a - b * chunk)
            count = min(z - a, self.full_size - full_start)
            if count > 0:
                runs.append((a, full_start, count))
        return runs

    def unshard(self, shards: list[torch.Tensor]) -> torch.Tensor:
        """The full tensor from every rank's shard (rank order), padding and replicas removed."""
        per_rank = [s.chunk(self.packed, dim=self.dim) for s in shards[:: self.replicas]]
        blocks = [torch.cat([r[b] for r in per_rank], dim=self.dim) for b in range(self.packed)]
        return torch.cat(blocks, dim=self.dim).narrow(self.dim, 0, self.full_size)


def make_spec(full_size: int, dim: int, world: int, *, packed: int = 1, pad: bool = False,
              replicas: int = 1) -> ShardSpec:
    """A spec for splitting ``full_size`` entries of ``dim`` across ``world`` ranks.

    With ``replicas`` > 1 the size is split into ``world / replicas`` pieces, each held by
    that many consecutive ranks. Raises ``ValueError`` when the size does not split evenly
    and ``pad`` is off; callers turn that into a ``ConfigError`` that names the model's numbers.
    """
    if world % replicas:
        raise ValueError(f"{replicas} replicas of each piece do not divide tensor parallel size {world}")
    world //= replicas
    if full_size % packed:
        raise ValueError(f"size {full_size} does not hold {packed} equal packed blocks")
    padded = -(-full_size // world) * world if pad else full_size
    if pad and packed != 1:
        raise ValueError("padding is only supported for unpacked dims (the vocabulary)")
    if (padded // packed) % world:
        what = f"each of its {packed} packed blocks of {full_size // packed}" if packed > 1 else f"size {full_size}"
        raise ValueError(f"{what} is not divisible by tensor parallel size {world}")
    return ShardSpec(dim=dim, full_size=full_size, padded_size=padded, packed=packed, replicas=replicas)

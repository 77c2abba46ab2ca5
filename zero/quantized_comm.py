"""ZeRO++'s quantized collectives: parameters gathered (qwZ) and gradients reduced (qgZ) as int8.

Both quantize symmetrically in blocks of ``BLOCK`` elements: each block gets one fp32 scale,
its absolute maximum over 127, and each element ``round(x / scale)`` in [-127, 127]. A block
never straddles two ranks' chunks, so every rank quantizes only what it sends. The wire then
carries 1 byte per element plus 4 per block: about a quarter of fp32's bytes and half of
bf16's (ZeRO++, Wang et al. 2023, sections 3.1 and 3.3).

* ``gather_shards_int8`` (``zero_quantized_weights``): each rank quantizes its shard, the int8
  values and the scales are gathered, and every rank dequantizes the whole into the working
  buffer, its own chunk too, so all ranks compute with the same weights.
* ``reduce_to_shard_int8`` (``zero_quantized_gradients``): the reduce-scatter becomes one
  all-to-all: each rank quantizes its gradient's chunk for every other rank and sends it there;
  a rank dequantizes the chunks it received, all of its own shard, and averages them in fp32.
  Where the shard group spans nodes (``hops``: its members on this node and their peers on the
  others), it takes qgZ's two hops instead (ZeRO++, section 3.3): an all-to-all inside the node
  sums the node's gradients of the shards its members' peers own (each member one 1/L of the
  gradient), then an all-to-all across the nodes, requantized, delivers each rank its own
  shard. Across nodes each rank then sends (M - 1) / N of the gradient, M nodes of L members,
  instead of (N - L) / N: L times less, for one more rounding.

The masters, the optimizer and the gradient norm stay in full precision: the error enters
through the weights a forward uses and the gradient shards the step reads (docs/deepspeed.md
gives its measured size).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from zero.comm import Pending, gather_shards

BLOCK = 256


def _blocks(numel: int) -> int:
    return -(-numel // BLOCK)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` (1-D) in fp32 as rows of ``BLOCK``, zero-padded only when its length needs it."""
    n = x.numel()
    if n % BLOCK == 0:
        return x.to(torch.float32).reshape(-1, BLOCK)
    padded = torch.zeros(_blocks(n) * BLOCK, dtype=torch.float32, device=x.device)
    padded[:n] = x
    return padded.view(-1, BLOCK)


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (1-D) as int8 values and one fp32 scale per block of ``BLOCK`` (the last may be short)."""
    n = x.numel()
    rows = _rows(x)
    scales = rows.abs().amax(dim=1) / 127.0
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    values = torch.round(rows / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return values.view(-1)[:n].contiguous(), scales


def dequantize(values: torch.Tensor, scales: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The fp32 (or ``out``'s dtype, written into ``out``) values of ``quantize``'s output."""
    n = values.numel()
    result = (_rows(values) * scales[:, None]).view(-1)[:n]
    if out is None:
        return result
    out.copy_(result)
    return out


def gather_shards_int8(full: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup | None) -> Pending:
    """Start filling ``full`` with every rank's ``shard``, sent as int8 with block scales."""
    world, n = dist.get_world_size(group), shard.numel()
    values, scales = quantize(shard.to(full.device))
    all_values = torch.empty(world * n, dtype=torch.int8, device=full.device)
    all_scales = torch.empty(world * scales.numel(), dtype=torch.float32, device=full.device)
    sent = [gather_shards(all_values, values, group), gather_shards(all_scales, scales, group)]

    def unpack() -> None:
        for owner in range(world):
            dequantize(all_values[owner * n : (owner + 1) * n], all_scales.view(world, -1)[owner],
                       out=full[owner * n : (owner + 1) * n])

    return Pending([w for pending in sent for w in pending.works], unpack)


def reduce_to_shard_int8(full: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup | None, *,
                         accumulate: bool, hops: tuple[dist.ProcessGroup, dist.ProcessGroup,
                                                       dist.ProcessGroup] | None = None) -> Pending:
    """Start averaging ``full`` over ``group`` into this rank's chunk, written to (or added to)
    ``shard``, with every chunk sent as int8 with block scales: one all-to-all, or where ``hops``
    = (the shard group, its members on this node, their peers across nodes) names ``group``, two."""
    if hops is not None and group is hops[0]:
        return _two_hops(full, shard, hops[1], hops[2], accumulate=accumulate)
    world, n = dist.get_world_size(group), shard.numel()
    got_values, got_scales, works = _exchange(full.view(world, n), group)

    def average() -> None:
        _store(_dequantized_sum(got_values, got_scales, world, n) / world, shard, accumulate)

    return Pending(works, average)


def _exchange(rows: torch.Tensor, group: dist.ProcessGroup | None):
    """Send row r of ``rows`` to rank r of ``group`` as int8 (quantized row by row); what arrives."""
    chunks = [quantize(row) for row in rows]
    values = torch.cat([v for v, _ in chunks])
    scales = torch.cat([s for _, s in chunks])
    got_values, got_scales = torch.empty_like(values), torch.empty_like(scales)
    works = [dist.all_to_all_single(got_values, values, group=group, async_op=True),
             dist.all_to_all_single(got_scales, scales, group=group, async_op=True)]
    return got_values, got_scales, works


def _dequantized_sum(values: torch.Tensor, scales: torch.Tensor, senders: int, n: int) -> torch.Tensor:
    per_rank = scales.view(senders, -1)
    return sum(dequantize(values[r * n : (r + 1) * n], per_rank[r]) for r in range(senders))


def _store(total: torch.Tensor, shard: torch.Tensor, accumulate: bool) -> None:
    if accumulate:
        shard.add_(total.to(shard.dtype))
    else:
        shard.copy_(total)


def _two_hops(full: torch.Tensor, shard: torch.Tensor, node: dist.ProcessGroup, across: dist.ProcessGroup, *,
              accumulate: bool) -> Pending:
    """qgZ over M nodes of L shard ranks each (the shard group's member j = node j // L, place
    j % L): inside the node, member l gets the chunks of every node's member l and sums its
    node's; across, the member l of node b gets the sums of chunk b L + l from every node."""
    local, nodes, n = dist.get_world_size(node), dist.get_world_size(across), shard.numel()
    by_place = full.view(nodes, local, n).transpose(0, 1).reshape(local, nodes * n)  # row l: chunks b L + l
    got_values, got_scales, works = _exchange(by_place, node)

    def across_nodes() -> None:
        node_sum = _dequantized_sum(got_values, got_scales, local, nodes * n)  # chunks b L + l, this node's sum
        values, scales, second = _exchange(node_sum.view(nodes, n), across)
        for work in second:
            work.wait()
        _store(_dequantized_sum(values, scales, nodes, n) / (local * nodes), shard, accumulate)

    return Pending(works, across_nodes)

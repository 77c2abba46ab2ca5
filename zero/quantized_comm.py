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
  This is qgZ's single-hop form: ZeRO++ adds a hop inside the node first, which on one node is
  the same exchange.

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
                         accumulate: bool) -> Pending:
    """Start averaging ``full`` over ``group`` into this rank's chunk, written to (or added to)
    ``shard``, with every chunk sent as int8 with block scales (one all-to-all)."""
    world, n = dist.get_world_size(group), shard.numel()
    chunks = [quantize(chunk) for chunk in full.view(world, n)]
    values = torch.cat([v for v, _ in chunks])
    scales = torch.cat([s for _, s in chunks])
    got_values, got_scales = torch.empty_like(values), torch.empty_like(scales)
    works = [dist.all_to_all_single(got_values, values, group=group, async_op=True),
             dist.all_to_all_single(got_scales, scales, group=group, async_op=True)]

    def average() -> None:
        per_rank = got_scales.view(world, -1)
        total = sum(dequantize(got_values[r * n : (r + 1) * n], per_rank[r]) for r in range(world)) / world
        if accumulate:
            shard.add_(total.to(shard.dtype))
        else:
            shard.copy_(total)

    return Pending(works, average)

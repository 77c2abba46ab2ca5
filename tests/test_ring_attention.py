"""Ring attention's kernel against plain softmax attention over the whole sequence (float64).

Each rank takes its two chunks of the same random q, k, v (``ring_index``), runs the ring, and
compares its output and its tokens' dq, dk, dv (the backward's dk/dv travel back around the
ring) with one process's eager attention: causal, with a sliding window shorter than the
sequence, with softcapping, with fewer kv heads than cp ranks (one kv head at cp 4), and with a
block's query rows taken in small tiles.
"""

from __future__ import annotations

import pytest
import torch

LENGTH, DIM = 24, 8


class _Module(torch.nn.Module):
    is_causal = True


def _reference(q, k, v, scale, window, softcap):
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = q @ k.transpose(-1, -2) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    diff = torch.arange(q.shape[2])[:, None] - torch.arange(k.shape[2])[None]
    allowed = (diff >= 0) & (diff < window) if window is not None else diff >= 0
    scores = scores.masked_fill(~allowed, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2)


def _inputs(heads: int, kv_heads: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    shapes = [(2, heads, LENGTH, DIM), (2, kv_heads, LENGTH, DIM), (2, kv_heads, LENGTH, DIM), (2, LENGTH, heads, DIM)]
    return [torch.randn(shape, generator=g, dtype=torch.float64) for shape in shapes]


def _ring_part(heads: int, kv_heads: int, window, softcap, tile: int) -> list[torch.Tensor]:
    import torch.distributed as dist

    from parallel3d.context_parallel import ring
    from parallel3d.context_parallel.ring import RingAttention, ring_index

    ring._TILE_ELEMENTS = tile

    q, k, v, grad = _inputs(heads, kv_heads)
    index = ring_index(dist.get_rank(), dist.get_world_size(), LENGTH)
    mine = [t[:, :, index].clone().requires_grad_() for t in (q, k, v)]
    attention = RingAttention(dist.group.WORLD, "test")
    out, _ = attention(_Module(), *mine, None, sliding_window=window, softcap=softcap, scaling=0.3)
    out.backward(grad[:, index])
    return [out.detach(), *(t.grad for t in mine)]


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("heads, kv_heads, window, softcap, tile", [
    (4, 2, None, None, 1 << 22), (4, 1, None, None, 1 << 22), (4, 4, 5, None, 1 << 22), (4, 2, 7, 2.0, 1 << 22),
    (2, 1, 30, None, 1 << 22), (4, 2, 7, None, 40), (4, 2, None, 2.0, 1)])
def test_ring_equals_plain_attention(dist, cp, heads, kv_heads, window, softcap, tile):
    """``tile``: scores per row tile (the last two cases take a block's rows a few at a time)."""
    from parallel3d.context_parallel.ring import ring_index

    q, k, v, grad = (t.requires_grad_() if i < 3 else t for i, t in enumerate(_inputs(heads, kv_heads)))
    want = _reference(q, k, v, 0.3, window, softcap)
    want.backward(grad)
    for rank, (out, dq, dk, dv) in enumerate(dist.run(cp, _ring_part, heads, kv_heads, window, softcap, tile)):
        index = ring_index(rank, cp, LENGTH)
        torch.testing.assert_close(out, want.detach()[:, index], rtol=1e-12, atol=1e-12)
        for got, full in ((dq, q.grad), (dk, k.grad), (dv, v.grad)):
            torch.testing.assert_close(got, full[:, :, index], rtol=1e-11, atol=1e-12)


def _dropout_refused() -> str:
    import torch.distributed as dist

    from parallel3d.context_parallel.ring import RingAttention
    from parallel3d.errors import ConfigError

    q, k, v, _ = _inputs(2, 2)
    with pytest.raises(ConfigError) as info:
        RingAttention(dist.group.WORLD, "llama")(_Module(), q[:, :, :12], k[:, :, :12], v[:, :, :12], None,
                                                  dropout=0.1)
    return str(info.value)


def test_dropout_is_refused(dist):
    for got in dist.run(2, _dropout_refused):
        assert "context_parallel (ring) cannot run llama's attention: attention dropout 0.1" in got

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


def _inputs(heads: int, kv_heads: int, value_dim: int = DIM) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    shapes = [(2, heads, LENGTH, DIM), (2, kv_heads, LENGTH, DIM), (2, kv_heads, LENGTH, value_dim),
              (2, LENGTH, heads, value_dim)]
    return [torch.randn(shape, generator=g, dtype=torch.float64) for shape in shapes]


def _ring_part(heads: int, kv_heads: int, window, softcap, tile: int, value_dim: int, padding=None,
               inner: str = "sdpa") -> list[torch.Tensor]:
    import torch.distributed as dist

    from parallel3d.context_parallel import ring
    from parallel3d.context_parallel.mask_inputs import MaskInputs
    from parallel3d.context_parallel.ring import RingAttention, ring_index

    ring._TILE_ELEMENTS = tile
    q, k, v, grad = _inputs(heads, kv_heads, value_dim)
    index = ring_index(dist.get_rank(), dist.get_world_size(), LENGTH)
    mine = [t[:, :, index].clone().requires_grad_() for t in (q, k, v)]
    attention = RingAttention(dist.group.WORLD, "test", inner)
    attention.inputs = MaskInputs(padding=padding)
    out, _ = attention(_Module(), *mine, None, sliding_window=window, softcap=softcap, scaling=0.3)
    out.backward(grad[:, index])
    return [out.detach(), *(t.grad for t in mine)]


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("heads, kv_heads, window, softcap, tile, value_dim", [
    (4, 2, None, None, 1 << 22, DIM), (4, 1, None, None, 1 << 22, DIM), (4, 4, 5, None, 1 << 22, DIM),
    (4, 2, 7, 2.0, 1 << 22, DIM), (2, 1, 30, None, 1 << 22, DIM), (4, 2, 7, None, 40, DIM), (4, 2, None, 2.0, 1, DIM),
    (4, 2, None, None, 1 << 22, 4)])
def test_ring_equals_plain_attention(dist, cp, heads, kv_heads, window, softcap, tile, value_dim):
    """``tile``: scores per row tile (two cases take a block's rows a few at a time); ``value_dim``:
    values narrower than keys (multi-head latent attention)."""
    from parallel3d.context_parallel.ring import ring_index

    q, k, v, grad = (t.requires_grad_() if i < 3 else t for i, t in enumerate(_inputs(heads, kv_heads, value_dim)))
    want = _reference(q, k, v, 0.3, window, softcap)
    want.backward(grad)
    results = dist.run(cp, _ring_part, heads, kv_heads, window, softcap, tile, value_dim)
    for rank, (out, dq, dk, dv) in enumerate(results):
        index = ring_index(rank, cp, LENGTH)
        torch.testing.assert_close(out, want.detach()[:, index], rtol=1e-12, atol=1e-12)
        for got, full in ((dq, q.grad), (dk, k.grad), (dv, v.grad)):
            torch.testing.assert_close(got, full[:, :, index], rtol=1e-11, atol=1e-12)


PADDED = {"left": (3, 9), "right": (5, 13)}
"""Padded tokens of the two rows: at cp 4 (chunks of 3 tokens) the first chunk is padding in both
rows under left padding, so only the rows that see no key keep its blocks."""


def _padding(side: str) -> torch.Tensor:
    mask = torch.ones(2, LENGTH, dtype=torch.bool)
    for row, count in enumerate(PADDED[side]):
        mask[row, slice(0, count) if side == "left" else slice(LENGTH - count, LENGTH)] = False
    return mask


def _padded_reference(q, k, v, scale, window, padding, inner):
    """One process's kernels on the whole sequence with the padding mask: torch's sdpa with the
    boolean mask (0 for a row that sees nothing), or eager's scores plus the dtype's minimum."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    diff = torch.arange(LENGTH)[:, None] - torch.arange(LENGTH)[None]
    allowed = ((diff >= 0) & (diff < window) if window is not None else diff >= 0) & padding[:, None, None, :]
    if inner == "sdpa":
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale).transpose(1, 2)
    bias = torch.zeros((), dtype=q.dtype).masked_fill(~allowed, torch.finfo(q.dtype).min)
    scores = q @ k.transpose(-1, -2) * scale + bias
    return (scores.softmax(-1) @ v).transpose(1, 2)


@pytest.mark.parametrize("cp, side, inner, window, kv_heads", [
    (2, "left", "sdpa", None, 2), (4, "left", "eager", None, 1), (4, "right", "sdpa", None, 2),
    (2, "right", "eager", 5, 2), (4, "left", "eager", 5, 2)])
def test_ring_with_padding_equals_plain_attention(dist, cp, side, inner, window, kv_heads):
    """Padding (left, right; unequal lengths): the padded keys are masked in every block, and rows
    that see no key give what one process's kernel gives (sdpa: 0; eager: uniform over every key),
    gradients included, no NaN."""
    from parallel3d.context_parallel.ring import ring_index

    padding = _padding(side)
    q, k, v, grad = (t.requires_grad_() if i < 3 else t for i, t in enumerate(_inputs(4, kv_heads)))
    want = _padded_reference(q, k, v, 0.3, window, padding, inner)
    want.backward(grad)
    results = dist.run(cp, _ring_part, 4, kv_heads, window, None, 1 << 22, DIM, padding, inner)
    for rank, (out, dq, dk, dv) in enumerate(results):
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


def _bytes_sent(method: str, heads: int, kv_heads: int) -> tuple[int, int]:
    """Bytes this rank sends through the cp attention's forward and then its backward (float64)."""
    import torch.distributed as dist

    from parallel3d.context_parallel.ring import RingAttention, ring_index
    from parallel3d.context_parallel.ulysses import UlyssesAttention

    sent = [0]
    batch_send, exchange = dist.batch_isend_irecv, dist.all_to_all_single

    def count_p2p(ops):
        sent[0] += sum(op.tensor.numel() * op.tensor.element_size() for op in ops if op.op is dist.isend)
        return batch_send(ops)

    def count_all_to_all(output, tensor, *args, **kwargs):
        sent[0] += tensor.numel() * tensor.element_size() * (dist.get_world_size() - 1) // dist.get_world_size()
        return exchange(output, tensor, *args, **kwargs)

    q, k, v, grad = _inputs(heads, kv_heads)
    index = ring_index(dist.get_rank(), dist.get_world_size(), LENGTH)
    mine = [t[:, :, index].clone().requires_grad_() for t in (q, k, v)]
    attention = (RingAttention(dist.group.WORLD, "test") if method == "ring"
                 else UlyssesAttention(dist.group.WORLD, "sdpa", "test"))
    dist.batch_isend_irecv, dist.all_to_all_single = count_p2p, count_all_to_all
    try:
        out, _ = attention(_Module(), *mine, None, scaling=0.3)
        forward = sent[0]
        out.backward(grad[:, index])
    finally:
        dist.batch_isend_irecv, dist.all_to_all_single = batch_send, exchange
    return forward, sent[0] - forward


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("method, heads, kv_heads", [("ring", 4, 2), ("ring", 4, 1), ("ulysses", 4, 4),
                                                     ("ulysses", 4, 2)])
def test_planner_prices_the_bytes_sent(dist, cp, method, heads, kv_heads):
    """zero3d plan's per-layer bytes (parallel3d/planner/context.py) are what the attention sends."""
    from parallel3d.planner.context import AttentionShape, context_cost

    cost = context_cost(method, cp, LENGTH, 2, AttentionShape(heads, kv_heads, DIM), 8)
    for forward, backward in dist.run(cp, _bytes_sent, method, heads, kv_heads):
        assert (forward, backward) == (cost.forward_bytes, cost.backward_bytes)


def test_plan_table_refuses_ulysses_beyond_the_heads():
    from transformers import LlamaConfig

    from parallel3d.planner.context import context_table
    from parallel3d.planner.hardware import Link

    config = LlamaConfig(hidden_size=96, num_attention_heads=12, num_key_value_heads=4, num_hidden_layers=2)
    lines = context_table(config, 8, 4096, 1, 1, 2, Link(100e9, 5e-6)).splitlines()
    assert lines[2].startswith("ulysses  refused: 12 attention heads per tensor-parallel rank do not divide by "
                               "context_parallel.size 8")
    # k/v: 2 x 512 tokens x 4 kv heads x 8 dims, 7 hops at 2 bytes forward; backward those and
    # 8 hops of dk/dv at 4 bytes (float32)
    assert lines[3].split()[:3] == ["ring", "0.46", "1.51"]


def _bf16_against_float32() -> list[bool]:
    """The ring on bf16 inputs (k and v sent as bf16) against the ring on the same values in float32:
    it computes in float32 either way, so outputs and gradients agree once rounded to bf16."""
    import torch.distributed as dist

    from parallel3d.context_parallel.ring import RingAttention, ring_index

    q, k, v, grad = (t.to(torch.bfloat16) for t in _inputs(4, 2))
    index = ring_index(dist.get_rank(), dist.get_world_size(), LENGTH)
    results = []
    for dtype in (torch.bfloat16, torch.float32):
        mine = [t[:, :, index].to(dtype).requires_grad_() for t in (q, k, v)]
        out, _ = RingAttention(dist.group.WORLD, "test")(_Module(), *mine, None, sliding_window=7, scaling=0.3)
        out.backward(grad[:, index].to(dtype))
        results.append([out.detach(), *(t.grad for t in mine)])
    return [torch.equal(half, full.to(torch.bfloat16)) and half.dtype == torch.bfloat16 for half, full in zip(*results)]


def test_bf16_travels_as_bf16_and_computes_in_float32(dist):
    for same in dist.run(2, _bf16_against_float32):
        assert same == [True, True, True, True]

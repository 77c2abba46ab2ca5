"""ZeRO++'s int8 collectives (zero/quantized_comm.py): exact against their definition, the bytes they
move, and the config's rules."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from parallel3d.runtime.comm_counter import count_collectives
from parallel3d.config.config import load_config
from parallel3d.errors import ConfigError
from tests.tiny import ds_config, make_model, rank_micro_batches, token_batches
from zero.quantized_comm import BLOCK, dequantize, gather_shards_int8, quantize, reduce_to_shard_int8


def test_quantization_error_is_at_most_half_a_step_of_each_block():
    x = torch.randn(3 * BLOCK + 17, dtype=torch.float64) * torch.logspace(-3, 2, 3 * BLOCK + 17, dtype=torch.float64)
    values, scales = quantize(x)
    assert values.dtype == torch.int8 and scales.numel() == 4
    error = (dequantize(values, scales).double() - x).abs()
    step = scales.double().repeat_interleave(BLOCK)[: x.numel()]
    # the scale is computed in fp32, so allow its rounding on top of half a step
    assert bool((error <= step * (0.5 + 1e-6) + x.abs() * 2**-23).all())
    assert torch.equal(dequantize(*quantize(torch.zeros(5))), torch.zeros(5))  # an all-zero block stays zero


def _shard_data(rank: int, n: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(100 + rank))


def _collectives(n: int) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    full = torch.empty(world * n)
    gather_shards_int8(full, _shard_data(rank, n), None).wait()
    want_full = torch.cat([dequantize(*quantize(_shard_data(r, n))) for r in range(world)])
    grads = [torch.randn(world * n, generator=torch.Generator().manual_seed(7 + r)) for r in range(world)]
    shard = torch.ones(n)
    reduce_to_shard_int8(grads[rank].clone(), shard, None, accumulate=True).wait()
    chunks = [dequantize(*quantize(g.view(world, n)[rank])) for g in grads]
    want_shard = 1 + sum(chunks) / world
    return {"gather": torch.equal(full, want_full), "reduce": (shard - want_shard).abs().max().item()}


@pytest.mark.parametrize("n", [BLOCK * 2, 300])
def test_gather_and_reduce_equal_their_definition(dist, n):
    for result in dist.run(2, _collectives, n):
        assert result["gather"]
        assert result["reduce"] < 1e-6  # the same fp32 sum, possibly in another order


def _step_bytes(quantized: bool) -> dict:
    import parallel3d

    config = ds_config(3, 1, 2, stage3_param_persistence_threshold=0, reduce_bucket_size=3000,
                       zero_quantized_weights=quantized, zero_quantized_gradients=quantized)
    engine, _, _, _ = parallel3d.initialize(model=make_model("llama"), config=config)
    data = iter(rank_micro_batches(token_batches(2, 1, 2), engine.mesh.local_rank("dp")))
    engine.train_batch(data)  # the first step records stage 3's fetch order
    with count_collectives(engine.mesh) as counter:
        loss = engine.train_batch(data)
    gathers = [c for c in counter.calls if c.op == "broadcast"]
    # gradients: gloo's reduce-scatter is an all-reduce of the full buffer; qgZ's is all-to-alls (the
    # scales' small ones included); left out: the few-element all-reduces of flags and the token check
    reduces = [c for c in counter.calls if c.op == "all_to_all" or (c.op == "all_reduce" and c.numel > 64)]
    return {"loss": loss, "gather": [c.numel for c in gathers], "gather_bytes": sum(c.nbytes for c in gathers),
            "reduce_bytes": sum(c.nbytes for c in reduces)}


def test_int8_collectives_move_a_quarter_of_fp32s_bytes(dist):
    full = dist.run(2, _step_bytes, False)[0]
    int8 = dist.run(2, _step_bytes, True)[0]
    # each fp32 chunk of n elements becomes n int8 values and ceil(n / BLOCK) fp32 scales
    assert int8["gather_bytes"] == sum(n + 4 * -(-n // BLOCK) for n in full["gather"])
    assert 0.25 < int8["gather_bytes"] / full["gather_bytes"] < 0.26
    assert 0.25 < int8["reduce_bytes"] / full["reduce_bytes"] < 0.26
    assert int8["loss"] == pytest.approx(full["loss"], rel=1e-2)  # int8 weights and gradients: close, not equal


@pytest.mark.parametrize("zero, message", [
    ({"stage": 2, "zero_quantized_weights": True}, "zero_quantized_weights needs ZeRO stage 3"),
    ({"stage": 0, "zero_quantized_gradients": True}, "zero_quantized_gradients needs ZeRO stage 1, 2 or 3"),
])
def test_quantized_collectives_need_their_stage(zero, message):
    with pytest.raises(ConfigError, match=message):
        load_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero}, 2)


def _losses(stage: int, quantized: bool, dp: int = 2) -> list[float]:
    import parallel3d

    config = ds_config(stage, 2, dp, reduce_bucket_size=3000, zero_quantized_gradients=quantized)
    engine, _, _, _ = parallel3d.initialize(model=make_model("llama"), config=config)
    data = iter(rank_micro_batches(token_batches(3, 2, dp), engine.mesh.local_rank("dp")))
    return [engine.train_batch(data) for _ in range(3)]


@pytest.mark.parametrize("stage", [1, 2])
def test_int8_gradients_at_stages_1_and_2(dist, stage):
    """Stage 1 reduces the window's full gradient into the shard it aliases, stage 2 each
    micro-batch's into an accumulating shard: both through the int8 all-to-all."""
    full = dist.run(2, _losses, stage, False)[0]
    int8 = dist.run(2, _losses, stage, True)[0]
    assert int8 != full  # the int8 path ran
    assert int8 == pytest.approx(full, rel=1e-2)


def _two_hop_reduce(n: int) -> float:
    """4 ranks as 2 nodes of 2: qgZ's two hops against their definition (each hop quantizes
    what it sends, row by row: inside the node a row holds the chunks of one place on every node)."""
    rank, world, local = dist.get_rank(), dist.get_world_size(), 2
    nodes = world // local
    node, _ = dist.new_subgroups_by_enumeration([[0, 1], [2, 3]])
    across, _ = dist.new_subgroups_by_enumeration([[0, 2], [1, 3]])
    grads = [torch.randn(world * n, generator=torch.Generator().manual_seed(7 + r)) for r in range(world)]
    shard = torch.ones(n)
    reduce_to_shard_int8(grads[rank].clone(), shard, dist.group.WORLD, accumulate=True,
                         hops=(dist.group.WORLD, node, across)).wait()
    place, mine = rank % local, rank // local

    def row(g: torch.Tensor) -> torch.Tensor:  # the chunks of ``place`` on every node, as sent in the node
        return dequantize(*quantize(g.view(nodes, local, n)[:, place].reshape(-1)))

    node_sums = [sum(row(grads[a * local + i]) for i in range(local)).view(nodes, n) for a in range(nodes)]
    want = 1 + sum(dequantize(*quantize(node_sums[a][mine])) for a in range(nodes)) / world
    exact = sum(g.view(world, n)[rank] for g in grads) / world  # the mean without rounding
    return (shard - want).abs().max().item(), ((shard - 1 - exact).norm() / exact.norm()).item()


def test_two_hops_equal_their_definition(dist):
    for error, rounding in dist.run(4, _two_hop_reduce, 300):
        assert error < 1e-6
        # and the mean they compute: two roundings of at most half a step of 1/127 of a block's
        # largest value each (a wrong divisor or a chunk sent to the wrong rank is far outside)
        assert rounding < 0.02


def _node_step(local_world: str | None, stage: int) -> dict:
    import os

    import parallel3d

    saved = os.environ.get("LOCAL_WORLD_SIZE")
    os.environ.pop("LOCAL_WORLD_SIZE", None)
    if local_world is not None:
        os.environ["LOCAL_WORLD_SIZE"] = local_world
    try:
        config = ds_config(stage, 2, 4, reduce_bucket_size=3000, zero_quantized_gradients=True)
        engine, _, _, _ = parallel3d.initialize(model=make_model("llama"), config=config)
    finally:
        os.environ.pop("LOCAL_WORLD_SIZE", None)
        if saved is not None:
            os.environ["LOCAL_WORLD_SIZE"] = saved
    data = iter(rank_micro_batches(token_batches(3, 2, 4), engine.mesh.local_rank("dp")))
    losses = [engine.train_batch(data)]
    with count_collectives(engine.mesh) as counter:
        losses.append(engine.train_batch(data))
    losses.append(engine.train_batch(data))
    moved = {}
    for call in counter.calls:
        if call.op == "all_to_all":
            moved[call.group] = moved.get(call.group, 0) + call.nbytes
    return {"losses": losses, "moved": moved, "two_hops": engine.mesh.groups.zero_node is not None}


@pytest.mark.parametrize("stage", [2, 3])
def test_gradients_cross_nodes_once_per_node_peer(dist, stage):
    """On 2 nodes of 2 ranks (``LOCAL_WORLD_SIZE`` 2) the int8 reduction takes two hops: the
    all-to-all across nodes carries half of what the one-hop all-to-all carries over all four
    ranks (one chunk per node instead of one per rank, scales included), and the losses stay
    those of the full-precision reduction to int8's accuracy."""
    one_node = dist.run(4, _node_step, "4", stage)
    two_nodes = dist.run(4, _node_step, "2", stage)
    exact = dist.run(4, _losses, stage, False, 4)[0]
    for one, two in zip(one_node, two_nodes):
        assert two["two_hops"] and not one["two_hops"]
        assert set(two["moved"]) == {"node", "across_nodes"} and set(one["moved"]) == {"dp"}
        assert two["moved"]["across_nodes"] == pytest.approx(one["moved"]["dp"] / 2, rel=0.02)
        assert two["losses"] != one["losses"]  # another rounding: the two-hop path ran
        assert two["losses"] == pytest.approx(exact, rel=1e-2)

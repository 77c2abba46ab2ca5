"""ZeRO++'s hpZ (``zero_hpz_partition_size``): stage 3 keeps a second partition of each block's
parameters from its forward to its backward, whose gather then stays inside a small group."""

from __future__ import annotations

import pytest
import torch

from parallel3d.runtime.comm_counter import count_collectives
from parallel3d.config.config import load_config
from parallel3d.errors import ConfigError
from tests.test_hybrid_sharding import GAS, STEPS, _config, oracle
from tests.tiny import make_model, max_rel_param_error, rank_micro_batches, token_batches


def _train(hpz: int, zero: dict) -> dict:
    import parallel3d

    config = _config(3, 4, zero.pop("mics_shard_size", 4))
    config["zero_optimization"].update(zero_hpz_partition_size=hpz, **zero)
    engine, _, _, _ = parallel3d.initialize(model=make_model("llama"), config=config)
    data_iter = iter(rank_micro_batches(token_batches(STEPS, GAS, 4), engine.mesh.local_rank("dp")))
    losses = [engine.train_batch(data_iter)]
    with count_collectives(engine.mesh) as counter:
        losses.append(engine.train_batch(data_iter))
    losses += [engine.train_batch(data_iter) for _ in range(STEPS - 2)]
    gathers = {}
    for call in counter.calls:
        if call.op == "broadcast":  # gloo's all-gather (zero/comm.py)
            gathers[call.group] = gathers.get(call.group, 0) + call.numel
    return {"losses": losses, "params": engine.full_parameters(), "gathers": gathers,
            "kept": len(engine.optimizer.fetcher._secondary)}


@pytest.mark.parametrize("zero", [{}, {"zero_quantized_weights": True}, {"mics_shard_size": 2, "hpz": 2}],
                         ids=["fp32", "int8-gathers", "hybrid-2x2"])
def test_backward_gathers_the_same_values_inside_the_group(dist, zero):
    zero = dict(zero)
    hpz = zero.pop("hpz", 2)
    plain = dist.run(4, _train, 1, dict(zero))
    with_hpz = dist.run(4, _train, hpz, dict(zero))
    for a, b in zip(plain, with_hpz):
        assert b["losses"] == a["losses"]  # the same weights in backward, to the bit
        for name, value in a["params"].items():
            assert torch.equal(b["params"][name], value), name
        assert b["kept"] == 0  # every secondary copy is dropped once its block's backward is done
        if zero.get("mics_shard_size") == 2:
            continue  # the group of 2 is the shard group itself: the gather volume moves, not its group
        # forward gathers every block over the 4 shard ranks, backward inside the pair
        assert set(b["gathers"]) == {"dp", "hpz"} and set(a["gathers"]) == {"dp"}
        if not zero:  # int8 gathers also move scales forward; the backward copy is in the working precision
            assert b["gathers"]["dp"] + b["gathers"]["hpz"] == a["gathers"]["dp"]
    if not zero:
        want_losses, want_params = oracle(4, 1)
        for run in with_hpz:
            assert run["losses"] == pytest.approx(want_losses, rel=1e-5)
            assert max_rel_param_error(run["params"], want_params)[0] < 1e-5


@pytest.mark.parametrize("zero, world, message", [
    ({"stage": 2, "zero_hpz_partition_size": 2}, 4, "zero_hpz_partition_size 2 needs ZeRO stage 3"),
    ({"stage": 3, "zero_hpz_partition_size": 3}, 4, "zero_hpz_partition_size 3 does not divide the 4 ranks"),
    ({"stage": 3, "zero_hpz_partition_size": 4, "mics_shard_size": 2}, 4,
     "zero_hpz_partition_size 4 does not divide the 2 ranks"),
])
def test_bad_partition_sizes_are_refused(zero, world, message):
    with pytest.raises(ConfigError, match=message):
        load_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero}, world)


def _train_pipelined(hpz: int, schedule: str) -> dict:
    """pp 2 x dp 4 at stage 3 (8 ranks), hpZ over pairs of the 4 shard ranks."""
    import parallel3d

    config = _config(3, 4, 4, pp=2)
    config["pipeline"]["schedule"] = schedule
    config["zero_optimization"]["zero_hpz_partition_size"] = hpz
    engine, _, _, _ = parallel3d.initialize(model=make_model("llama", num_hidden_layers=4), config=config)
    data_iter = iter(rank_micro_batches(token_batches(STEPS, GAS, 4), engine.mesh.local_rank("dp")))
    losses = [engine.train_batch(data_iter)]
    with count_collectives(engine.mesh) as counter:
        losses.append(engine.train_batch(data_iter))
    losses += [engine.train_batch(data_iter) for _ in range(STEPS - 2)]
    groups = {call.group for call in counter.calls if call.op == "broadcast"}  # gloo's all-gather
    return {"losses": losses, "params": engine.full_parameters(), "groups": groups,
            "kept": len(engine.optimizer.fetcher._secondary)}


@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1"])
def test_pipeline_stages_gather_from_the_secondary_copy(dist, schedule):
    """Under pipeline stages a block's forwards and backwards of the step's micro-batches
    interleave: each gathers from the copy kept since its first forward (the same values, to the
    bit), which is dropped at the step's end."""
    plain = dist.run(8, _train_pipelined, 1, schedule)
    with_hpz = dist.run(8, _train_pipelined, 2, schedule)
    for a, b in zip(plain, with_hpz):
        assert b["losses"] == a["losses"]
        assert b["params"].keys() == a["params"].keys()
        for name, value in a["params"].items():
            assert torch.equal(b["params"][name], value), name
        assert b["kept"] == 0
        assert "hpz" in b["groups"] and "hpz" not in a["groups"]

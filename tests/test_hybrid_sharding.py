"""Hybrid sharding (``zero_optimization.mics_shard_size``): ZeRO inside groups of S data-parallel
ranks, replicas across them, against the single-process AdamW oracle (fp32), with tp and pp."""

from __future__ import annotations

import functools

import pytest
import torch

from parallel3d.runtime.comm_counter import count_collectives
from parallel3d.config.config import load_config
from parallel3d.errors import ConfigError
from tests.tiny import ds_config, make_model, max_rel_param_error, oracle_run, rank_micro_batches, token_batches

STEPS, GAS = 4, 2
RTOL = 1e-5


def _config(stage: int, dp: int, shard: int, tp: int = 1, pp: int = 1) -> dict:
    config = ds_config(stage, GAS, dp, stage3_param_persistence_threshold=0, reduce_bucket_size=3000,
                       mics_shard_size=shard)
    if tp > 1:
        config["tensor_parallel"] = {"size": tp}
    if pp > 1:
        config["pipeline"] = {"stages": pp, "schedule": "1f1b"}
    return config


def _model(pp: int):
    return make_model("llama", num_hidden_layers=4) if pp > 1 else make_model("llama")


def train(stage: int, dp: int, shard: int, tp: int = 1, pp: int = 1) -> tuple[list[float], dict, dict]:
    import parallel3d

    engine, _, _, _ = parallel3d.initialize(model=_model(pp), config=_config(stage, dp, shard, tp, pp))
    assert (engine.mesh.size("dp_shard"), engine.mesh.size("dp_replicate")) == (shard, dp // shard)
    data_iter = iter(rank_micro_batches(token_batches(STEPS, GAS, dp), engine.mesh.local_rank("dp")))
    losses = [engine.train_batch(data_iter) for _ in range(STEPS)]
    return losses, engine.full_parameters(), engine.memory_report()


@functools.cache
def oracle(dp: int, pp: int):
    return oracle_run("llama", token_batches(STEPS, GAS, dp), model=_model(pp))


def _assert_matches(results, dp: int, pp: int) -> None:
    want_losses, want_params = oracle(dp, pp)
    seen = set()
    for losses, params, _ in results:
        assert losses == pytest.approx(want_losses, rel=RTOL)
        err, name = max_rel_param_error(params, {n: want_params[n] for n in params})
        assert err < RTOL, f"{name} differs by {err:.2e}"
        seen |= set(params)
    assert seen == set(want_params)


@pytest.mark.parametrize("stage,shard", [(1, 2), (2, 2), (3, 2), (3, 1)])
def test_two_replicas_of_two_match_single_process(dist, stage, shard):
    _assert_matches(dist.run(4, train, stage, 4, shard), dp=4, pp=1)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_two_replicas_of_four_match_single_process(dist, stage):
    _assert_matches(dist.run(8, train, stage, 8, 4), dp=8, pp=1)


@pytest.mark.parametrize("stage,tp,pp", [(3, 2, 1), (2, 1, 2)])
def test_hybrid_sharding_with_tp_and_pp_on_8_ranks(dist, stage, tp, pp):
    dp = 8 // (tp * pp)
    _assert_matches(dist.run(8, train, stage, dp, 2, tp, pp), dp=dp, pp=pp)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_model_state_bytes_are_those_of_flat_zero_over_the_shard_group(dist, stage):
    """4 ranks as 2 x 2 hold per rank what flat ZeRO over 2 ranks holds (the formula with S for dp)."""
    hybrid = dist.run(4, train, stage, 4, 2)
    flat = dist.run(2, train, stage, 2, 2)
    keys = ("params", "gradients", "master_params", "optimizer_states")
    for rank, (_, _, report) in enumerate(hybrid):
        assert {k: report[k] for k in keys} == {k: flat[rank % 2][2][k] for k in keys}


def _one_step_volumes(stage: int, dp: int = 4) -> dict:
    import parallel3d

    engine, _, _, _ = parallel3d.initialize(model=make_model("llama"), config=_config(stage, dp, 2))
    data_iter = iter(rank_micro_batches(token_batches(2, GAS, dp), engine.mesh.local_rank("dp")))
    engine.train_batch(data_iter)  # stage 3 records its fetch order in the first step
    with count_collectives(engine.mesh) as counter:
        engine.train_batch(data_iter)
    across = sum(c.nbytes for c in counter.calls if c.group == "dp_replicate")
    units = engine.optimizer.units
    shards = sum(u.shard_size for u in units) * 4  # fp32 gradient shards
    flags = sum(len(u.params) for u in units) * 4  # which params got gradients: one int32 each
    inside = {c.group for c in counter.calls if c.op in ("all_gather", "broadcast", "reduce_scatter")}
    shard_group = "dp_shard" if dp > 2 else "dp"  # flat over 2: the one data-parallel group
    in_group = {op: sum(c.numel for c in counter.calls if c.group == shard_group and c.op == op and c.numel > 2)
                for op in ("all_reduce", "broadcast")}  # gloo's reduce-scatter and gather (zero/comm.py)
    return {"across": across, "expected": shards + flags, "gather_groups": inside, "in_group": in_group}


@pytest.mark.parametrize("stage", [2, 3])
def test_replicas_exchange_one_gradient_shard_per_step(dist, stage):
    for result in dist.run(4, _one_step_volumes, stage):
        assert result["across"] == result["expected"]  # 1/S of the gradient and the received flags
        assert "dp_replicate" not in result["gather_groups"]  # parameters are gathered inside a group
    # inside a group: the elements flat ZeRO over 2 ranks moves (reductions, gathers), no more
    flat = dist.run(2, _one_step_volumes, stage, 2)[0]
    hybrid = dist.run(4, _one_step_volumes, stage)[0]
    assert hybrid["in_group"] == flat["in_group"] and hybrid["in_group"]["broadcast"] > 0


@pytest.mark.parametrize("zero, world, message", [
    ({"stage": 2, "mics_shard_size": 3}, 4, "mics_shard_size 3 does not divide the data-parallel size 4"),
    ({"stage": 0, "mics_shard_size": 2}, 4, "mics_shard_size 2 needs ZeRO stage 1, 2 or 3"),
    ({"stage": 3, "mics_shard_size": 0}, 4, "must be -1 .* or a positive number of ranks, got 0"),
    ({"stage": 3, "mics_shard_size": 1, "offload_param": {"device": "cpu"}}, 4, "needs at least 2 ranks to shard over"),
    ({"stage": 3, "mics_shard_size": 2, "mics_hierarchical_params_gather": True}, 4,
     "mics_hierarchical_params_gather.*is not supported"),
])
def test_bad_shard_sizes_are_refused(zero, world, message):
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero}
    with pytest.raises(ConfigError, match=message):
        load_config(config, world)


def test_a_shard_size_of_all_ranks_is_flat_zero():
    config = load_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3, "mics_shard_size": 4}}, 4)
    assert config.zero_optimization.shard_size(config.data_parallel_size) == 4
    assert load_config({"train_micro_batch_size_per_gpu": 1}, 4).zero_optimization.shard_size(4) == 4


def _summed_norm_ratio(stage: int) -> float:
    """The gradient norm the step sees with gradient_allreduce_op "sum" over the one with "mean"."""
    import parallel3d

    norms = []
    for op in ("sum", "mean"):
        config = ds_config(stage, 1, 2, stage3_param_persistence_threshold=0)
        config.update(gradient_allreduce_op=op, context_parallel={"size": 2})
        engine, _, _, _ = parallel3d.initialize(model=make_model("llama"), config=config)
        engine.train_batch(iter(rank_micro_batches(token_batches(1, 1, 2), engine.mesh.local_rank("dp"))))
        norms.append(engine.optimizer.last_grad_norm)
    return norms[0] / norms[1]


@pytest.mark.parametrize("stage", [1, 3])
def test_a_summed_gradient_counts_data_parallel_ranks_not_context_parallel_ones(dist, stage):
    """dp 2 x cp 2: ZeRO shards over all four ranks, but the sum is over the two given different data."""
    for ratio in dist.run(4, _summed_norm_ratio, stage):
        assert ratio == pytest.approx(2.0, rel=1e-6)


@pytest.mark.parametrize("stage,zero", [
    (2, {"offload_optimizer": {"device": "cpu"}}),
    (3, {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"},
         "stage3_param_persistence_threshold": 0}),
], ids=["z2-optimizer", "z3-both"])
def test_hybrid_sharding_with_offload_matches_single_process(dist, stage, zero):
    from tests.test_zero_parity import GAS as PARITY_GAS, oracle as parity_oracle, train_ranks

    assert PARITY_GAS == 2
    results = dist.run(4, train_ranks, "llama", stage, 4, {**zero, "reduce_bucket_size": 3000, "mics_shard_size": 2})
    want_losses, want_params = parity_oracle("llama", 4)
    for losses, params in results:
        assert losses == pytest.approx(want_losses, rel=RTOL)
        err, name = max_rel_param_error(params, want_params)
        assert err < RTOL, f"{name} differs by {err:.2e}"


def _fp16_run(shard: int) -> dict:
    """fp16 with a loss scale that overflows at first: the skipped steps and the scales."""
    import parallel3d

    config = _config(3, 4, shard)
    config["fp16"] = {"enabled": True, "initial_scale_power": 21, "hysteresis": 1}
    engine, _, _, _ = parallel3d.initialize(model=make_model("llama"), config=config)
    data_iter = iter(rank_micro_batches(token_batches(STEPS, GAS, 4), engine.mesh.local_rank("dp")))
    losses, scales = [], []
    for _ in range(STEPS):
        losses.append(engine.train_batch(data_iter))
        scales.append(engine.optimizer.loss_scale)
    return {"losses": losses, "scales": scales, "skipped": engine.skipped_steps, "params": engine.full_parameters()}


def test_fp16_overflows_are_skipped_alike_on_every_replica(dist):
    """The replicas average their shards before the overflow check, so every rank skips the same
    steps as flat ZeRO over the 4 ranks and they all hold the same parameters."""
    flat = dist.run(4, _fp16_run, 4)
    hybrid = dist.run(4, _fp16_run, 2)
    assert hybrid[0]["skipped"] > 0, "the run was meant to overflow at first"
    for run in hybrid:
        assert (run["scales"], run["skipped"]) == (flat[0]["scales"], flat[0]["skipped"])
        assert run["losses"] == pytest.approx(flat[0]["losses"], rel=1e-3)
        for name, value in run["params"].items():
            assert torch.equal(value, hybrid[0]["params"][name]), name


def _saved_chunks() -> tuple[int, int]:
    import parallel3d
    from parallel3d.checkpoint.checkpoint import _chunks_to_save

    engine, _, _, _ = parallel3d.initialize(model=make_model("llama"), config=_config(2, 4, 2))
    engine.train_batch(iter(rank_micro_batches(token_batches(1, GAS, 4), engine.mesh.local_rank("dp"))))
    return engine.mesh.local_rank("dp_replicate"), len(_chunks_to_save(engine.parallel))


def test_only_the_first_replica_writes_checkpoint_chunks(dist):
    written = dist.run(4, _saved_chunks)
    assert all((count > 0) == (replica == 0) for replica, count in written)


def _train_composed(kind: str) -> tuple[list[float], dict]:
    """2 replicas x 2 at stage 3, started from the meta device (each rank fills in its shards with
    eager init's values), or under tp 2 with sequence parallelism (8 ranks)."""
    import parallel3d

    tp = 2 if kind == "sequence_parallel" else 1
    dp = torch.distributed.get_world_size() // tp
    config = _config(3, dp, 2, tp)
    if tp > 1:
        config["tensor_parallel"]["sequence_parallel"] = True
    if kind == "meta":
        with torch.device("meta"):
            model = make_model("llama")
    else:
        model = make_model("llama")
    engine, _, _, _ = parallel3d.initialize(model=model, config=config)
    data_iter = iter(rank_micro_batches(token_batches(STEPS, GAS, dp), engine.mesh.local_rank("dp")))
    return [engine.train_batch(data_iter) for _ in range(STEPS)], engine.full_parameters()


@pytest.mark.parametrize("kind,world", [("meta", 4), ("sequence_parallel", 8)])
def test_hybrid_sharding_from_the_meta_device_and_with_sequence_parallelism(dist, kind, world):
    _assert_matches([(*r, None) for r in dist.run(world, _train_composed, kind)], dp=4, pp=1)

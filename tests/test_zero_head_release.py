"""ZeRO-3's untied head frees its gathered weight inside its backward, before the weight
gradient is made (zero/head.py): the weight's unit is already released (its param a shape-only
placeholder, strides (0, 0)) when the gradient reaches it, and training is bit for bit the same
as with the weight kept until the gradient is reduced. Where it does not apply (a tied head,
zb_h1's split backward, ZeRO-2) the weight is whole when its gradient arrives."""

from __future__ import annotations

import pytest
import torch

from tests.tiny import ds_config, make_model, rank_micro_batches, token_batches

STEPS, GAS = 2, 2


def _train(stage: int, tied: bool, pp: int, schedule: str, early: bool) -> dict:
    import parallel3d
    import parallel3d.apply as apply

    world = torch.distributed.get_world_size()
    dp = world // pp
    config = ds_config(stage, GAS, dp, stage3_param_persistence_threshold=0)
    if pp > 1:
        config["pipeline"] = {"stages": pp, "schedule": schedule}
    model = make_model("llama", num_hidden_layers=4, tie_word_embeddings=tied)
    chooser = apply._heads_released_early
    if not early:  # the comparison run: the weight kept whole until its gradient is reduced
        apply._heads_released_early = lambda heads, pipe, schedule: []
    try:
        engine, *_ = parallel3d.initialize(model=model, config=config)
    finally:  # the worker process serves later tests
        apply._heads_released_early = chooser
    head = engine.module.get_output_embeddings()
    strides = []
    if head is not None and any(p is head.weight for p in engine.module.parameters()):
        head.weight.register_hook(lambda g: strides.append(tuple(head.weight.stride())))
    data = token_batches(STEPS, GAS, dp)
    dp_rank = engine.mesh.local_rank("dp")
    losses = [engine.train_batch(iter(rank_micro_batches(data[s : s + 1], dp_rank))) for s in range(STEPS)]
    return {"losses": losses, "params": engine.full_parameters(), "strides": strides,
            "released_early": [(0, 0) == st for st in strides]}


CASES = {
    "dp2 z3 untied": (3, False, 1, "1f1b", True),
    "pp2 x dp2 z3 untied 1f1b": (3, False, 2, "1f1b", True),
    "pp2 x dp2 z3 untied zb_h1": (3, False, 2, "zb_h1", False),
    "dp2 z3 tied": (3, True, 1, "1f1b", False),
    "dp2 z2 untied": (2, False, 1, "1f1b", False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_head_weight_is_freed_before_its_gradient(dist, case):
    stage, tied, pp, schedule, expect_early = CASES[case]
    world = 2 * pp
    got = dist.run(world, _train, stage, tied, pp, schedule, True)
    kept = dist.run(world, _train, stage, tied, pp, schedule, False)
    holders = [r for r in got if r["strides"]]
    assert holders, "no rank saw the head's gradient"
    for r in holders:
        assert all(flag == expect_early for flag in r["released_early"]), r["strides"]
        assert len(r["strides"]) == STEPS * GAS
    for mine, theirs in zip(got, kept):
        assert mine["losses"] == theirs["losses"]
        assert all(torch.equal(mine["params"][n], theirs["params"][n]) for n in theirs["params"])
    for r in kept:
        assert not any(r["released_early"])

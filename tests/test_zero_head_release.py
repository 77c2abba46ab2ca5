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


def _twice(model):
    """The model with its head called twice per forward (logits in two chunks of the sequence)."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    def forward(input_ids=None, labels=None, **kwargs):
        h = model.model(input_ids=input_ids, **kwargs).last_hidden_state
        half = h.shape[1] // 2
        logits = torch.cat([model.lm_head(h[:, :half]), model.lm_head(h[:, half:])], dim=1)
        loss = model.loss_function(logits=logits, labels=labels, vocab_size=model.config.vocab_size)
        return CausalLMOutputWithPast(loss=loss, logits=logits)

    model.forward = forward
    return model


def _train(stage: int, tied: bool, pp: int, schedule: str, early: bool, twice: bool = False) -> dict:
    import parallel3d
    import parallel3d.build.apply as apply

    world = torch.distributed.get_world_size()
    dp = world // pp
    config = ds_config(stage, GAS, dp, stage3_param_persistence_threshold=0)
    if pp > 1:
        config["pipeline"] = {"stages": pp, "schedule": schedule}
    model = make_model("llama", num_hidden_layers=4, tie_word_embeddings=tied)
    if twice:
        model = _twice(model)
    chooser = apply._heads_released_early
    if not early:  # the comparison run: the weight kept whole until its gradient is reduced
        apply._heads_released_early = lambda heads, pipe, schedule: []
    try:
        engine, *_ = parallel3d.initialize(model=model, config=config)
    finally:  # the worker process serves later tests
        apply._heads_released_early = chooser
    head = engine.module.get_output_embeddings()
    fetcher, gathers = engine.optimizer.fetcher, []
    if fetcher is not None:  # count the all-gathers of the head's units
        head_units = {id(u) for m, us in fetcher.module_units if m is head for u in us}
        start = fetcher._start_gather

        def counting(unit):
            if id(unit) in head_units and not unit.is_materialized and id(unit) not in fetcher._in_flight:
                gathers.append(1)
            start(unit)

        fetcher._start_gather = counting
    strides = []
    if head is not None and any(p is head.weight for p in engine.module.parameters()):
        head.weight.register_hook(lambda g: strides.append(tuple(head.weight.stride())))
    data = token_batches(STEPS, GAS, dp)
    dp_rank = engine.mesh.local_rank("dp")
    losses = [engine.train_batch(iter(rank_micro_batches(data[s : s + 1], dp_rank))) for s in range(STEPS)]
    return {"losses": losses, "params": engine.full_parameters(), "strides": strides, "head_gathers": len(gathers),
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


def test_a_head_used_twice_is_freed_once_its_last_use_is_done(dist):
    """Two uses of the head in one forward: the first use's backward keeps the weight (the second
    needs it and would gather it again), the second frees it before the weight gradient (which
    autograd sums over both uses); one gather per micro-batch, and training is the same as with
    the weight kept."""
    got = dist.run(2, _train, 3, False, 1, "1f1b", True, True)
    kept = dist.run(2, _train, 3, False, 1, "1f1b", False, True)
    for mine, theirs in zip(got, kept):
        assert all(mine["released_early"]) and len(mine["strides"]) == STEPS * GAS, mine["strides"]
        assert mine["head_gathers"] == theirs["head_gathers"] == STEPS * GAS
        assert not any(theirs["released_early"])
        assert mine["losses"] == theirs["losses"]
        assert all(torch.equal(mine["params"][n], theirs["params"][n]) for n in theirs["params"])

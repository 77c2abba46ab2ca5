"""ZeRO stages 0-3 at dp 2 and 4 against the single-process AdamW oracle (fp32)."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed

from tests.tiny import (
    make_model,
    max_rel_param_error,
    oracle_run,
    rank_micro_batches,
    token_batches,
    ds_config,
    train_micro_steps,
)

STEPS, GAS = 5, 2
RTOL = 1e-5


def train_ranks(kind: str, stage: int, dp: int, zero_extra: dict, checkpointing: bool = False) -> tuple[list[float], dict]:
    """On every rank: train STEPS steps through the DeepSpeed-style loop; return losses and params."""
    import parallel3d

    model = make_model(kind)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    engine, _, _, _ = parallel3d.initialize(model=model, config=ds_config(stage, GAS, dp, **zero_extra))
    rank = torch.distributed.get_rank()
    batches = rank_micro_batches(token_batches(STEPS, GAS, dp), rank)
    losses = train_micro_steps(engine, batches, STEPS, GAS)
    assert engine.global_steps == STEPS
    return losses, engine.full_parameters()


@functools.cache
def oracle(kind: str, dp: int):
    return oracle_run(kind, token_batches(STEPS, GAS, dp))


# Stage 3 is run with the persistence threshold at 0 (every param sharded and gathered)
# and with DeepSpeed's default (the tiny models' small params stay whole).
CASES = [
    (kind, stage, dp, extra)
    for kind in ("llama", "gpt2")
    for dp in (2, 4)
    for stage, extra in (
        (0, {}),
        (1, {}),
        (2, {"reduce_bucket_size": 3000}),
        (3, {"stage3_param_persistence_threshold": 0, "reduce_bucket_size": 3000}),
    )
] + [("llama", 3, 2, {"stage3_param_persistence_threshold": 1000}), ("gpt2", 2, 2, {"overlap_comm": False})]


@pytest.mark.parametrize("kind,stage,dp,extra", CASES, ids=lambda v: str(v).replace(" ", ""))
def test_matches_single_process(dist, kind, stage, dp, extra):
    results = dist.run(dp, train_ranks, kind, stage, dp, extra)
    want_losses, want_params = oracle(kind, dp)
    for rank_losses, params in results:
        assert rank_losses == pytest.approx(want_losses, rel=RTOL)
        err, name = max_rel_param_error(params, want_params)
        assert err < RTOL, f"{name} differs by {err:.2e} (relative to its largest entry)"


@pytest.mark.parametrize("stage", [2, 3])
def test_hf_activation_checkpointing(dist, stage):
    """Blocks re-run forward inside backward; stage 3 must keep them gathered for it."""
    results = dist.run(2, train_ranks, "llama", stage, 2, {"stage3_param_persistence_threshold": 0}, True)
    want_losses, want_params = oracle("llama", 2)
    for losses, params in results:
        assert losses == pytest.approx(want_losses, rel=RTOL)
        assert max_rel_param_error(params, want_params)[0] < RTOL


def test_train_batch_equals_manual_loop(dist):
    """train_batch consumes gradient_accumulation_steps micro-batches and returns the dp-mean loss."""
    results = dist.run(2, _train_batch_losses)
    want_losses, want_params = oracle("llama", 2)
    for losses, params in results:
        assert losses == pytest.approx(want_losses, rel=RTOL)
        assert max_rel_param_error(params, want_params)[0] < RTOL


def _train_batch_losses():
    import parallel3d

    engine, _, _, _ = parallel3d.initialize(model=make_model("llama"), config=ds_config(2, GAS, 2))
    data_iter = iter(rank_micro_batches(token_batches(STEPS, GAS, 2), torch.distributed.get_rank()))
    losses = [engine.train_batch(data_iter) for _ in range(STEPS)]
    return losses, engine.full_parameters()


def _with_unused_param(stage: int):
    """A block holding a parameter no forward uses: its unit is reduced incomplete, without a hang."""
    import parallel3d

    model = make_model("llama")
    model.model.layers[0].unused = torch.nn.Linear(4, 4)
    initial = {n: p.detach().clone() for n, p in model.named_parameters() if ".unused." in n}
    config = ds_config(stage, GAS, 2, stage3_param_persistence_threshold=0, reduce_bucket_size=3000)
    engine, _, _, _ = parallel3d.initialize(model=model, config=config)
    data_iter = iter(rank_micro_batches(token_batches(STEPS, GAS, 2), torch.distributed.get_rank()))
    losses = [engine.train_batch(data_iter) for _ in range(STEPS)]
    params = engine.full_parameters()
    untouched = all(torch.equal(params.pop(n), value) for n, value in initial.items())
    return losses, params, untouched


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_unused_parameter_does_not_disturb_the_rest(dist, stage):
    """The rest trains as without it; the unused param is skipped like torch.optim skips grad None."""
    want_losses, want_params = oracle("llama", 2)
    for losses, params, untouched in dist.run(2, _with_unused_param, stage):
        assert losses == pytest.approx(want_losses, rel=RTOL)
        assert max_rel_param_error(params, want_params)[0] < RTOL
        assert untouched, "a parameter no forward used was updated (weight decay without a gradient)"


def _eval_then_train(stage: int):
    import parallel3d

    config = ds_config(stage, GAS, 2, stage3_param_persistence_threshold=0)
    engine, _, _, _ = parallel3d.initialize(model=make_model("llama"), config=config)
    batches = rank_micro_batches(token_batches(STEPS, GAS, 2), torch.distributed.get_rank())
    eval_loss = engine.eval_batch(iter(batches[:GAS]))  # the first window, before any step
    data_iter = iter(batches)
    losses = [engine.train_batch(data_iter) for _ in range(STEPS)]
    return eval_loss, losses, engine.full_parameters()


@pytest.mark.parametrize("stage", [1, 3])
def test_eval_batch_is_the_first_steps_loss_and_changes_nothing(dist, stage):
    want_losses, want_params = oracle("llama", 2)
    for eval_loss, losses, params in dist.run(2, _eval_then_train, stage):
        assert eval_loss == pytest.approx(want_losses[0], rel=RTOL)
        assert losses == pytest.approx(want_losses, rel=RTOL)
        assert max_rel_param_error(params, want_params)[0] < RTOL

"""parallel3d.GatheredParameters and the safe_get/set_full_* accessors, at dp 2.

GatheredParameters gives stage-3 params their full shape and values; with modifier_rank the
change reaches every rank's shards and fp32 masters (so the next step starts from it); a change
without modifier_rank is refused instead of being lost; DeepSpeed's own GatheredParameters
refuses Zero3D's stage-3 params. The accessors are checked against one process doing the same
step with torch.optim.
"""

from __future__ import annotations

import pytest
import torch

from tests.tiny import ds_config, make_model, rank_micro_batches, token_batches

DP = 2
NAME = "model.layers.0.mlp.up_proj.weight"


def _engine(stage: int, precision: str = "fp32"):
    import parallel3d

    config = ds_config(stage, 1, DP, stage3_param_persistence_threshold=0)
    if precision != "fp32":
        config[precision] = {"enabled": True}
    engine, *_ = parallel3d.initialize(model=make_model("llama"), config=config)
    return engine


def gathered_shapes_and_values(stage: int) -> dict:
    import parallel3d

    engine = _engine(stage)
    params = dict(engine.module.named_parameters())
    full = engine.full_parameters()
    outside = tuple(params[NAME].shape)
    with parallel3d.GatheredParameters(engine.module.parameters()):
        inside = {n: (tuple(p.shape), torch.equal(p.detach(), full[n])) for n, p in params.items()}
        batch = rank_micro_batches(token_batches(1, 1, DP), torch.distributed.get_rank())[0]
        with torch.no_grad():
            engine(**batch)  # a forward inside the block does not release what the block holds
        after_forward = tuple(params[NAME].shape)
    return {"outside": outside, "inside": inside, "after_forward": after_forward,
            "after": tuple(params[NAME].shape), "full_shapes": {n: tuple(t.shape) for n, t in full.items()}}


@pytest.mark.parametrize("stage", [2, 3])
def test_params_are_whole_inside(dist, stage):
    for r in dist.run(DP, gathered_shapes_and_values, stage):
        assert all(same for _, same in r["inside"].values())
        assert {n: shape for n, (shape, _) in r["inside"].items()} == r["full_shapes"]
        assert r["after_forward"] == r["full_shapes"][NAME]
        if stage == 3:
            assert r["outside"] == r["after"] == (0,)


def modify_on_one_rank(stage: int, precision: str) -> dict:
    """Rank 1 writes 0.25 into a weight (rank 0 writes junk): modifier_rank=1 keeps rank 1's."""
    import parallel3d

    engine = _engine(stage, precision)
    param = dict(engine.module.named_parameters())[NAME]
    rank = torch.distributed.get_rank()
    with parallel3d.GatheredParameters([param], modifier_rank=1):
        with torch.no_grad():
            param.fill_(0.25 if rank == 1 else 7.0)
    master = parallel3d.safe_get_full_fp32_param(param)
    with parallel3d.GatheredParameters(param):
        working = param.detach().float().clone()
    batch = rank_micro_batches(token_batches(1, 1, DP), rank)[0]
    engine.backward(engine(**batch).loss)
    engine.step()
    return {"master": master, "working": working, "stepped": engine.full_parameters()[NAME]}


@pytest.mark.parametrize("stage,precision", [(3, "fp32"), (3, "bf16"), (2, "bf16"), (0, "fp32")])
def test_modifier_rank_writes_into_shards_and_masters(dist, stage, precision):
    for r in dist.run(DP, modify_on_one_rank, stage, precision):
        assert torch.equal(r["master"], torch.full_like(r["master"], 0.25))
        assert torch.equal(r["working"], torch.full_like(r["working"], 0.25))
        # the step started from 0.25 (AdamW at lr 1e-3 moves each entry by about 1e-3)
        assert (r["stepped"] - 0.25).abs().max() < 2e-3


def change_without_modifier_rank() -> str:
    import parallel3d

    engine = _engine(3)
    param = dict(engine.module.named_parameters())[NAME]
    try:
        with parallel3d.GatheredParameters(param):
            if torch.distributed.get_rank() == 0:  # one rank's change is enough: the ranks agree
                with torch.no_grad():
                    param.zero_()
    except parallel3d.UsageError as err:
        return str(err)
    return "no error"


def test_change_without_modifier_rank_is_refused(dist):
    for message in dist.run(DP, change_without_modifier_rank):
        assert message.startswith("parameters were changed inside GatheredParameters without modifier_rank")


def deepspeed_gather_on_zero3d_params() -> str:
    import os

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    import parallel3d

    engine = _engine(3)
    try:
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
            pass
    except parallel3d.UsageError as err:
        return str(err)
    return "no error"


def test_deepspeeds_gathered_parameters_refuses(dist):
    for message in dist.run(DP, deepspeed_gather_on_zero3d_params):
        assert message.startswith("DeepSpeed's ZeRO-3 code asked for 'all_gather' of a parameter that Zero3D shards")
        assert "Use parallel3d.GatheredParameters(params, modifier_rank=None)" in message


def test_fwd_module_is_refused():
    import parallel3d

    with pytest.raises(parallel3d.UsageError, match=r"^GatheredParameters\(fwd_module=\.\.\.\) is not supported"):
        parallel3d.GatheredParameters([], fwd_module=torch.nn.Linear(1, 1))


# --- safe_get_full_* / safe_set_full_* --------------------------------------------------------


def accessors(stage: int) -> dict:
    import parallel3d as p3d

    engine = _engine(stage)
    params = dict(engine.module.named_parameters())
    batch = rank_micro_batches(token_batches(1, 1, DP), torch.distributed.get_rank())[0]
    engine.backward(engine(**batch).loss)
    grads = {n: p3d.safe_get_full_grad(p) for n, p in params.items()}
    engine.step()
    after_step = {
        "grad_after_step": p3d.safe_get_full_grad(params[NAME]),
        "params": {n: p3d.safe_get_full_fp32_param(p) for n, p in params.items()},
        "exp_avg": {n: p3d.safe_get_full_optimizer_state(p, "exp_avg") for n, p in params.items()},
        "exp_avg_sq": p3d.safe_get_full_optimizer_state(params[NAME], "exp_avg_sq"),
    }
    shape = after_step["params"][NAME].shape
    value = torch.arange(shape.numel(), dtype=torch.float32).reshape(shape) / 1000
    p3d.safe_set_full_fp32_param(params[NAME], value)
    p3d.safe_set_full_optimizer_state(params[NAME], value * 2, "exp_avg")
    try:
        p3d.safe_get_full_optimizer_state(params[NAME], "momentum_buffer")
        missing = "no error"
    except p3d.UsageError as err:
        missing = str(err)
    return {**after_step, "grads": grads, "set_value": value, "set_param": engine.full_parameters()[NAME],
            "set_state": p3d.safe_get_full_optimizer_state(params[NAME], "exp_avg"), "missing": missing,
            "outside": p3d.safe_get_full_fp32_param(torch.nn.Parameter(torch.zeros(2)))}


def _one_process_step() -> tuple[dict, dict, dict]:
    """The same step on one process: gradients (mean of the two ranks' batches), params, exp_avg."""
    model = make_model("llama")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
    data = token_batches(1, 1, DP)
    loss = sum(model(input_ids=data[0, 0, r], labels=data[0, 0, r]).loss for r in range(DP)) / DP
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    opt.step()
    states = {n: opt.state[p]["exp_avg"].clone() for n, p in model.named_parameters()}
    return grads, {n: p.detach().clone() for n, p in model.named_parameters()}, states


@pytest.mark.parametrize("stage", [1, 3])
def test_full_accessors_match_one_process(dist, stage):
    grads, params, exp_avg = _one_process_step()
    for r in dist.run(DP, accessors, stage):
        for name, want in grads.items():
            torch.testing.assert_close(r["grads"][name], want, rtol=1e-5, atol=1e-7)
            torch.testing.assert_close(r["params"][name], params[name], rtol=1e-5, atol=1e-7)
            torch.testing.assert_close(r["exp_avg"][name], exp_avg[name], rtol=1e-5, atol=1e-9)
        assert r["grad_after_step"] is None  # gradients exist between backward and step only
        assert r["exp_avg_sq"].shape == params[NAME].shape
        assert torch.equal(r["set_param"], r["set_value"])
        assert torch.equal(r["set_state"], r["set_value"] * 2)
        assert r["missing"].startswith("optimizer state 'momentum_buffer' does not exist for this parameter; "
                                       "its states: exp_avg, exp_avg_sq, step")
        assert r["outside"] is None


def grad_dtype(precision: str) -> tuple[str, float]:
    import parallel3d

    engine = _engine(2, precision)
    param = dict(engine.module.named_parameters())[NAME]
    batch = rank_micro_batches(token_batches(1, 1, DP), torch.distributed.get_rank())[0]
    engine.backward(engine(**batch).loss)
    grad = parallel3d.safe_get_full_grad(param)
    return str(grad.dtype), float(grad.float().abs().max())


def test_full_grad_dtype(dist):
    """The working precision, as DeepSpeed; fp16 in fp32 with the loss scale (2**16) divided out.

    The largest entry agrees with fp32 to a few bf16 ulps (2**-8 each): the forward and backward ran in 16 bits.
    """
    fp32 = dist.run(DP, grad_dtype, "fp32")[0]
    bf16 = dist.run(DP, grad_dtype, "bf16")[0]
    fp16 = dist.run(DP, grad_dtype, "fp16")[0]
    assert (bf16[0], fp16[0]) == ("torch.bfloat16", "torch.float32")
    assert bf16[1] == pytest.approx(fp32[1], rel=2e-2) and fp16[1] == pytest.approx(fp32[1], rel=2e-2)

"""``expert_parallel.load_balance_coeff``: DeepSeek V3's router biases follow the global batch's loads.

The reference is one process training a tiny DeepSeek V3 over the same global batch (fp32 AdamW) and,
after each step, moving every router's ``e_score_correction_bias`` by ``coeff * sign(mean_load - load)``
with the loads read from the routers' own outputs over all micro-batches of every data-parallel rank.
The engine must give the same biases (bit for bit: sums of +-coeff), losses and parameters, without
expert parallelism, with it at ZeRO 3, with pipeline stages, and with sequence parallelism (experts whole
on each tp rank or split over tp).
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.distributed

from parallel3d.errors import ConfigError
from tests.tiny import ds_config, rank_micro_batches, token_batches, update_mismatch
from tests.tiny_moe import EXPERTS, ep_config, make_deepseek_v3, make_moe

COEFF, STEPS, GAS, RTOL = 0.01, 2, 2, 1e-5
BIAS = "e_score_correction_bias"

LAYOUTS = {  # world, config extras, data-parallel ranks, expert-parallel size, ZeRO stage
    "dp2": (2, {}, 2, 1, 2),
    "dp2_checkpointing": (2, {}, 2, 1, 1),  # HF's reentrant gradient checkpointing: counted in the recomputation
    "ep2": (4, {}, 4, 2, 3),
    "pp2_ep2": (4, {"pipeline": {"stages": 2}}, 2, 2, 1),
    # sequence parallelism: experts whole, each tp rank counts its part of the sequence (summed over tp too) ...
    "sp_ep2": (4, {"tensor_parallel": {"size": 2, "sequence_parallel": True}}, 2, 2, 1),
    # ... or split over tp, the tp ranks' tokens gathered before they are counted (summed over dp only)
    "sp_etp2": (4, {"tensor_parallel": {"size": 2, "sequence_parallel": True},
                    "expert_parallel": {"enabled": True, "autoep_size": 2, "expert_tensor_parallel_size": 2}}, 2, 2, 2),
}


def _freeze_below(model: torch.nn.Module) -> torch.nn.Module:
    """Layer 0 frozen but its shared expert (a backward reaches the layer, and checkpointing recomputes it,
    while its routed experts' inputs and routing weights need no gradient); layer 1 and the head train."""
    for name, param in model.named_parameters():
        param.requires_grad_(not name.startswith(("model.embed_tokens.", "model.layers.0."))
                             or name.startswith("model.layers.0.mlp.shared_experts."))
    return model


@functools.cache
def _reference(dp: int, coeff: float = COEFF, steps: int = STEPS, start: float | None = None,
               buffer_dtype: torch.dtype | None = None, frozen: bool = False) -> tuple[list[float], dict, dict]:
    """One process: losses, final parameters and final router biases (float32). ``start``: every bias's
    first value; ``buffer_dtype``: the model's floating-point buffers cast to it, as ``data_types.buffer_dtype``
    casts them, while each bias moves in float32 and its buffer gets the rounded value after each step;
    ``frozen``: ``_freeze_below``."""
    model = _freeze_below(make_deepseek_v3()) if frozen else make_deepseek_v3()
    routers = {n.rpartition(".")[0]: m for n, m in model.named_modules() if hasattr(m, BIAS) for n in [n + "." + BIAS]}
    if start is not None:
        for router in routers.values():
            getattr(router, BIAS).fill_(start)
    masters = {name: getattr(router, BIAS).detach().to(torch.float32, copy=True) for name, router in routers.items()}
    for buffer in model.buffers() if buffer_dtype is not None else ():
        if buffer.is_floating_point():
            buffer.data = buffer.data.to(buffer_dtype)
    loads = {}

    def count(name):
        return lambda module, args, out: loads.__setitem__(name, loads[name] + torch.bincount(out[2].reshape(-1),
                                                                                                  minlength=EXPERTS))

    for name, router in routers.items():
        router.register_forward_hook(count(name))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
    data = token_batches(steps, GAS, dp)
    losses = []
    for s in range(steps):
        loads.update({name: torch.zeros(EXPERTS, dtype=torch.int64) for name in routers})
        total = 0.0
        for a in range(GAS):
            loss = sum(model(input_ids=data[s, a, r], labels=data[s, a, r]).loss for r in range(dp)) / dp
            (loss / GAS).backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for name, router in routers.items():
                load = loads[name].float()
                masters[name].add_(torch.sign(load.mean() - load) * coeff)
                getattr(router, BIAS).copy_(masters[name])
        losses.append(total / GAS)
    biases = {f"{n}.{BIAS}": masters[n].clone() for n in routers}
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, biases


def _train(layout: str, steps: tuple[int, int] = (0, STEPS), save: str | None = None, load: str | None = None,
           seed: int = 0) -> tuple[list[float], dict, dict]:
    """Steps ``[first, last)`` of the run on ``layout`` (resumed from ``load``, saved to ``save`` at the end)."""
    import parallel3d

    _, extra, dp, ep, stage = LAYOUTS[layout]
    config = {**ep_config(stage, GAS, dp, ep, stage3_param_persistence_threshold=0, reduce_bucket_size=2000),
              **copy.deepcopy(extra)}
    config.setdefault("expert_parallel", {})["load_balance_coeff"] = COEFF
    model = make_deepseek_v3(seed)
    if layout.endswith("_checkpointing"):  # the first forward runs under no_grad
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    engine = parallel3d.initialize(model=model, config=config)[0]
    if load is not None:
        engine.load_checkpoint(load)
    batches = rank_micro_batches(token_batches(STEPS, GAS, dp), engine.mesh.local_rank("dp"))
    data_iter = iter(batches[steps[0] * GAS :])
    losses = [engine.train_batch(data_iter) for _ in range(*steps)]
    if save is not None:
        engine.save_checkpoint(save)
    biases = {r.name: r.owner.get_buffer(BIAS).clone() for r in engine.expert_bias.routers}
    return losses, engine.full_parameters(), biases


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_router_biases_follow_the_global_loads(dist, layout):
    world, _, dp, _, _ = LAYOUTS[layout]
    want_losses, want_params, want_biases = _reference(dp)
    assert all(b.abs().sum() > 0 for b in want_biases.values())  # the rule moved them
    start = dict(make_deepseek_v3().named_parameters())
    seen = set()
    for losses, params, biases in dist.run(world, _train, layout):
        assert losses == pytest.approx(want_losses, rel=RTOL)
        ratio, name, rel = update_mismatch(params, {n: want_params[n] for n in params}, start, STEPS, RTOL)
        assert ratio <= 1, f"{name}: update off by {rel:.2e}"
        for name, bias in biases.items():
            assert torch.equal(bias, want_biases[name]), name
        seen |= set(biases)
    assert seen == set(want_biases)


def test_router_biases_resume_from_a_checkpoint(dist, tmp_path):
    """Saved after step 1 on pp 2 x ep 2 (each stage holds its layers' routers), resumed at dp 2 without
    expert parallelism from other weights (seed 5): step 2 ends with the one-process biases. The export of
    that checkpoint loads with the biases and parameters the engine had."""
    from transformers import DeepseekV3ForCausalLM

    from parallel3d.export.export import export_checkpoint

    want_losses, want_params, want_biases = _reference(2)
    saved = dist.run(4, _train, "pp2_ep2", (0, 1), save=str(tmp_path / "ckpt"))
    exported = DeepseekV3ForCausalLM.from_pretrained(export_checkpoint(tmp_path / "ckpt", tmp_path / "hf"))
    trained = {name: bias for _, _, biases in saved for name, bias in biases.items()}
    assert trained.keys() == want_biases.keys() and all(b.abs().sum() > 0 for b in trained.values())
    assert all(torch.equal(exported.get_buffer(name), bias) for name, bias in trained.items())
    assert all(torch.equal(exported.get_parameter(n), p) for _, params, _ in saved for n, p in params.items())
    for losses, params, biases in dist.run(2, _train, "dp2", (1, STEPS), load=str(tmp_path / "ckpt"), seed=5):
        assert losses == pytest.approx(want_losses[1:], rel=RTOL)
        assert biases.keys() == want_biases.keys()
        assert all(torch.equal(bias, want_biases[name]) for name, bias in biases.items())


def test_load_balance_coeff_needs_a_router_bias():
    import parallel3d

    config = ds_config(1, 1, 1)
    config["expert_parallel"] = {"load_balance_coeff": COEFF}
    with pytest.raises(ConfigError, match="has no e_score_correction_bias buffer"):
        parallel3d.initialize(model=make_moe("mixtral"), config=config)


def test_router_biases_accumulate_in_float32_under_a_bf16_buffer_dtype():
    """``buffer_dtype: bf16`` casts the biases, and bf16 cannot hold ``1 + 1e-3`` (its spacing there is
    2 ** -7): updated in place, every step rounded away and the biases stayed at 1.0. The balancer keeps them
    in float32 and writes the rounded value to the buffer: against one process whose buffers are bf16 too and
    whose biases move in float32, the same losses and the same biases, bit for bit."""
    import parallel3d

    steps, coeff = 4, 1e-3
    want_losses, _, want_biases = _reference(1, coeff, steps, start=1.0, buffer_dtype=torch.bfloat16)
    assert all((b - 1.0).abs().max() >= 2e-3 for b in want_biases.values())  # moved by more than one step
    model = make_deepseek_v3()
    for name, bias in model.named_buffers():
        if name.endswith(BIAS):
            bias.fill_(1.0)  # a trained bias
    config = ds_config(1, GAS, 1)
    config["expert_parallel"] = {"load_balance_coeff": coeff}
    config["data_types"] = {"buffer_dtype": "bf16"}
    engine = parallel3d.initialize(model=model, config=config)[0]
    data_iter = iter(rank_micro_batches(token_batches(steps, GAS, 1), 0))
    assert [engine.train_batch(data_iter) for _ in range(steps)] == pytest.approx(want_losses, rel=RTOL)
    values = engine.expert_bias.state_dict()
    assert values.keys() == want_biases.keys()
    for router in engine.expert_bias.routers:
        value = values[router.name]
        assert value.dtype == torch.float32 and torch.equal(value, want_biases[router.name]), router.name
        assert torch.equal(router.owner.get_buffer(BIAS), value.to(torch.bfloat16)), router.name


@pytest.mark.parametrize("checkpointing", [False, True])
def test_a_frozen_layer_counts_its_loads_once(checkpointing):
    """Layer 0 frozen below the trained layers (PEFT's layers_to_transform, frozen lower layers): no backward
    reaches its routed experts' inputs, so its calls are counted when they run (they were not counted at
    all); under non-reentrant checkpointing its recomputation inside backward is not counted again."""
    import parallel3d

    want_losses, _, want_biases = _reference(1, frozen=True)
    model = _freeze_below(make_deepseek_v3())
    if checkpointing:  # as the pipeline stages' own checkpointing: the embeddings' output needs no gradient
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.disable_input_require_grads()
    config = ds_config(1, GAS, 1)
    config["expert_parallel"] = {"load_balance_coeff": COEFF}
    engine = parallel3d.initialize(model=model, config=config)[0]
    data_iter = iter(rank_micro_batches(token_batches(STEPS, GAS, 1), 0))
    assert [engine.train_batch(data_iter) for _ in range(STEPS)] == pytest.approx(want_losses, rel=RTOL)
    got = engine.expert_bias.state_dict()
    assert got.keys() == want_biases.keys() and want_biases["model.layers.0.mlp.gate." + BIAS].abs().sum() > 0
    for name, bias in want_biases.items():
        assert torch.equal(got[name], bias), name
    # the biases cannot see a count doubled everywhere (sign(mean - load) keeps its sign): count one micro-batch
    ids = token_batches(1, 1, 1)[0, 0, 0]
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    assert [int(load.sum()) for load in engine.expert_bias.loads] == [ids.numel() * 2] * 2  # top 2, each layer


def test_a_bias_written_after_initialize_is_the_one_that_moves():
    """The float32 copy must not outlive a write to the buffer (the model's state loaded by the user after
    initialize): the next update moves the written value, not the one the balancer took at initialize."""
    import parallel3d

    config = ds_config(1, 1, 1)
    config["expert_parallel"] = {"load_balance_coeff": 1e-3}
    config["data_types"] = {"buffer_dtype": "bf16"}
    engine = parallel3d.initialize(model=make_deepseek_v3(), config=config)[0]
    for router in engine.expert_bias.routers:
        router.owner.get_buffer(BIAS).fill_(2.0)
    assert all(torch.equal(v, torch.full_like(v, 2.0)) for v in engine.expert_bias.state_dict().values())
    engine.train_batch(iter(rank_micro_batches(token_batches(1, 1, 1), 0)))
    for value in engine.expert_bias.state_dict().values():
        moved = (value - 2.0).abs()  # 2.0 moved by one step: +-coeff, or 0 for an expert at the mean load
        assert bool(((moved < 1e-6) | ((moved - 1e-3).abs() < 1e-6)).all()) and moved.max() > 0, value


def _saved_with_a_wider_bias(path) -> tuple:
    """A one-process engine (DeepSeek V3 under ``load_balance_coeff``) and the name of the router bias whose
    value its checkpoint ``path``/t holds with two entries more than the model's router has (checkpoint.json
    edited: with the experts' weights changed too, the model check would name those first)."""
    import json

    import parallel3d
    from parallel3d.checkpoint.checkpoint import encode_value

    config = ds_config(1, 1, 1)
    config["expert_parallel"] = {"load_balance_coeff": COEFF}
    engine = parallel3d.initialize(model=make_deepseek_v3(), config=config)[0]
    engine.save_checkpoint(path, tag="t")
    manifest = json.loads((path / "t" / "checkpoint.json").read_text())
    name = sorted(manifest["router_biases"])[0]
    manifest["router_biases"][name] = encode_value(torch.ones(EXPERTS + 2), "bias")
    (path / "t" / "checkpoint.json").write_text(json.dumps(manifest))
    return engine, name


def test_a_checkpoint_router_bias_of_another_shape_is_refused_before_anything_loads(tmp_path):
    """A checkpoint whose router bias has another number of experts than this model's router stops with one
    ConfigError naming the bias and both shapes, and changes nothing."""
    engine, name = _saved_with_a_wider_bias(tmp_path)
    before = {r.name: r.owner.get_buffer(BIAS).clone() for r in engine.expert_bias.routers}
    with pytest.raises(ConfigError) as info:
        engine.load_checkpoint(tmp_path, tag="t")
    assert str(info.value) == (
        f"checkpoint {tmp_path / 't'} holds the router bias {name} with shape [{EXPERTS + 2}], this model's "
        f"is [{EXPERTS}]: it was written for a model with another number of routed experts; load it into the model "
        "it was written for, or leave expert_parallel.load_balance_coeff out to keep this model's biases (the "
        "checkpoint's are then not read)")
    assert all(torch.equal(r.owner.get_buffer(BIAS), before[r.name]) for r in engine.expert_bias.routers)


def test_export_refuses_a_router_bias_of_another_shape_than_its_config(tmp_path):
    """``zero3d export`` checks the router biases as the loader does, against the model its config.json
    describes: one ConfigError naming the bias and both shapes, and nothing written."""
    from parallel3d.export.export import export_checkpoint

    _, name = _saved_with_a_wider_bias(tmp_path)
    with pytest.raises(ConfigError) as info:
        export_checkpoint(tmp_path / "t", tmp_path / "hf")
    assert str(info.value) == (
        f"checkpoint {tmp_path / 't'} holds the router bias {name} with shape [{EXPERTS + 2}], this model's "
        f"is [{EXPERTS}] (the model of its config.json): its checkpoint.json and config.json are of models with "
        "another number of routed experts (one of them was edited or copied from another checkpoint); export a "
        "checkpoint directory as one save wrote it")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "t"]

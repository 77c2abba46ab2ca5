"""Expert parallelism against one process: the all-to-all in float64, then training with ZeRO 0-3.

Routing differs by rank (random tokens; each rank's tokens pick their own experts), and the
router's load-balancing loss is in the loss, as the model computes it on each rank's tokens.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.distributed

from parallel3d.errors import ConfigError
from tests.log_lines import log_lines
from tests.tiny import MICRO, SEQ, rank_micro_batches, token_batches, oracle_run, update_mismatch
from tests.tiny_moe import EXPERTS, ep_config, make_moe

KINDS = ("mixtral", "qwen3_moe")
RTOL = 1e-5
STEPS, GAS, DP = 3, 2, 4


def _float64_model(kind: str, skewed: bool) -> torch.nn.Module:
    """The float64 model (HF's per-expert loop: torch._grouped_mm has no float64). ``skewed``: routers
    of zeros, so every token picks the same experts (a tie, broken the same way everywhere) and the
    other experts' ranks receive no row at all."""
    model = make_moe(kind, experts_implementation="eager").double()
    if skewed:
        with torch.no_grad():
            for layer in model.model.layers:
                layer.mlp.gate.weight.zero_()
    return model


def _float64_gradients(kind: str, ep: int, skewed: bool) -> dict:
    """One forward/backward per rank of the float64 model with its experts split over ``ep`` ranks."""
    from parallel3d.expert_parallel import apply_expert_parallel
    from parallel3d.runtime.mesh import build_mesh

    mesh = build_mesh(1, 1, ep=ep)
    model = _float64_model(kind, skewed)
    info = apply_expert_parallel(model, ep, mesh.groups.ep, mesh.groups.expert_shard)
    data = token_batches(1, 1, DP)[0, 0]
    out = model(input_ids=data[torch.distributed.get_rank()], labels=data[torch.distributed.get_rank()])
    out.loss.backward()
    return {"loss": out.loss.item(), "aux": out.aux_loss.item(), "ep_rank": info.rank,
            "grads": {n: p.grad.clone() for n, p in model.named_parameters()}}


@functools.cache
def _oracle_gradients(kind: str, skewed: bool) -> list[dict]:
    start = _float64_model(kind, skewed)
    data = token_batches(1, 1, DP)[0, 0]
    out = []
    for rank in range(DP):
        model = copy.deepcopy(start)
        result = model(input_ids=data[rank], labels=data[rank])
        result.loss.backward()
        out.append({"loss": result.loss.item(), "aux": result.aux_loss.item(),
                    "grads": {n: p.grad.clone() for n, p in model.named_parameters()}})
    return out


@pytest.mark.parametrize("kind,ep,skewed", [(k, e, False) for k in KINDS for e in (2, 4)] + [("mixtral", 4, True)])
def test_float64_all_to_all_matches_single_process(dist, kind, ep, skewed):
    """Dense gradients are each rank's own; a local expert's gradient sums the ep group's tokens (also
    where a rank gets no token: its backward still joins the all-to-all)."""
    want = _oracle_gradients(kind, skewed)
    got = dist.run(DP, _float64_gradients, kind, ep, skewed)
    local = EXPERTS // ep
    for rank, result in enumerate(got):
        assert result["loss"] == pytest.approx(want[rank]["loss"], rel=1e-12)
        assert result["aux"] == pytest.approx(want[rank]["aux"], rel=1e-12)
        block = range(rank - rank % ep, rank - rank % ep + ep)  # this rank's expert-parallel group
        for name, grad in result["grads"].items():
            if ".experts." in name:
                lo = result["ep_rank"] * local
                expected = sum(want[r]["grads"][name] for r in block)[lo : lo + local]
            else:
                expected = want[rank]["grads"][name]
            assert torch.allclose(grad, expected, rtol=1e-10, atol=1e-13), f"rank {rank} {name}"


def _steps(engine, data_iter) -> tuple[list[float], list[float]]:
    """Each of the STEPS steps' loss and gradient norm (before clipping)."""
    losses, norms = [], []
    for _ in range(STEPS):
        losses.append(engine.train_batch(data_iter))
        norms.append(engine.get_global_grad_norm())
    return losses, norms


def _train(kind: str, stage: int, ep: int) -> tuple[list[float], list[float], dict, dict]:
    import parallel3d

    config = ep_config(stage, GAS, DP, ep, stage3_param_persistence_threshold=0, reduce_bucket_size=2000)
    engine, _, _, _ = parallel3d.initialize(model=make_moe(kind), config=config)
    data_iter = iter(rank_micro_batches(token_batches(STEPS, GAS, DP), torch.distributed.get_rank()))
    return (*_steps(engine, data_iter), engine.full_parameters(), engine.memory_report(experts=True))


@functools.cache
def _oracle(kind: str) -> tuple[list[float], list[float], dict]:
    norms: list[float] = []
    losses, params = oracle_run(kind, token_batches(STEPS, GAS, DP), model=make_moe(kind), grad_norms=norms)
    return losses, norms, params


@pytest.mark.parametrize("kind,stage,ep", [(k, s, e) for k in KINDS for e in (2, 4) for s in (0, 1, 2, 3)])
def test_training_matches_single_process(dist, kind, stage, ep):
    want_losses, want_norms, want_params = _oracle(kind)
    start = dict(make_moe(kind).named_parameters())
    experts = [p for n, p in start.items() if ".experts." in n]
    expert_bytes = 4 * sum(p.numel() for p in experts) // ep  # fp32, 1/E of them
    for losses, norms, params, memory in dist.run(DP, _train, kind, stage, ep):
        assert losses == pytest.approx(want_losses, rel=RTOL)
        assert norms == pytest.approx(want_norms, rel=RTOL)  # the clipping norm counts each expert once
        if stage == 0:  # unsharded: a rank's experts whole, with a gradient, two Adam moments and a step count each
            assert memory == {"params": expert_bytes, "gradients": expert_bytes, "master_params": 0,
                              "optimizer_states": 2 * expert_bytes + 4 * len(experts), "frozen_params": 0}
        ratio, name, rel = update_mismatch(params, want_params, start, STEPS, RTOL)
        assert ratio <= 1, f"{name}: update off by {rel:.2e}"


def _initialize_error(model, **ep) -> str:
    import parallel3d

    config = ep_config(1, 1, 1, 1)
    config["expert_parallel"] = {"enabled": True, **ep}
    with pytest.raises(ConfigError) as info:
        parallel3d.initialize(model=model, config=config)
    return str(info.value)


def test_refusals_name_the_problem():
    from parallel3d.expert_parallel import resolve_experts
    from tests.tiny import make_model

    assert "does not divide the 8 experts of model.layers.0.mlp.experts; allowed: 1, 2, 4, 8" in str(
        pytest.raises(ConfigError, resolve_experts, make_moe("mixtral"), 3).value)
    assert "declares no base_model_ep_plan" in str(pytest.raises(ConfigError, resolve_experts, make_model("llama"), 2).value)
    no_moe = make_moe("qwen3_moe", mlp_only_layers=[0, 1])
    assert "builds none of them (no mixture-of-experts layer)" in str(
        pytest.raises(ConfigError, resolve_experts, no_moe, 2).value)
    assert "expert_parallel.autoep_size 2 does not divide the 1 ranks ZeRO shards over" in _initialize_error(
        make_moe("mixtral"), autoep_size=2)
    assert ("expert_parallel.expert_tensor_parallel_size 2 with tensor_parallel.size 1: each expert is split over "
            "all the tensor-parallel ranks or none; allowed: 1 (tensor parallelism is off)") in _initialize_error(
        make_moe("mixtral"), expert_tensor_parallel_size=2)
    assert "expert_parallel.preset_model is a DeepSpeed key Zero3D does not implement" in _initialize_error(
        make_moe("mixtral"), preset_model="mixtral")


def _lora_on_stacked_experts() -> torch.nn.Module:
    """The tiny Mixtral with LoRA on q_proj and on its experts' stacked weights (peft's target_parameters),
    unwrapped from its PeftModel as initialize unwraps it."""
    from peft import LoraConfig, get_peft_model

    from parallel3d.build.peft_model import unwrap_peft

    config = LoraConfig(r=2, target_modules=["q_proj"],
                        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    return unwrap_peft(get_peft_model(make_moe("mixtral"), config))


def test_lora_on_stacked_experts_is_refused_with_the_way_out():
    """peft's target_parameters wraps the experts module in a ParamWrapper whose adapters span all its
    experts: refused before any collective (initialize's check on the unwrapped model), saying so."""
    from parallel3d.expert_parallel import check_expert_parallel

    model = _lora_on_stacked_experts()
    message = str(pytest.raises(ConfigError, check_expert_parallel, model, 2).value)
    assert message.startswith("expert_parallel: LoRA on stacked expert weights (model.layers.0.mlp.experts.gate_up_proj, "
                              "model.layers.0.mlp.experts.down_proj, peft's target_parameters) is not supported with "
                              "expert parallelism (autoep_size 2)"), message
    assert "target_modules such as q_proj" in message and "expert_parallel.enabled false" in message
    assert "tensor_parallel.size 1" in message  # the way out: tensor parallelism cuts the experts too (below)
    check_expert_parallel(model, 1)


def test_lora_on_stacked_experts_is_refused_under_tensor_parallelism_with_the_way_out():
    """Without expert parallelism, tensor parallelism splits every expert over the tp ranks, and the same
    ParamWrapper cannot run on a slice of each: refused, saying so, rather than as a weight its plan does not
    name (``base_layer.base_layer.gate_up_proj``)."""
    from parallel3d.tensor_parallel.apply import prepare_tensor_parallel

    message = str(pytest.raises(ConfigError, prepare_tensor_parallel, _lora_on_stacked_experts(), 2).value)
    assert message.startswith("tensor_parallel: LoRA on stacked expert weights (model.layers.0.mlp.experts.gate_up_proj, "
                              "model.layers.0.mlp.experts.down_proj, peft's target_parameters) is not supported with "
                              "tensor parallelism (tensor_parallel.size 2)"), message
    assert "target_modules such as q_proj" in message and "tensor_parallel.size 1" in message


def _started_notices(ep_section: dict, tp: int = 1) -> tuple[list[str], bool]:
    """initialize the tiny Mixtral on 2 ranks at tp ``tp`` with ``ep_section``: (initialize's expert_parallel
    warnings on this rank, whether its experts were split by expert parallelism)."""
    import parallel3d

    config = {**ep_config(0, 1, 2 // tp, 1), "expert_parallel": ep_section, "tensor_parallel": {"size": tp}}
    with log_lines("parallel3d.initialize") as lines:
        engine = parallel3d.initialize(model=make_moe("mixtral"), config=config)[0]
    return [line for line in lines if "expert_parallel" in line], engine.ep_info is not None


def test_autoep_size_without_enabled_is_ignored_with_one_warning(dist):
    """As DeepSpeed AutoEP, autoep_size without enabled: true splits nothing; rank 0 says so once."""
    ignored = dist.run(2, _started_notices, {"autoep_size": 2})
    assert ignored[0] == (["expert_parallel.autoep_size 2 has no effect without expert_parallel.enabled: true (as in "
                           "DeepSpeed AutoEP): every rank holds every expert; set enabled: true to split the experts, "
                           "or remove autoep_size"], False)
    assert ignored[1] == ([], False)
    assert dist.run(2, _started_notices, {"enabled": True, "autoep_size": 2}) == [([], True)] * 2


def test_expert_tensor_parallel_size_1_without_enabled_is_ignored_with_one_warning(dist):
    """expert_tensor_parallel_size 1 written out at tp 2 without expert parallelism: tp still splits the
    experts (documented); rank 0 says so once. Left out, or at tp 1, nothing is said."""
    ignored = dist.run(2, _started_notices, {"expert_tensor_parallel_size": 1}, 2)
    assert ignored[0] == (["expert_parallel.expert_tensor_parallel_size 1 has no effect without "
                           "expert_parallel.enabled: true: without expert parallelism tensor_parallel.size 2 splits "
                           "every expert over the tensor-parallel ranks as any MLP; set enabled: true (with "
                           "autoep_size) to keep the experts whole on each tensor-parallel rank, or remove "
                           "expert_tensor_parallel_size"], False)
    assert ignored[1] == ([], False)
    assert dist.run(2, _started_notices, {}, 2) == [([], False)] * 2
    assert dist.run(2, _started_notices, {"expert_tensor_parallel_size": 1}) == [([], False)] * 2


SAVE_AT = 2


def _engine(kind: str, stage: int, ep: int, seed: int = 0):
    import parallel3d

    config = ep_config(stage, GAS, DP, ep, stage3_param_persistence_threshold=0, reduce_bucket_size=2000)
    return parallel3d.initialize(model=make_moe(kind, seed=seed), config=config)[0]


def _save(kind: str, stage: int, ep: int, path: str) -> dict:
    engine = _engine(kind, stage, ep)
    data_iter = iter(rank_micro_batches(token_batches(STEPS, GAS, DP), torch.distributed.get_rank()))
    for _ in range(SAVE_AT):
        engine.train_batch(data_iter)
    engine.save_checkpoint(path)
    return engine.full_parameters()


def _resume(kind: str, stage: int, ep: int, path: str) -> tuple[list[float], dict]:
    engine = _engine(kind, stage, ep, seed=5)  # other weights: only the checkpoint can give the saved state
    engine.load_checkpoint(path)
    batches = rank_micro_batches(token_batches(STEPS, GAS, DP), torch.distributed.get_rank())
    data_iter = iter(batches[SAVE_AT * GAS :])
    losses = [engine.train_batch(data_iter) for _ in range(STEPS - SAVE_AT)]
    return losses, engine.full_parameters()


@pytest.mark.parametrize("kind,save,load", [("mixtral", (2, 4), (3, 1)), ("qwen3_moe", (3, 2), (1, 4))])
def test_checkpoint_resumes_across_ep_sizes_and_exports(dist, tmp_path, kind, save, load):
    """Saved at (stage, ep), resumed at another stage and ep (1: without expert parallelism): the run
    goes on as one process would; the checkpoint exports to an HF directory holding every expert."""
    from transformers import AutoModelForCausalLM

    from parallel3d.export.export import export_checkpoint

    saved = dist.run(DP, _save, kind, *save, str(tmp_path / "ckpt"))[0]
    want_losses, _, want_params = _oracle(kind)
    start = dict(make_moe(kind).named_parameters())
    for losses, params in dist.run(DP, _resume, kind, *load, str(tmp_path / "ckpt")):
        assert losses == pytest.approx(want_losses[SAVE_AT:], rel=RTOL)
        ratio, name, rel = update_mismatch(params, want_params, start, STEPS, RTOL)
        assert ratio <= 1, f"{name}: update off by {rel:.2e}"
    export_checkpoint(tmp_path / "ckpt", tmp_path / "hf")
    exported = dict(AutoModelForCausalLM.from_pretrained(tmp_path / "hf").named_parameters())
    for name, value in saved.items():
        assert torch.equal(exported[name].detach(), value), name


def _save_expert_tensor_parallel(kind: str, path: str) -> dict:
    import parallel3d

    extra, _, dp = COMPOSED["etp2"]
    config = {**ep_config(3, GAS, dp, 2, stage3_param_persistence_threshold=0, reduce_bucket_size=2000), **extra}
    engine = parallel3d.initialize(model=make_moe(kind), config=config)[0]
    data_iter = iter(rank_micro_batches(token_batches(STEPS, GAS, dp), engine.mesh.local_rank("dp")))
    for _ in range(SAVE_AT):
        engine.train_batch(data_iter)
    engine.save_checkpoint(path)
    return engine.full_parameters()


def _resume_without_parallelism(kind: str, path: str) -> tuple[list[float], dict]:
    """dp 4 with one micro-batch per step: the same 4 sequences a step as tp 2 x dp 2 with 2 micro-batches."""
    import parallel3d

    engine = parallel3d.initialize(model=make_moe(kind, seed=5), config=ep_config(1, 1, DP, 1))[0]
    engine.load_checkpoint(path)
    data = token_batches(STEPS, GAS, 2).reshape(STEPS, 1, GAS * 2, MICRO, SEQ)
    data_iter = iter(rank_micro_batches(data, torch.distributed.get_rank())[SAVE_AT:])
    return [engine.train_batch(data_iter) for _ in range(STEPS - SAVE_AT)], engine.full_parameters()


def test_checkpoint_from_expert_tensor_parallel_resumes_without_it_and_exports(dist, tmp_path):
    """Saved at (ZeRO 3, tp 2 x dp 2, ep 2, expert_tensor_parallel_size 2: each rank a quarter of the experts)
    and resumed at (ZeRO 1, dp 4, no tp, no ep); the export holds every expert whole."""
    from transformers import AutoModelForCausalLM

    from parallel3d.export.export import export_checkpoint

    kind = "qwen3_moe"
    saved = dist.run(DP, _save_expert_tensor_parallel, kind, str(tmp_path / "ckpt"))[0]
    want_losses, want_params = oracle_run(kind, token_batches(STEPS, GAS, 2), model=make_moe(kind))
    start = dict(make_moe(kind).named_parameters())
    for losses, params in dist.run(DP, _resume_without_parallelism, kind, str(tmp_path / "ckpt")):
        assert losses == pytest.approx(want_losses[SAVE_AT:], rel=RTOL)
        ratio, name, rel = update_mismatch(params, want_params, start, STEPS, RTOL)
        assert ratio <= 1, f"{name}: update off by {rel:.2e}"
    export_checkpoint(tmp_path / "ckpt", tmp_path / "hf")
    exported = dict(AutoModelForCausalLM.from_pretrained(tmp_path / "hf").named_parameters())
    assert set(saved) == set(exported)
    for name, value in saved.items():
        assert torch.equal(exported[name].detach(), value), name


COMPOSED = {  # world 4, ep 2: (config, model overrides, data-parallel ranks)
    "tp2": ({"tensor_parallel": {"size": 2}}, {}, 2),  # experts whole on each tp rank, attention split
    # expert tensor parallelism: each tp rank a slice of its experts, the ep all-to-all per tp slice
    "etp2": ({"tensor_parallel": {"size": 2}, "expert_parallel": {"enabled": True, "autoep_size": 2,
                                                                  "expert_tensor_parallel_size": 2}}, {}, 2),
    # sequence parallelism: each tp rank routes its part of the sequence through its ep group, experts
    # whole; their gradients summed over tp, the router loss over the gathered router logits
    "sp2": ({"tensor_parallel": {"size": 2, "sequence_parallel": True}}, {}, 2),
    "sp_etp2": ({"tensor_parallel": {"size": 2, "sequence_parallel": True},  # the tp ranks' tokens gathered, then
                 "expert_parallel": {"enabled": True, "autoep_size": 2, "expert_tensor_parallel_size": 2}}, {}, 2),
    "pp2": ({"pipeline": {"stages": 2}}, {"output_router_logits": False}, 2),  # pipelines refuse the router loss
    # folded over dp_shard x cp: each cp rank routes its part of the sequence (a router loss over a part differs)
    "cp2": ({"context_parallel": {"size": 2}}, {"output_router_logits": False}, 2),
    "hybrid": ({}, {}, 4),  # mics_shard_size 2: replicas of 2 shard ranks, each an ep group
}


def _train_composed(kind: str, layout: str, stage: int) -> tuple[list[float], list[float], dict, dict]:
    import parallel3d

    extra, overrides, dp = COMPOSED[layout]
    zero = {"mics_shard_size": 2} if layout == "hybrid" else {}
    config = {**ep_config(stage, GAS, dp, 2, stage3_param_persistence_threshold=0, reduce_bucket_size=2000, **zero),
              **extra}
    engine = parallel3d.initialize(model=make_moe(kind, **overrides), config=config)[0]
    data_iter = iter(rank_micro_batches(token_batches(STEPS, GAS, dp), engine.mesh.local_rank("dp")))
    return (*_steps(engine, data_iter), engine.full_parameters(), engine.memory_report(experts=True))


@pytest.mark.parametrize("kind,layout,stage", [("qwen3_moe", "tp2", 1), ("mixtral", "tp2", 3), ("mixtral", "pp2", 1),
                                               ("qwen3_moe", "pp2", 3), ("mixtral", "cp2", 2), ("qwen3_moe", "cp2", 3),
                                               ("mixtral", "hybrid", 3), ("qwen3_moe", "hybrid", 1),
                                               ("mixtral", "etp2", 1), ("qwen3_moe", "etp2", 3),
                                               ("qwen3_moe", "sp2", 1), ("mixtral", "sp2", 3),
                                               ("qwen3_moe", "sp_etp2", 2)])
def test_composes_with_tp_pp_cp_and_hybrid_sharding(dist, kind, layout, stage):
    """Losses, gradient norms (AdamW hardly notices a wrong clipping norm) and every parameter."""
    _, overrides, dp = COMPOSED[layout]
    want_norms: list[float] = []
    want_losses, want_params = oracle_run(kind, token_batches(STEPS, GAS, dp), model=make_moe(kind, **overrides),
                                          grad_norms=want_norms)
    start = dict(make_moe(kind, **overrides).named_parameters())
    experts = [p for n, p in start.items() if ".experts." in n]
    seen = set()
    for losses, norms, params, memory in dist.run(4, _train_composed, kind, layout, stage):
        if layout == "etp2" and stage == 1:  # one rank per expert shard group: 1/(E x tp) of the experts, whole
            expert_bytes = 4 * sum(p.numel() for p in experts) // (2 * 2)
            assert memory["params"] == expert_bytes
            assert memory["optimizer_states"] == 2 * expert_bytes + 4 * len(experts)
        assert losses == pytest.approx(want_losses, rel=RTOL)
        assert norms == pytest.approx(want_norms, rel=RTOL)
        ratio, name, rel = update_mismatch(params, {n: want_params[n] for n in params}, start, STEPS, RTOL)
        assert ratio <= 1, f"{name}: update off by {rel:.2e}"
        seen |= set(params)
    assert seen == set(want_params)


def _meta_start_expert_tensor_parallel(directory: str) -> tuple[dict, float]:
    import parallel3d

    extra, _, dp = COMPOSED["etp2"]
    config = {**ep_config(3, 1, dp, 2, stage3_param_persistence_threshold=0, reduce_bucket_size=2000), **extra}
    engine = parallel3d.initialize(model=make_moe("mixtral", meta=True), config=config, pretrained=directory)[0]
    start = engine.full_parameters()
    return start, engine.train_batch(iter(rank_micro_batches(token_batches(1, 1, dp), engine.mesh.local_rank("dp"))))


def test_meta_start_with_expert_tensor_parallel_reads_each_ranks_box(dist, tmp_path):
    """A meta-device Mixtral at tp 2 x dp 2 x ep 2, expert tensor parallel 2, ZeRO 3, from a directory
    as save_pretrained writes it (one tensor per expert): each rank's quarter of every expert weight
    (its experts' rows, its tp slice) is read exactly; the first step's loss is one process's."""
    model = make_moe("mixtral", seed=3)
    model.save_pretrained(tmp_path)
    want = {n: p.detach().clone() for n, p in model.named_parameters()}
    want_losses, _ = oracle_run("mixtral", token_batches(1, 1, 2), model=model)
    for start, loss in dist.run(DP, _meta_start_expert_tensor_parallel, str(tmp_path)):
        assert set(start) == set(want)
        for name, value in start.items():
            assert torch.equal(value, want[name]), name
        assert loss == pytest.approx(want_losses[0], rel=RTOL)


def test_expert_tensor_parallel_size_other_than_1_or_tp_refused():
    from parallel3d.config.config import load_config

    config = {**ep_config(1, 1, 2, 2), "tensor_parallel": {"size": 4}}
    config["expert_parallel"]["expert_tensor_parallel_size"] = 2
    with pytest.raises(ConfigError) as info:
        load_config(config, 8)
    assert str(info.value) == (
        "expert_parallel.expert_tensor_parallel_size 2 with tensor_parallel.size 4: each expert is split over all "
        "the tensor-parallel ranks or none; allowed: 1 (experts whole on every tensor-parallel rank) or 4 (each "
        "expert split over them)")


def _modify_experts(stage: int) -> torch.Tensor:
    import parallel3d

    engine = _engine("mixtral", stage, 2)
    name = "model.layers.0.mlp.experts.down_proj"
    param = dict(engine.module.named_parameters())[name]
    with parallel3d.GatheredParameters([param], modifier_rank=1):
        param.data.fill_(10.0 * torch.distributed.get_rank() + 1)
    return engine.full_parameters()[name]


@pytest.mark.parametrize("stage", [1, 3])
def test_gathered_parameters_keep_the_modifiers_experts(dist, stage):
    """modifier_rank 1's ep group is ranks {0, 1}: each expert slice takes the value of the rank there
    that holds it (rank 0's for experts 0-3, rank 1's for 4-7), on every rank."""
    local = EXPERTS // 2
    for full in dist.run(DP, _modify_experts, stage):
        assert torch.equal(full[:local], torch.full_like(full[:local], 1.0))
        assert torch.equal(full[local:], torch.full_like(full[local:], 11.0))


def _full_grads(ep: int) -> dict:
    import parallel3d

    config = ep_config(2, 1, DP, ep, reduce_bucket_size=2000)
    engine = parallel3d.initialize(model=make_moe("mixtral", experts_implementation="eager"), config=config)[0]
    ids = token_batches(1, 1, DP)[0, 0][torch.distributed.get_rank()]
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    names = ("model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.gate.weight")
    params = dict(engine.module.named_parameters())
    return {"ep_rank": engine.ep_info.rank, **{n: parallel3d.safe_get_full_grad(params[n]) for n in names}}


def test_full_gradient_accessor_is_the_mean_over_ranks(dist):
    """safe_get_full_grad of a local expert weight is its slice of one process's mean gradient (the
    step's 1/E included), as for a dense weight."""
    want = _oracle_gradients("mixtral", False)
    local = EXPERTS // 2
    for got in dist.run(DP, _full_grads, 2):
        for name, grad in got.items():
            if name == "ep_rank":
                continue
            mean = sum(w["grads"][name] for w in want) / DP
            if ".experts." in name:
                mean = mean[got["ep_rank"] * local : (got["ep_rank"] + 1) * local]
            assert ((grad.double() - mean).norm() / mean.norm()).item() < 1e-5, name

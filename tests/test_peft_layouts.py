"""PEFT (LoRA) models under tensor parallelism and pipeline stages against one process (issue 29).

Adapters around column-parallel layers split ``lora_B`` by output rows, around row-parallel
ones ``lora_A`` by input columns; the frozen base is split by the plan and must come out
bit-identical (each rank's shard of it)."""

from __future__ import annotations

import functools

import pytest
import torch

from tests.peft_tiny import hf_name, make_peft_model
from tests.tiny import ds_config, max_rel_param_error, oracle_run, rank_micro_batches, token_batches

STEPS, GAS = 4, 2
RTOL = 1e-5
LAYERS = 4


def train_layout(stage: int, dp: int, tp: int, pp: int, targets: tuple[str, ...]) -> tuple[list[float], dict, list]:
    """On every rank: train through ``train_batch``; losses, trained params, frozen params that changed."""
    import parallel3d

    config = ds_config(stage, GAS, dp, stage3_param_persistence_threshold=0, reduce_bucket_size=3000)
    config["tensor_parallel"] = {"size": tp}
    config["pipeline"] = {"stages": pp}
    model = make_peft_model(targets=targets, num_hidden_layers=LAYERS)
    start = {hf_name(n): p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    engine, _, _, _ = parallel3d.initialize(model=model, config=config)
    data = iter(rank_micro_batches(token_batches(STEPS, GAS, dp), engine.mesh.local_rank("dp")))
    losses = [float(engine.train_batch(data)) for _ in range(STEPS)]
    frozen = {n: p for n, p in engine.named_parameters() if not p.requires_grad}
    specs = engine.tp_info.shard_specs if engine.tp_info is not None else {}
    tp_rank = engine.mesh.local_rank("tp")
    changed = []
    with parallel3d.GatheredParameters(list(frozen.values())):
        for name, p in frozen.items():
            want = specs[name].shard(start[name], tp_rank, tp) if name in specs else start[name]
            if not torch.equal(p.detach(), want):
                changed.append(name)
    return losses, engine.full_parameters(), changed


@functools.cache
def oracle(dp: int, targets: tuple[str, ...]):
    model = make_peft_model(targets=targets, num_hidden_layers=LAYERS)
    losses, params = oracle_run("llama", token_batches(STEPS, GAS, dp), model=model)
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    return losses, {hf_name(n): p for n, p in params.items() if n in trained}


ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CASES = [  # stage, dp, tp, pp, adapters
    (1, 1, 2, 1, ALL),
    (3, 1, 2, 1, ("q_proj", "v_proj", "o_proj", "down_proj")),
    (3, 2, 2, 1, ALL),
    (3, 1, 1, 2, ("q_proj", "v_proj", "down_proj")),
    (1, 2, 1, 2, ALL),
]


@pytest.mark.parametrize("stage,dp,tp,pp,targets", CASES, ids=lambda v: str(v).replace(" ", "") if not isinstance(v, tuple) else str(len(v)))
def test_lora_layout_matches_single_process(dist, stage, dp, tp, pp, targets):
    results = dist.run(dp * tp * pp, train_layout, stage, dp, tp, pp, targets)
    want_losses, want_params = oracle(dp, targets)
    got: dict[str, torch.Tensor] = {}
    for losses, params, changed in results:
        assert losses == pytest.approx(want_losses, rel=RTOL)
        assert not changed, f"frozen params changed: {changed}"
        got.update(params)
    err, name = max_rel_param_error(got, want_params)
    assert err < RTOL, f"{name} differs by {err:.2e}"


def _message(model, config: dict) -> str:
    """The ConfigError ``initialize`` raises for ``model`` and ``config``."""
    import parallel3d
    from parallel3d.errors import ConfigError

    with pytest.raises(ConfigError) as caught:
        parallel3d.initialize(model=model, config=config)
    return str(caught.value)


def _refusal(tp_extra: dict, targets: tuple[str, ...], **lora) -> str:
    from peft import LoraConfig, get_peft_model
    from tests.tiny import make_model

    model = get_peft_model(make_model("llama"), LoraConfig(r=4, target_modules=list(targets), **lora))
    config = ds_config(1, 1, 1)
    config["tensor_parallel"] = {"size": 2, **tp_extra}
    return _message(model, config)


@pytest.mark.parametrize("tp_extra,targets,lora,message", [
    ({}, ("q_proj", "lm_head"), {}, "LoRA adapters on the lm head"),
    ({"sequence_parallel": True}, ("q_proj",), {}, "sequence_parallel with PEFT adapters is not supported"),
    ({}, ("q_proj",), {"use_dora": True}, "a LoRA variant (DoRA and the like"),
    ({}, ("q_proj",), {"lora_dropout": 0.1}, "lora_dropout 0.1 around a column-parallel layer inside a split region"),
    ({}, ("q_proj",), {"modules_to_save": ["lm_head"]}, "(modules_to_save or trainable_token_indices) under tensor"),
], ids=["head", "sequence_parallel", "dora", "dropout", "modules_to_save"])
def test_adapters_tp_cannot_split_are_refused(dist, tp_extra, targets, lora, message):
    for got in dist.run(2, _refusal, tp_extra, targets, **lora):
        assert message in got


def _prompt_tuning() -> str:
    from peft import PromptTuningConfig, get_peft_model
    from tests.tiny import make_model

    model = get_peft_model(make_model("llama"), PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))
    return _message(model, ds_config(0, 1, 1))


def test_prompt_learning_is_refused(dist):
    assert "a prompt-learning method" in dist.run(1, _prompt_tuning)[0]


def train_meta(base_dir: str, stage: int, dp: int, tp: int) -> tuple[list[float], dict]:
    """The PEFT model built on the meta device, the base read from ``base_dir``; as train_layout."""
    import parallel3d
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        base = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(base_dir))
        model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=list(ALL), init_lora_weights="gaussian"))
    config = ds_config(stage, GAS, dp, stage3_param_persistence_threshold=0)
    config["tensor_parallel"] = {"size": tp}
    torch.manual_seed(11)  # the adapters are drawn as get_peft_model draws them from this state
    engine, _, _, _ = parallel3d.initialize(model=model, config=config, pretrained=base_dir)
    data = iter(rank_micro_batches(token_batches(STEPS, GAS, dp), engine.mesh.local_rank("dp")))
    return [float(engine.train_batch(data)) for _ in range(STEPS)], engine.full_parameters()


@pytest.mark.parametrize("stage,dp,tp", [(3, 2, 1), (3, 1, 2)])
def test_meta_start_reads_the_base_and_draws_the_adapters(dist, tmp_path, stage, dp, tp):
    from peft import LoraConfig, get_peft_model
    from tests.tiny import make_model

    make_model("llama", num_hidden_layers=LAYERS).save_pretrained(tmp_path)
    base = make_model("llama", num_hidden_layers=LAYERS)
    torch.manual_seed(11)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=list(ALL), init_lora_weights="gaussian"))
    want_losses, want = oracle_run("llama", token_batches(STEPS, GAS, dp), model=model)
    want = {hf_name(n): p for n, p in want.items() if model.get_parameter(n).requires_grad}
    got: dict[str, torch.Tensor] = {}
    for losses, params in dist.run(dp * tp, train_meta, str(tmp_path), stage, dp, tp):
        assert losses == pytest.approx(want_losses, rel=RTOL)
        got.update(params)
    err, name = max_rel_param_error(got, want)
    assert err < RTOL, f"{name} differs by {err:.2e}"

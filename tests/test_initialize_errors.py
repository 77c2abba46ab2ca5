"""Bad inputs to ``parallel3d.initialize``: one ``ConfigError`` with the exact message, no hang.

Checks that do not depend on the world size run here in the test process (no process group:
world 1, so nothing can wait on a peer). Checks that do (batch arithmetic over dp, mesh
divisibility, tp/pp) run on the 2-rank pool under a short timeout, so a rank that went on
into a collective while its peer raised would fail the test instead of hanging it.
"""

from __future__ import annotations

import argparse

import pytest
import torch
import torch.distributed

import parallel3d
from parallel3d import ConfigError
from tests.tiny import ds_config, make_model

_MODEL = None


def _model() -> torch.nn.Module:
    """A fresh tiny Llama per case (initialize may take its params over), built from a cached one."""
    global _MODEL
    if _MODEL is None:
        _MODEL = make_model("llama")
    import copy

    return copy.deepcopy(_MODEL)


def _cfg(**updates) -> dict:
    """A valid single-process config (dp 1), with top-level keys replaced."""
    return {**ds_config(0, 1, 1), **updates}


def _frozen() -> torch.nn.Module:
    model = _model()
    model.requires_grad_(False)
    return model


def _no_optimizer() -> dict:
    cfg = _cfg()
    del cfg["optimizer"]
    return cfg


def _deepspeed_partitioned() -> dict:
    """A model whose params look as deepspeed.zero.Init leaves them: empty, with a ds_id."""
    model = _model()
    for i, p in enumerate(model.parameters()):
        p.data = torch.empty(0)
        p.ds_id = i
    return dict(model=model, config=_cfg())


class _Args:
    deepspeed_config = "ds_config.json"


def _foreign_parameter() -> dict:
    model = _model()
    return dict(model=model, config=_cfg(), model_parameters=[*model.parameters(), torch.nn.Parameter(torch.zeros(3))])


def _parameter_twice() -> dict:
    model = _model()
    params = list(model.parameters())
    return dict(model=model, config=_cfg(), model_parameters=[{"params": params[:3]}, {"params": params[2:]}])


CASES = {
    "model_not_a_module": (
        lambda: dict(model="meta-llama/Llama-3.2-1B", config=_cfg()),
        "model must be a torch.nn.Module, got str"),
    "config_not_a_mapping": (
        lambda: dict(model=_model(), config=42),
        "config source must be a path, a dict or a Zero3DConfig, got int"),
    "unknown_top_level_key": (
        lambda: dict(model=_model(), config=_cfg(zero_optimisation={"stage": 1})),
        "unknown config key 'zero_optimisation'; did you mean 'zero_optimization'?"),
    "unknown_nested_key": (
        lambda: dict(model=_model(), config=_cfg(zero_optimization={"stag": 1})),
        "unknown config key 'zero_optimization.stag'; did you mean 'zero_optimization.stage'?"),
    "bad_stage": (
        lambda: dict(model=_model(), config=_cfg(zero_optimization={"stage": 4})),
        "zero_optimization.stage: 4 is not allowed; must be one of 0, 1, 2, 3"),
    "fp16_and_bf16": (
        lambda: dict(model=_model(), config=_cfg(fp16={"enabled": True}, bf16={"enabled": True})),
        "fp16.enabled and bf16.enabled are both true; enable at most one"),
    "offload_to_nvme": (
        lambda: dict(model=_model(), config=_cfg(zero_optimization={"stage": 2, "offload_optimizer": {"device": "nvme"}})),
        'zero_optimization.offload_optimizer.device: "nvme" is not supported: Zero3D offloads to CPU memory only (no '
        'NVMe, DeepSpeed\'s ZeRO-Infinity); allowed: "none", "cpu"'),
    "negative_clipping": (
        lambda: dict(model=_model(), config=_cfg(gradient_clipping=-1)),
        "gradient_clipping: -1 must be >= 0"),
    "scheduler_without_optimizer": (
        lambda: dict(model=_model(), config={**_no_optimizer(), "scheduler": {"type": "WarmupLR"}}),
        "the config has a 'scheduler' section but no 'optimizer' section and initialize() got no optimizer=: a "
        "learning-rate schedule needs an optimizer"),
    "optimizer_wrong_type": (
        lambda: dict(model=_model(), config=_no_optimizer(), optimizer=42),
        "optimizer must be a torch.optim.Optimizer or a callable(param_groups), got int"),
    "optimizer_not_in_torch": (
        lambda: dict(model=_model(), config=_cfg(optimizer={"type": "Lamb"})),
        'optimizer.type: "Lamb" is a DeepSpeed optimizer Zero3D does not implement yet; use Adam, AdamW or SGD'),
    "optimizer_param_typo": (
        lambda: dict(model=_model(), config=_cfg(optimizer={"type": "AdamW", "params": {"betas": [0.9, 0.99], "eps_": 1e-8}})),
        "unknown config key 'optimizer.params.eps_' for AdamW; did you mean 'optimizer.params.eps'? allowed: "
        "adam_w_mode, amsgrad, betas, ..."),  # the rest of the list is torch.optim.AdamW's keywords
    "frozen_model": (
        lambda: dict(model=_frozen(), config=_cfg()),
        "the model has no trainable parameters (requires_grad=True)"),
    "foreign_parameter": (
        _foreign_parameter,
        "model_parameters holds a parameter that is not a parameter of the model"),
    "parameter_in_two_groups": (
        _parameter_twice,
        "model_parameters lists a parameter twice (in two param groups?)"),
    "config_path_missing": (
        lambda: dict(model=_model(), config="/nonexistent/zero3d/ds_config.json"),
        "config file /nonexistent/zero3d/ds_config.json cannot be read: No such file or directory"),
    "config_path_extension": (
        lambda: dict(model=_model(), config="ds_config.txt"),
        "config file ds_config.txt: unsupported extension '.txt'; use .json, .yaml or .yml"),
    "bad_scheduler_type": (
        lambda: dict(model=_model(), config=_cfg(scheduler={"type": "Cosine"})),
        'scheduler.type: "Cosine" is not allowed; must be one of WarmupLR, WarmupDecayLR, WarmupCosineLR, '
        "OneCycle, LRRangeTest"),
    "deepspeed_zero_init": (
        _deepspeed_partitioned,
        "21 parameters of the model (model.embed_tokens.weight, model.layers.0.self_attn.q_proj.weight, "
        "model.layers.0.self_attn.k_proj.weight, ...) were partitioned by deepspeed.zero.Init: each rank holds an "
        "empty DeepSpeed shard that Zero3D cannot train. Build the model without deepspeed.zero.Init; for a model "
        "too big for one rank, build it on the meta device..."),
    "mpu": (
        lambda: dict(model=_model(), config=_cfg(), mpu=object()),
        "mpu= is not supported: Zero3D builds its tensor- and pipeline-parallel groups itself from "
        "tensor_parallel.size and pipeline.stages in the config; pass no mpu"),
    "config_twice": (
        lambda: dict(model=_model(), config=_cfg(), args=_Args()),
        "the config was given twice (config and args.deepspeed_config); give it once, as config="),
    "no_config": (
        lambda: dict(model=_model()),
        "no config: pass config= (a DeepSpeed JSON/YAML path or a dict), or args with a deepspeed_config "
        "attribute as deepspeed.initialize reads it"),
    "dist_init_not_done": (
        lambda: dict(model=_model(), config=_cfg(), dist_init_required=False),
        "dist_init_required=False but torch.distributed is not initialized..."),
    "scheduler_param_typo": (
        lambda: dict(model=_model(), config=_cfg(scheduler={"type": "WarmupLR", "params": {"warmup_num_step": 3}})),
        "unknown config key 'scheduler.params.warmup_num_step'; did you mean 'scheduler.params.warmup_num_steps'?"),
    "batch_arithmetic": (
        lambda: dict(model=_model(), config=_cfg(train_batch_size=6, train_micro_batch_size_per_gpu=4)),
        "train_batch_size 6 != train_micro_batch_size_per_gpu 4 x gradient_accumulation_steps 1 x data-parallel size 1"),
    "no_batch_size": (
        lambda: dict(model=_model(), config={"optimizer": {"type": "AdamW"}}),
        "neither train_batch_size nor train_micro_batch_size_per_gpu is set; set at least one of them "
        "(gradient_accumulation_steps alone does not fix the batch size)"),
    "tp_in_one_process": (
        lambda: dict(model=_model(), config=_cfg(tensor_parallel={"size": 2})),
        "world size 1 is not divisible by tensor_parallel.size 2 x pipeline.stages 1 = 2"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_single_process(case):
    assert not torch.distributed.is_initialized()
    make_kwargs, message = CASES[case]
    with pytest.raises(ConfigError) as info:
        parallel3d.initialize(**make_kwargs())
    if message.endswith("..."):  # a prefix: what follows depends on the torch version
        assert str(info.value).startswith(message[:-3]), str(info.value)
    else:
        assert str(info.value) == message



def test_no_model_is_also_an_assertion_error_as_deepspeeds():
    """DeepSpeed asserts a model is given; a script (or DeepSpeed's TestNoModel) expecting that keeps working."""
    with pytest.raises(AssertionError, match="model must be a torch.nn.Module, got NoneType") as info:
        parallel3d.initialize(model=None, config=_cfg())
    assert isinstance(info.value, ConfigError)
    with pytest.raises(ConfigError, match="first positional argument is the model .DeepSpeed's is args.: pass args="):
        parallel3d.initialize(argparse.Namespace(deepspeed_config="ds.json"), _model())

# --- checks that depend on the world size: 2 ranks ---------------------------------------------

WORLD_CASES = {
    "train_batch_size_not_dp": (
        {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1},
        "train_batch_size 2 != train_micro_batch_size_per_gpu 2 x gradient_accumulation_steps 1 x data-parallel size 2"),
    "derived_accumulation_rounds_down": (
        {"train_batch_size": 6, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": None},
        "train_batch_size 6 != train_micro_batch_size_per_gpu 2 x gradient_accumulation_steps 1 x data-parallel "
        "size 2 (gradient_accumulation_steps derived from the others by DeepSpeed's rule)"),
    "world_not_divisible_by_tp": (
        {"tensor_parallel": {"size": 4}},
        "world size 2 is not divisible by tensor_parallel.size 4 x pipeline.stages 1 = 4"),
    "pp_partition_sum": (
        {"pipeline": {"stages": 2, "partition": [1, 2]}, "train_batch_size": 2},
        "pipeline.partition [1, 2] sums to 3 blocks but LlamaForCausalLM has 2 blocks (model.layers)"),
    # the harness's group is gloo; CUDA is named, not touched (refused before any tensor is placed)
    "pp_over_gloo_on_cuda": (
        {"pipeline": {"stages": 2}, "train_batch_size": None, "gradient_accumulation_steps": 2},
        "pipeline.stages > 1 on CUDA needs a process group that can send CUDA tensors point to point, and this one "
        "is gloo: initialize it with backend 'nccl' (or let initialize create it), or run on the CPU",
        {"device": "cuda"}),
}


def world_errors() -> dict[str, str]:
    """On every rank: the error each WORLD_CASES config gives (or "no error")."""
    out = {}
    for case, (updates, _, *kwargs) in WORLD_CASES.items():
        cfg = {**ds_config(0, 1, 2), **updates}
        cfg = {k: v for k, v in cfg.items() if v is not None}
        try:
            parallel3d.initialize(model=make_model("llama"), config=cfg, **(kwargs[0] if kwargs else {}))
            out[case] = "no error"
        except Exception as exc:  # noqa: BLE001 - the type is asserted by the test
            out[case] = f"{type(exc).__name__}: {exc}"
    return out


def test_world_size_dependent(dist):
    results = dist.run(2, world_errors, timeout=90)
    for rank, got in enumerate(results):
        for case, (_, message, *_) in WORLD_CASES.items():
            assert got[case] == f"ConfigError: {message}", (rank, case)

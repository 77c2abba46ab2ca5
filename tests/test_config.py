"""Tests of parallel3d.config.config: DeepSpeed JSON/YAML in, typed config out, one clear error otherwise.

DeepSpeed itself (installed as a test dependency) is the oracle for the batch-size rule and the
defaults; its config parser runs without torch.distributed being initialized.
"""

import ast
import json
import re
from pathlib import Path

import pytest
import yaml

from parallel3d.config.config import IGNORED_KEYS, Zero3DConfig, load_config, resolve_batch_sizes
from parallel3d.config.sections import (
    BF16Config, FP16Config, OptimizerConfig, PipelineConfig, SchedulerConfig, Section, TensorParallelConfig,
    WarmupCosineLRParams, WarmupDecayLRParams, WarmupLRParams, ZeroConfig)
from parallel3d.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]

DS_CONFIG = {  # a typical DeepSpeed ZeRO-2 config, as DeepSpeed users write it
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 2,
    "steps_per_print": 50,
    "gradient_clipping": 1.0,
    "optimizer": {"type": "Adam", "params": {"lr": 2e-5, "betas": [0.9, 0.999], "eps": 1e-8,
                                             "weight_decay": 0.01, "torch_adam": True}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 2e-5,
                                                      "warmup_num_steps": 500, "total_num_steps": 10000}},
    "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 12, "loss_scale_window": 500,
             "hysteresis": 2, "min_loss_scale": 1},
    "zero_optimization": {"stage": 2, "allgather_partitions": True, "allgather_bucket_size": 2e8,
                          "overlap_comm": True, "reduce_scatter": True, "reduce_bucket_size": 2e8,
                          "contiguous_gradients": True, "offload_optimizer": {"device": "none"}},
    "zero_allow_untested_optimizer": True,
    "wall_clock_breakdown": False,
    "flops_profiler": {"enabled": False},
}


@pytest.fixture(scope="module")
def deepspeed_config():
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.config import DeepSpeedConfig
    return DeepSpeedConfig


def deepspeed_batch_rule(DeepSpeedConfig, train_batch, micro_batch, grad_acc, dp):
    """DeepSpeed's own derivation, run on a bare DeepSpeedConfig with world_size = dp."""
    ds = object.__new__(DeepSpeedConfig)
    ds.world_size = dp
    ds.train_batch_size, ds.train_micro_batch_size_per_gpu, ds.gradient_accumulation_steps = (
        train_batch, micro_batch, grad_acc)
    ds._configure_train_batch_size()
    return ds.train_batch_size, ds.train_micro_batch_size_per_gpu, ds.gradient_accumulation_steps


# --- loading ----------------------------------------------------------------------------------


def test_deepspeed_json_loads_unchanged(tmp_path, deepspeed_config):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(DS_CONFIG, indent=2))
    deepspeed_config(str(path))  # DeepSpeed accepts the very same file (world size 1)
    cfg = load_config(path, world_size=8)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (64, 4, 2)
    assert cfg.data_parallel_size == 8 and cfg.world_size == 8
    assert cfg.zero_optimization.stage == 2 and cfg.zero_optimization.reduce_bucket_size == 200_000_000
    assert isinstance(cfg.zero_optimization.allgather_bucket_size, int)
    assert cfg.fp16.enabled and cfg.fp16.dynamic_loss_scale and cfg.fp16.initial_scale_power == 12
    assert cfg.precision == "fp16" and cfg.steps_per_print == 50
    assert cfg.optimizer.type == "Adam" and cfg.optimizer.torch_optimizer_class_name() == "AdamW"
    assert cfg.scheduler.typed_params()["total_num_steps"] == 10000


def test_yaml_gives_the_same_config_as_json(tmp_path):
    (tmp_path / "c.json").write_text(json.dumps(DS_CONFIG))
    yaml_text = yaml.safe_dump(DS_CONFIG).replace("2.0e-05", "2e-5")  # as a person would write it
    (tmp_path / "c.yaml").write_text(yaml_text)
    (tmp_path / "c.yml").write_text(yaml_text)
    from_json = load_config(str(tmp_path / "c.json"), 4).model_dump()
    assert load_config(tmp_path / "c.yaml", 4).model_dump() == from_json
    assert load_config(tmp_path / "c.yml", 4).model_dump() == from_json


def test_yaml_reads_scientific_notation_as_numbers(tmp_path):
    (tmp_path / "c.yaml").write_text("train_micro_batch_size_per_gpu: 1\n"
                                     "optimizer: {type: sgd, params: {lr: 1e-3, momentum: 0.9}}\n"
                                     "zero_optimization: {stage: 3, reduce_bucket_size: 5e8}\n")
    cfg = load_config(tmp_path / "c.yaml", 1)
    assert cfg.optimizer.params["lr"] == 1e-3 and cfg.optimizer.type == "SGD"
    assert cfg.zero_optimization.reduce_bucket_size == 500_000_000


def test_dict_and_config_inputs():
    cfg = load_config({"train_micro_batch_size_per_gpu": 2}, world_size=4)
    assert (cfg.train_batch_size, cfg.gradient_accumulation_steps, cfg.data_parallel_size) == (8, 1, 4)
    again = load_config(cfg, world_size=2)  # re-resolved from what the user gave, not from the result
    assert (again.train_batch_size, again.train_micro_batch_size_per_gpu) == (4, 2)
    unresolved = Zero3DConfig.from_dict({"train_batch_size": 16})
    assert load_config(unresolved, 8).train_micro_batch_size_per_gpu == 2
    with pytest.raises(ConfigError, match="has not been resolved for a world size"):
        unresolved.data_parallel_size


def test_example_configs_load():
    zero2 = load_config(REPO / "configs" / "ds_zero2.json", world_size=2)
    assert zero2.zero_optimization.stage == 2 and not zero2.bf16.enabled
    assert zero2.gradient_clipping == 1.0 and zero2.train_batch_size == 16
    assert zero2.optimizer.torch_optimizer_class_name() == "AdamW" and zero2.scheduler.type == "WarmupLR"
    zero3 = load_config(REPO / "configs" / "zero3.yaml", world_size=2)
    assert zero3.zero_optimization.stage == 3
    assert zero3.model_dump(exclude={"zero_optimization"}) == zero2.model_dump(exclude={"zero_optimization"})


def test_example_json_is_accepted_by_deepspeed(deepspeed_config):
    ds = deepspeed_config(str(REPO / "configs" / "ds_zero2.json"))
    assert ds.zero_optimization_stage == 2 and ds.gradient_accumulation_steps == 2


# --- batch sizes: DeepSpeed's rule over the data-parallel size ---------------------------------

BATCH_CASES = [  # (train_batch_size, micro, accumulation, world, tp, pp)
    (32, 4, 2, 4, 1, 1),          # all three given and consistent
    (32, 4, None, 4, 1, 1),       # accumulation derived
    (32, None, 2, 4, 1, 1),       # micro derived
    (None, 4, 2, 4, 1, 1),        # train batch derived
    (32, None, None, 4, 1, 1),    # micro derived, accumulation 1
    (None, 4, None, 4, 1, 1),     # train batch derived, accumulation 1
    (48, 3, None, 16, 2, 2),      # dp = 16 / (2 x 2) = 4
    (None, 2, 8, 8, 2, 1),        # dp = 4
]


@pytest.mark.parametrize("tb,mb,ga,world,tp,pp", BATCH_CASES)
def test_batch_derivation_matches_deepspeed(deepspeed_config, tb, mb, ga, world, tp, pp):
    raw = {k: v for k, v in zip(("train_batch_size", "train_micro_batch_size_per_gpu",
                                 "gradient_accumulation_steps"), (tb, mb, ga)) if v is not None}
    cfg = load_config({**raw, "tensor_parallel": {"size": tp}, "pipeline": {"stages": pp}}, world)
    dp = world // (tp * pp)
    assert cfg.data_parallel_size == dp
    ours = (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps)
    assert ours == deepspeed_batch_rule(deepspeed_config, tb, mb, ga, dp)
    assert all(type(v) is int for v in ours)


@pytest.mark.parametrize("tb,mb,ga,dp,message", [
    (10, 3, 2, 1, "train_batch_size 10 != train_micro_batch_size_per_gpu 3 x gradient_accumulation_steps 2 "
                  "x data-parallel size 1"),
    (10, 3, None, 1, "train_batch_size 10 != train_micro_batch_size_per_gpu 3 x gradient_accumulation_steps 3 "
                     "x data-parallel size 1 (gradient_accumulation_steps derived from the others by "
                     "DeepSpeed's rule)"),
    (2, None, None, 4, "train_batch_size 2 != train_micro_batch_size_per_gpu 0 x gradient_accumulation_steps 1 "
                       "x data-parallel size 4 (train_micro_batch_size_per_gpu derived from the others by "
                       "DeepSpeed's rule)"),
])
def test_inconsistent_batch_sizes_fail_like_deepspeed(deepspeed_config, tb, mb, ga, dp, message):
    with pytest.raises(AssertionError):
        deepspeed_batch_rule(deepspeed_config, tb, mb, ga, dp)
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        resolve_batch_sizes(tb, mb, ga, data_parallel_size=dp)


# --- defaults, aliases, optimizer and scheduler -----------------------------------------------


def test_defaults_are_deepspeeds(deepspeed_config):
    from deepspeed.runtime import constants
    from deepspeed.runtime.precision_config import DeepSpeedFP16Config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    ds_zero, ours = DeepSpeedZeroConfig(), ZeroConfig()
    # DeepSpeed 0.19 removed MiCS and now refuses its keys; its last defaults were -1 and false
    removed = {"mics_shard_size": -1, "mics_hierarchical_params_gather": False}
    for name, value in ours.model_dump().items():
        if name in removed:
            assert value == removed[name], name
            continue
        ds_name = name.replace("stage3_", "") if name.startswith("stage3_") else name
        assert getattr(ds_zero, ds_name) == value, name
    assert ZeroConfig(stage=3).overlap_comm and DeepSpeedZeroConfig(stage=3).overlap_comm
    ds_fp16 = DeepSpeedFP16Config()
    assert all(getattr(ds_fp16, k) == v for k, v in FP16Config().model_dump().items())
    assert Zero3DConfig().gradient_clipping == constants.GRADIENT_CLIPPING_DEFAULT


def test_optimizer_resolves_like_deepspeed():
    import torch

    def opt(type_, **params):
        return OptimizerConfig(type=type_, params=params)

    assert opt("adam").torch_optimizer_class_name() == "AdamW"  # DeepSpeed's adam_w_mode defaults to true
    assert opt("Adam", adam_w_mode=False).torch_optimizer_class_name() == "Adam"
    assert opt("ADAMW", adam_w_mode=False).torch_optimizer_class_name() == "AdamW"
    assert opt("sgd", lr=0.1).type == "SGD"
    # Fused/CPU Adam default weight_decay is 0.0; torch.optim.AdamW's is 0.01 (kept with torch_adam)
    assert opt("Adam", lr=1e-3, adam_w_mode=True).torch_optimizer_kwargs() == {"lr": 1e-3, "weight_decay": 0.0}
    assert opt("AdamW", lr=1e-3, torch_adam=True).torch_optimizer_kwargs() == {"lr": 1e-3}
    assert opt("Adam", adam_w_mode=False, betas=[0.9, 0.95]).torch_optimizer_kwargs() == {"betas": (0.9, 0.95)}
    for cfg in (opt("Adam", lr=1e-3, betas=[0.8, 0.9]), opt("SGD", lr=0.1, momentum=0.9, nesterov=True)):
        cls = getattr(torch.optim, cfg.torch_optimizer_class_name())
        cls([torch.nn.Parameter(torch.zeros(2))], **cfg.torch_optimizer_kwargs())


def test_scheduler_params_get_deepspeed_defaults():
    assert SchedulerConfig(type="WarmupLR").typed_params() == {
        "warmup_min_lr": 0.0, "warmup_max_lr": None, "warmup_num_steps": 1000, "warmup_type": "log"}
    assert SchedulerConfig(type="WarmupDecayLR", params={"total_num_steps": 10}).typed_params()[
        "warmup_max_lr"] == 0.001
    assert SchedulerConfig(type="WarmupCosineLR", params={"total_num_steps": 10}).typed_params() == {
        "total_num_steps": 10, "warmup_min_ratio": 0.0, "warmup_num_steps": 1000, "cos_min_ratio": 0.0001,
        "warmup_type": "log"}


def test_deepspeed_synonyms_and_harmless_keys_are_accepted():
    cfg = load_config({"train_micro_batch_size_per_gpu": 1, "bfloat16": {"enabled": True},
                       "tensor_parallel": {"autotp_size": 2}, **{k: False for k in IGNORED_KEYS},
                       "zero_optimization": {"stage": 3, "prefetch_bucket_size": 10,
                                             "stage3_gather_fp16_weights_on_model_save": True,
                                             "offload_param": {"device": "none"}, "zero_hpz_partition_size": 1},
                       "prescale_gradients": False, "tensorboard": {"enabled": False, "output_path": "x"},
                       "fp16": {"auto_cast": False},
                       "checkpoint": {"tag_validation": "Warn", "load_universal": True,
                                      "parallel_write": {"pipeline_stage": True}, "async_save": True}}, world_size=4)
    assert cfg.checkpoint.async_save
    assert cfg.bf16.enabled and cfg.precision == "bf16" and cfg.tensor_parallel.size == 2
    assert cfg.data_parallel_size == 2 and cfg.zero_optimization.stage3_prefetch_bucket_size == 10
    assert cfg.zero_optimization.stage3_gather_16bit_weights_on_model_save
    assert load_config({"train_batch_size": 4, "tensor_parallel": {"size": 2, "autotp_size": 2}}, 2)


# --- bad configs: one ConfigError with the exact message --------------------------------------

MB = {"train_micro_batch_size_per_gpu": 1}
BAD_CONFIGS = [
    ({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2}, 1,
     "train_batch_size 10 != train_micro_batch_size_per_gpu 3 x gradient_accumulation_steps 2 x data-parallel size 1"),
    ({**MB, "zero_optimization": {"stage": 5}}, 1, "zero_optimization.stage: 5 is not allowed; must be one of 0, 1, 2, 3"),
    ({**MB, "zero_optimisation": {"stage": 2}}, 1,
     "unknown config key 'zero_optimisation'; did you mean 'zero_optimization'?"),
    ({**MB, "zero_optimization": {"stage": 2, "overlap_com": True}}, 1,
     "unknown config key 'zero_optimization.overlap_com'; did you mean 'zero_optimization.overlap_comm'?"),
    ({**MB, "zero_optimization": {"offload_optimizer": {"device": "cpu"}}}, 1,
     'zero_optimization.offload_optimizer with device "cpu" needs ZeRO stage 1, 2 or 3 (stage 0 shards no optimizer '
     'state); set zero_optimization.stage or remove the key'),
    ({**MB, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme"}}}, 1,
     'zero_optimization.offload_optimizer.device: "nvme" is not supported: Zero3D offloads to CPU memory only (no '
     'NVMe, DeepSpeed\'s ZeRO-Infinity); allowed: "none", "cpu"'),
    ({**MB, "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}, 1,
     'zero_optimization.offload_param.device: "nvme" is not supported: Zero3D offloads to CPU memory only'),
    ({**MB, "zero_optimization": {"stage": 3, "offload_param": {"device": "gpu"}}}, 1,
     'zero_optimization.offload_param.device: "gpu" is not an offload device; allowed: "none", "cpu"'),
    ({**MB, "zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}, 1,
     'zero_optimization.offload_param with device "cpu" needs ZeRO stage 3 (parameters are sharded only there), '
     'got stage 2; set zero_optimization.stage to 3, or use offload_optimizer at stages 1-2'),
    ({**MB, "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}, 1,
     'zero_optimization.offload_param with device "cpu" needs at least 2 ranks to shard over (data-parallel ranks, '
     "or with zero_optimization.mics_shard_size the ranks of one shard group): with one, ZeRO stage 3 keeps every "
     "parameter whole on the device (nothing is sharded, so nothing would be offloaded)"),
    ({**MB, "zero_optimization": {"stage": 1, "cpu_offload_param": True}}, 1,
     'zero_optimization.offload_param with device "cpu" needs ZeRO stage 3'),
    ({**MB, "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.3}}}, 1,
     "zero_optimization.offload_optimizer.ratio: 0.3 is not supported: Zero3D offloads all optimizer states and "
     "master weights, not a share of them (DeepSpeed's partial offload); allowed: 1.0"),
    ({**MB, "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 2}}}, 1,
     "zero_optimization.offload_optimizer.ratio: 2 must be <= 1.0"),
    ({**MB, "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "super_offload": True}}}, 1,
     "zero_optimization.offload_optimizer.super_offload: true is not supported: Zero3D does not implement "
     "DeepSpeed's SuperOffload; allowed: false"),
    ({**MB, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memry": True}}}, 1,
     "unknown config key 'zero_optimization.offload_optimizer.pin_memry'; did you mean "
     "'zero_optimization.offload_optimizer.pin_memory'?"),
    ({**MB, "zero_optimization": {"stage": 2, "cpu_offload": True, "offload_optimizer": {"device": "cpu"}}}, 1,
     "zero_optimization.cpu_offload is DeepSpeed's deprecated spelling of offload_optimizer; give only "
     "offload_optimizer"),
    ({**MB, "zero_optimization": {"stage": 2, "cpu_offload": "yes"}}, 1,
     'zero_optimization.cpu_offload must be true or false, got "yes"'),
    ({**MB, "data_types": {"param_dtype": "half"}}, 1,
     'data_types.param_dtype: "fp16" with fp32 working params: the working precision is chosen by fp16.enabled / '
     'bf16.enabled; leave it unset or set "fp32"'),
    ({**MB, "data_types": {"buffer_dtype": "int8"}}, 1, 'data_types.buffer_dtype: "int8" is not a dtype'),
    ({**MB, "gradient_allreduce_op": "max"}, 1, 'gradient_allreduce_op: "max" is invalid'),
    ({**MB, "gradient_predivide_factor": 0}, 1, "gradient_predivide_factor: 0 must be > 0"),
    ({**MB, "bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}}, 1,
     'data_types.grad_accum_dtype: "fp32" with bf16 working params: Zero3D accumulates gradients in the working '
     'precision; leave it unset or set "bf16"'),
    ({**MB, "activation_checkpointing": {"partition_activations": True}}, 1,
     "activation_checkpointing is a DeepSpeed key Zero3D does not implement yet"),
    ({**MB, "wandb": {"enabled": True}}, 1, "wandb is a DeepSpeed key Zero3D does not implement yet"),
    ({**MB, "fp16": {"enabled": True}, "bf16": {"enabled": True}}, 1,
     "fp16.enabled and bf16.enabled are both true; enable at most one"),
    ({"gradient_accumulation_steps": 4}, 1,
     "neither train_batch_size nor train_micro_batch_size_per_gpu is set; set at least one of them "
     "(gradient_accumulation_steps alone does not fix the batch size)"),
    ({"train_micro_batch_size_per_gpu": 0}, 1, "train_micro_batch_size_per_gpu: 0 must be > 0"),
    ({"train_batch_size": -8}, 1, "train_batch_size: -8 must be > 0"),
    ({"train_micro_batch_size_per_gpu": "auto"}, 1, 'train_micro_batch_size_per_gpu: "auto" must be an integer'),
    ({**MB, "tensor_parallel": {"size": 4}, "pipeline": {"stages": 2}}, 12,
     "world size 12 is not divisible by tensor_parallel.size 4 x pipeline.stages 2 = 8"),
    ({**MB, "tensor_parallel": {"size": 2, "autotp_size": 4}}, 8,
     "tensor_parallel.autotp_size = 4 differs from tensor_parallel.size = 2; they are the same setting, give one"),
    ({**MB, "optimizer": {"type": "SGD", "params": {"lr": 0.1, "betas": [0.9, 0.99]}}}, 1,
     "unknown config key 'optimizer.params.betas' for SGD; allowed: dampening, differentiable, foreach, fused, "
     "lr, maximize, momentum, nesterov, weight_decay"),
    ({**MB, "optimizer": {"type": "AdamW", "params": {"weight_decy": 0.1}}}, 1,
     "unknown config key 'optimizer.params.weight_decy' for AdamW; did you mean 'optimizer.params.weight_decay'? "
     "allowed: adam_w_mode, amsgrad, betas,"),
    ({**MB, "optimizer": {"type": "OneBitAdam"}}, 1,
     'optimizer.type: "OneBitAdam" is a DeepSpeed optimizer Zero3D does not implement yet; use Adam, AdamW or SGD'),
    ({**MB, "optimizer": {"type": "Adam", "params": {"max_grad_norm": 1.0}}}, 1,
     "optimizer.params.max_grad_norm is not supported (as in DeepSpeed); use the top-level gradient_clipping"),
    ({**MB, "scheduler": {"type": "OneCycle", "params": {"cycle_max_lr": 0.1}}}, 1,
     "scheduler.params.cycle_min_lr is required"),
    ({**MB, "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10}}}, 1,
     "scheduler.params.total_num_steps is required"),
    ({**MB, "scheduler": {"type": "WarmupLR", "params": {"warmup_type": "cosine"}}}, 1,
     'scheduler.params.warmup_type: "cosine" is not allowed; must be one of "log", "linear"'),
    ({**MB, "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 5, "cos_min_ration": 0}}}, 1,
     "unknown config key 'scheduler.params.cos_min_ration'; did you mean 'scheduler.params.cos_min_ratio'?"),
    ({**MB, "gradient_clipping": -1.0}, 1, "gradient_clipping: -1.0 must be >= 0"),
    ({**MB, "zero_optimization": {"reduce_bucket_size": 2.5}}, 1,
     "zero_optimization.reduce_bucket_size: 2.5 must be a whole number"),
    ({**MB, "zero_optimization": True}, 1, "zero_optimization: true must be a mapping of keys to values"),
    ({**MB, "fp16": {"enabled": "maybe"}}, 1, 'fp16.enabled: "maybe" must be true or false'),
    ({**MB, "bf16": {"enabled": True}, "bfloat16": {"enabled": False}}, 1,
     "bfloat16 and bf16 are the same setting; give only one"),
    ({**MB, "amp": {"enabled": True}}, 1, "amp is a DeepSpeed key Zero3D does not implement yet"),
    ({**MB, "checkpoint": {"use_node_local_storage": True}}, 1,
     "checkpoint.use_node_local_storage is a DeepSpeed key Zero3D does not implement yet"),
    ({**MB, "checkpoint": {"async": True}}, 1, "unknown config key 'checkpoint.async'"),
    ({**MB, "seed": 1234}, 1, "unknown config key 'seed'; keys Zero3D implements: bf16, checkpoint, comm, compile, context_parallel, data_types, dataloader_drop_last, expert_parallel, fp16,"),
    ({**MB, "comm": {"timeout_s": 0}}, 1, "comm.timeout_s: 0 must be >= 0.001"),
    ({**MB, "comm": {"timeout": 60}}, 1, "unknown config key 'comm.timeout'; did you mean 'comm.timeout_s'?"),
]


@pytest.mark.parametrize("config,world_size,message", BAD_CONFIGS, ids=[m[:40] for _, _, m in BAD_CONFIGS])
def test_bad_config_message(config, world_size, message):
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}"):
        load_config(config, world_size)


@pytest.mark.parametrize("name,text,message", [
    ("missing.json", None, "config file {path} cannot be read: No such file or directory"),
    ("bad.json", '{"train_batch_size": 8', "config file {path} is not valid JSON: "
                                           "Expecting ',' delimiter at line 1 column 23"),  # nor Hjson
    ("dup.json", '{"train_batch_size": 8, "train_batch_size": 4}',
     "config file {path} is not valid JSON: duplicate key 'train_batch_size'"),
    ("bad.yaml", "train_batch_size: [8\n", "config file {path} is not valid YAML: expected ',' or ']', "
                                           "but got '<stream end>' at line 2 column 1"),
    ("dup.yml", "fp16: {enabled: true}\nfp16: {enabled: false}\n",
     "config file {path} is not valid YAML: duplicate key 'fp16' at line 2 column 1"),
    ("list.yaml", "- train_batch_size: 8\n",
     "config file {path} must hold a mapping of config keys at the top level, got list"),
    ("config.toml", "x = 1", "config file {path}: unsupported extension '.toml'; use .json, .yaml or .yml"),
])
def test_bad_file_message(tmp_path, name, text, message):
    path = tmp_path / name
    if text is not None:
        path.write_text(text)
    with pytest.raises(ConfigError, match=f"^{re.escape(message.format(path=path))}"):
        load_config(str(path), 1)


def test_bad_sources_and_world_sizes():
    with pytest.raises(ConfigError, match=r"^config source must be a path, a dict or a Zero3DConfig, got list$"):
        load_config([("train_batch_size", 8)], 1)
    with pytest.raises(ConfigError, match=r"^world_size: 0 must be a positive integer$"):
        load_config(MB, 0)


# --- shape of the module ------------------------------------------------------------------------


def test_every_field_has_a_docstring():
    models = [Zero3DConfig, FP16Config, BF16Config, ZeroConfig, TensorParallelConfig, PipelineConfig,
              OptimizerConfig, SchedulerConfig, WarmupLRParams, WarmupDecayLRParams, WarmupCosineLRParams]
    for model in models:
        assert issubclass(model, Section)
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no docstring"


def test_config_modules_do_not_import_torch_distributed():
    for name in ("config/config.py", "config/sections.py"):
        tree = ast.parse((REPO / "parallel3d" / name).read_text())
        imported = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        imported += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        assert not [m for m in imported if m.startswith("torch.distributed") or m == "deepspeed"], name


def test_sequence_parallel_with_pipeline_stages_loads():
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2, "pipeline": {"stages": 2},
              "tensor_parallel": {"size": 2, "sequence_parallel": True}}
    cfg = load_config(config, 4)
    assert cfg.pipeline.stages == 2 and cfg.tensor_parallel.sequence_parallel


def test_interleaving_is_checked_against_the_micro_batch_count_at_load():
    """Interleaved 1F1B with a micro-batch count it cannot run is refused with the config, not at the
    first step; 1f1b and zb_h1 take any count (DeepSpeed's pipeline configs with one micro-batch load)."""
    interleaved = {"stages": 2, "schedule": "interleaved_1f1b", "virtual_stages": 2}
    with pytest.raises(ConfigError, match=re.escape(
            "schedule 'interleaved_1f1b' needs the number of micro-batches to be a multiple of the number of "
            "pipeline stages (Megatron's rule: micro-batches run in rounds of 2), got 3 micro-batches for 2 stages")):
        load_config({"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 3, "pipeline": interleaved}, 2)
    load_config({"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 4, "pipeline": interleaved}, 2)
    for schedule in ("1f1b", "zb_h1"):
        load_config({"train_micro_batch_size_per_gpu": 1, "pipeline": {"stages": 4, "schedule": schedule}}, 4)


# --- ZeRO-Offload blocks: DeepSpeed's fields and values ---------------------------------------

OFFLOAD_SECTIONS = [
    {"stage": 2, "offload_optimizer": {"device": "cpu"}},
    {"stage": 1, "offload_optimizer": {"device": "cpu", "pin_memory": False, "buffer_count": 8, "fast_init": True,
                                       "pipeline_read": True, "nvme_path": "/local_nvme"}},
    {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 1.0}, "offload_param": {"device": "cpu",
     "pin_memory": False, "buffer_count": 3, "buffer_size": 1e7, "max_in_cpu": 1e8}},
    {"stage": 3, "offload_param": {"device": "none"}},
    {"stage": 2, "cpu_offload": True, "cpu_offload_use_pin_memory": False},
    {"stage": 3, "cpu_offload_param": True, "cpu_offload": False},
]


@pytest.mark.parametrize("section", OFFLOAD_SECTIONS, ids=range(len(OFFLOAD_SECTIONS)))
def test_offload_blocks_read_as_deepspeed_reads_them(section):
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    def fields(block) -> dict | None:
        if block is None:
            return None
        return {k: (v.value if hasattr(v, "value") else str(v) if k == "nvme_path" and v is not None else v)
                for k, v in block.model_dump().items()}

    theirs = DeepSpeedZeroConfig(**section)
    ours = load_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": section}, 2).zero_optimization
    assert fields(ours.offload_optimizer) == fields(theirs.offload_optimizer)
    assert fields(ours.offload_param) == fields(theirs.offload_param)

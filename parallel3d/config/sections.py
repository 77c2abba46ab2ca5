"""Section models of the Zero3D config: one pydantic model per DeepSpeed config block.

Key names and defaults are DeepSpeed's (deepspeed/runtime/config.py, constants.py,
zero/config.py, precision_config.py, lr_schedules.py, engine.py), so a DeepSpeed JSON config
loads unchanged. Each section also lists the DeepSpeed keys it knows but Zero3D does not
implement (`ds_unimplemented`): such a key is accepted only at DeepSpeed's default value,
where spelling it out means the same as leaving it out; any other value is refused.

Validators raise `PydanticCustomError`s of three kinds that `parallel3d.config.config` turns into
one `ConfigError` message:
  zero3d_rule  "<dotted.path>: <value> <rule>"           (a field's value breaks a rule)
  zero3d_key   "<dotted.path>.<key> <rule>"              (a key inside a section is refused)
  zero3d       the message as written                    (a rule across several keys)
"""

from __future__ import annotations

import difflib
import inspect
import json
import math
from typing import Annotated, Any, ClassVar, Literal, Optional, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError
from pydantic import field_validator, model_validator
from pydantic_core import PydanticCustomError

NOT_SET = object()
"""`ds_unimplemented` marker: no value of this key is harmless; any value is refused."""

NOT_IMPLEMENTED = "is a DeepSpeed key Zero3D does not implement yet"


def rule(text: str) -> PydanticCustomError:
    return PydanticCustomError("zero3d_rule", "{rule}", {"rule": text})


def key_rule(key: str, text: str) -> PydanticCustomError:
    return PydanticCustomError("zero3d_key", "{key} {rule}", {"key": key, "rule": text})


def problem(text: str) -> PydanticCustomError:
    return PydanticCustomError("zero3d", "{message}", {"message": text})


def disabled_block(value: Any) -> bool:
    """Harmless value of a DeepSpeed feature block: absent, or present with enabled false."""
    return value is None or (isinstance(value, dict) and value.get("enabled", False) is False)


def _to_int(value: Any) -> Any:
    """Accept 5e8 written as a float (JSON) or as a string (YAML); refuse true/false."""
    if isinstance(value, bool):
        raise rule("must be an integer, not true/false")
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise rule("must be an integer") from None
    if isinstance(value, float):
        if not value.is_integer():
            raise rule("must be a whole number")
        return int(value)
    return value


def all_finite(value: Any) -> bool:
    """No float in ``value`` (a number, or a list/tuple of them, nested) is inf or nan."""
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, (list, tuple)):
        return all(all_finite(v) for v in value)
    return True


def _to_float(value: Any) -> Any:
    if isinstance(value, bool):
        raise rule("must be a number, not true/false")
    return value


Int = Annotated[int, BeforeValidator(_to_int)]
PositiveInt = Annotated[int, BeforeValidator(_to_int), Field(gt=0)]
NonNegInt = Annotated[int, BeforeValidator(_to_int), Field(ge=0)]
NonNegFloat = Annotated[float, BeforeValidator(_to_float), Field(ge=0)]
PositiveFloat = Annotated[float, BeforeValidator(_to_float), Field(gt=0)]


class Section(BaseModel):
    """Base of every config block: unknown keys are errors; DeepSpeed-only keys are checked."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, allow_inf_nan=False)

    ds_unimplemented: ClassVar[dict[str, Any]] = {}
    """DeepSpeed key -> its default (harmless) value, NOT_SET, or a predicate on the value."""
    renames: ClassVar[dict[str, str]] = {}
    """DeepSpeed spellings accepted as synonyms: other name -> field name."""

    @classmethod
    def known_keys(cls) -> list[str]:
        return [*cls.model_fields, *cls.ds_unimplemented, *cls.renames]

    @model_validator(mode="before")
    @classmethod
    def _screen_deepspeed_keys(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for key in [k for k in data if k in cls.ds_unimplemented]:
            harmless = cls.ds_unimplemented[key]
            value = data.pop(key)
            ok = harmless(value) if callable(harmless) else (harmless is not NOT_SET and value == harmless)
            if not ok:
                raise key_rule(key, NOT_IMPLEMENTED)
        for other, name in cls.renames.items():
            if other in data:
                if name in data and data[name] != data[other]:
                    raise key_rule(other, f"and {name} are the same setting; give only one")
                data[name] = data.pop(other)
        return data


class FP16Config(Section):
    """`fp16`: float16 working weights with (dynamic) loss scaling, DeepSpeed's semantics."""

    ds_unimplemented = {"auto_cast": False, "fp16_master_weights_and_grads": False}

    enabled: bool = False
    """Train with float16 working params and an fp32 master copy."""
    loss_scale: NonNegFloat = 0.0
    """Static loss scale; 0 selects dynamic loss scaling."""
    initial_scale_power: NonNegInt = 16
    """Dynamic scaling starts at 2**initial_scale_power."""
    loss_scale_window: PositiveInt = 1000
    """Steps without overflow before the dynamic scale is doubled."""
    hysteresis: PositiveInt = 2
    """Overflows tolerated before the dynamic scale is halved (delayed shift)."""
    consecutive_hysteresis: bool = False
    """Refill the hysteresis counter after every step without overflow."""
    min_loss_scale: PositiveFloat = 1.0
    """Floor of the dynamic loss scale."""

    @property
    def dynamic_loss_scale(self) -> bool:
        return self.loss_scale == 0


class BF16Config(Section):
    """`bf16` (DeepSpeed also reads the old name `bfloat16`): bfloat16 working weights."""

    ds_unimplemented = {"immediate_grad_update": False, "check_overflow": False,
                        "bf16_master_weights_and_grads": False, "bf16_optimizer_states": False}

    enabled: bool = False
    """Train with bfloat16 working params and an fp32 master copy (no loss scaling)."""
    check_grad_overflow: bool = True
    """Skip an optimizer step whose gradients hold inf or nan (DeepSpeed's default). False applies
    such a step (the parameters become inf/nan), as DeepSpeed does."""


_DTYPE_NAMES = {"fp32": "fp32", "float32": "fp32", "float": "fp32", "torch.float32": "fp32",
                "fp16": "fp16", "float16": "fp16", "half": "fp16", "torch.float16": "fp16",
                "bf16": "bf16", "bfloat16": "bf16", "torch.bfloat16": "bf16"}
"""DeepSpeed's DtypeEnum spellings -> fp32 / fp16 / bf16."""


def _dtype_name(value: Any) -> Any:
    if value is None:
        return None
    if not isinstance(value, str) or value.lower() not in _DTYPE_NAMES:
        raise rule("is not a dtype; must be one of fp32, fp16, bf16 (or DeepSpeed's other spellings: "
                   "float32, float16, half, bfloat16, torch.float32, ...)")
    return _DTYPE_NAMES[value.lower()]


DtypeName = Annotated[Optional[str], BeforeValidator(_dtype_name)]


class DataTypesConfig(Section):
    """`data_types`: DeepSpeed's dtype choices besides the fp16/bf16 switch."""

    ds_unimplemented = {"keep_in_fp32_modules": None}

    grad_accum_dtype: DtypeName = None
    """dtype of accumulated gradients: Zero3D keeps them in the working precision (the ZeRO
    paper's 2-byte gradients under mixed precision), so only that value (or unset) is accepted."""
    param_dtype: DtypeName = None
    """dtype of the working params; it must match the fp16/bf16 switch (as DeepSpeed requires)."""
    buffer_dtype: DtypeName = None
    """Cast the model's floating-point buffers to this dtype; unset keeps them as loaded
    (a rotary inv_freq stays fp32 under bf16), DeepSpeed's default."""


# --- ZeRO-Offload: DeepSpeed's deepspeed/runtime/zero/offload_config.py, CPU only --------------
# Keys that only tune DeepSpeed's NVMe swapping or its CPU Adam are accepted with DeepSpeed's
# bounds and change nothing (each says so); keys that change what is offloaded are refused.

_OFFLOAD_DEVICES = ("none", "cpu")
_DEPRECATED_OFFLOAD = {"cpu_offload": "offload_optimizer", "cpu_offload_param": "offload_param"}
"""DeepSpeed's deprecated boolean spellings -> the block they stand for."""


def _offload_device(value: Any) -> Any:
    if value == "nvme":
        raise rule('is not supported: Zero3D offloads to CPU memory only (no NVMe, DeepSpeed\'s ZeRO-Infinity); '
                   'allowed: "none", "cpu"')
    if value not in _OFFLOAD_DEVICES:
        raise rule('is not an offload device; allowed: "none", "cpu"')
    return value


class OffloadParamConfig(Section):
    """`zero_optimization.offload_param`: stage 3 keeps each rank's parameter shards in CPU memory
    and copies a shard to the compute device just before its all-gather."""

    device: str = "none"
    """"cpu" offloads the parameter shards; "none" keeps them on the compute device."""
    pin_memory: bool = True
    """Page-locked host memory (fast, asynchronous copies); only where an accelerator exists."""
    nvme_path: Optional[str] = None
    """DeepSpeed's NVMe swap path: read, no effect (Zero3D does not offload to NVMe)."""
    buffer_count: NonNegInt = 5
    """DeepSpeed's NVMe buffer pool size: read, no effect."""
    buffer_size: NonNegInt = 100_000_000
    """DeepSpeed's NVMe buffer size in elements: read, no effect."""
    max_in_cpu: NonNegInt = 1_000_000_000
    """DeepSpeed's elements kept in CPU memory under NVMe offload: read, no effect."""

    @field_validator("device", mode="before")
    @classmethod
    def _device_allowed(cls, value: Any) -> Any:
        return _offload_device(value)

    @property
    def enabled(self) -> bool:
        return self.device == "cpu"


class OffloadOptimizerConfig(Section):
    """`zero_optimization.offload_optimizer`: the fp32 master shard and the optimizer states live in
    CPU memory and the optimizer steps there (ZeRO-Offload)."""

    device: str = "none"
    """"cpu" offloads master weights and optimizer states; "none" keeps them on the compute device."""
    pin_memory: bool = True
    """Page-locked host memory (fast, asynchronous copies); only where an accelerator exists."""
    nvme_path: Optional[str] = None
    """DeepSpeed's NVMe swap path: read, no effect (Zero3D does not offload to NVMe)."""
    buffer_count: NonNegInt = 4
    """DeepSpeed's NVMe buffer pool size: read, no effect."""
    pipeline_read: bool = False
    """DeepSpeed's NVMe read pipelining: read, no effect."""
    pipeline_write: bool = False
    """DeepSpeed's NVMe write pipelining: read, no effect."""
    fast_init: bool = False
    """DeepSpeed's fast NVMe optimizer initialization: read, no effect."""
    ratio: Annotated[float, BeforeValidator(_to_float), Field(ge=0.0, le=1.0)] = 1.0
    """Share of the optimizer states offloaded; Zero3D offloads all of them (only 1.0 is allowed)."""
    super_offload: bool = False
    """DeepSpeed's SuperOffload for Superchips: not implemented (only false is allowed)."""
    cpuadam_cores_perc: Annotated[float, BeforeValidator(_to_float), Field(ge=0.0, le=1.0)] = 0.8
    """Share of CPU cores DeepSpeed's SuperOffload CPU Adam uses: read, no effect."""

    @field_validator("device", mode="before")
    @classmethod
    def _device_allowed(cls, value: Any) -> Any:
        return _offload_device(value)

    @field_validator("ratio", mode="after")
    @classmethod
    def _whole(cls, ratio: float) -> float:
        if ratio != 1.0:
            raise rule("is not supported: Zero3D offloads all optimizer states and master weights, not a share "
                       "of them (DeepSpeed's partial offload); allowed: 1.0")
        return ratio

    @field_validator("super_offload", mode="after")
    @classmethod
    def _no_super_offload(cls, value: bool) -> bool:
        if value:
            raise rule("is not supported: Zero3D does not implement DeepSpeed's SuperOffload; allowed: false")
        return value

    @property
    def enabled(self) -> bool:
        return self.device == "cpu"


def normalize_offload_keys(data: dict) -> dict:
    """`zero_optimization` with the deprecated spellings turned into their blocks (DeepSpeed's rules)."""
    data = dict(data)
    pin = data.pop("cpu_offload_use_pin_memory", None)  # DeepSpeed does not carry it over either
    if pin is not None and not isinstance(pin, bool):
        raise key_rule("cpu_offload_use_pin_memory", f"must be true or false, got {show(pin)}")
    for old, new in _DEPRECATED_OFFLOAD.items():
        value = data.pop(old, None)
        if value is None:
            continue
        if not isinstance(value, bool):
            raise key_rule(old, f"must be true or false, got {show(value)}")
        if new in data:
            raise key_rule(old, f"is DeepSpeed's deprecated spelling of {new}; give only {new}")
        if value:
            data[new] = {"device": "cpu"}
    return data


def check_offload_stage(stage: int, optimizer: Optional[OffloadOptimizerConfig],
                        param: Optional[OffloadParamConfig]) -> None:
    """DeepSpeed's stage rules: optimizer offload at stages 1-3, parameter offload at stage 3."""
    if optimizer is not None and optimizer.enabled and stage == 0:
        raise problem('zero_optimization.offload_optimizer with device "cpu" needs ZeRO stage 1, 2 or 3 '
                      "(stage 0 shards no optimizer state); set zero_optimization.stage or remove the key")
    if param is not None and param.enabled and stage != 3:
        raise problem(f'zero_optimization.offload_param with device "cpu" needs ZeRO stage 3 (parameters are '
                      f"sharded only there), got stage {stage}; set zero_optimization.stage to 3, or use "
                      "offload_optimizer at stages 1-2")


class ZeroConfig(Section):
    """`zero_optimization`: which states are sharded over the data-parallel group, and how."""

    ds_unimplemented = {
        "zenflow": None, "zero_quantized_nontrainable_weights": False,
        "zeropp_loco_param": NOT_SET,
        "use_multi_rank_bucket_allreduce": True, "compute_grad_norm": True, "load_from_fp32_weights": True,
        "elastic_checkpoint": False, "legacy_stage1": False,
        "parameter_alignment": False, "memory_efficient_linear": True, "pipeline_loading_checkpoint": False,
        "override_module_apply": True, "log_trace_cache_warnings": False, "enable_sanity_checks": False,
        "save_muon_momentum_buffer_in_memory": False, "leaf_module": NOT_SET,
        "stage3_model_persistence_threshold": NOT_SET, "stage3_module_granularity_threshold": 0,
        "stage3_use_all_reduce_for_fetch_params": False, "stage3_allgather_sequential": False,
    }
    renames = {  # DeepSpeed populates its fields by name too, and keeps one deprecated alias
        "prefetch_bucket_size": "stage3_prefetch_bucket_size",
        "param_persistence_threshold": "stage3_param_persistence_threshold",
        "max_live_parameters": "stage3_max_live_parameters",
        "max_reuse_distance": "stage3_max_reuse_distance",
        "gather_16bit_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
        "stage3_gather_fp16_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
    }

    stage: Int = 0
    """0: plain data parallel; 1: shard optimizer states; 2: + gradients; 3: + parameters."""
    overlap_comm: Optional[bool] = None
    """Reduce gradients while backward still runs. Unset means DeepSpeed's rule: on for stage 3."""
    ignore_unused_parameters: bool = True
    """False: a step stops with an error naming the parameters that got no gradient in the whole
    accumulation window on every data-parallel rank (an AssertionError, as in DeepSpeed)."""
    contiguous_gradients: bool = True
    """Gradients are views into one flat buffer per group (no per-step copy)."""
    reduce_scatter: bool = True
    """Reduce gradients with reduce-scatter (each rank receives only its shard)."""
    reduce_bucket_size: PositiveInt = 500_000_000
    """Elements reduced per bucket."""
    allgather_partitions: bool = True
    """Stages 1/2: all-gather updated params (instead of a broadcast per partition)."""
    allgather_bucket_size: NonNegInt = 500_000_000
    """Elements all-gathered per bucket in stages 1/2."""
    round_robin_gradients: bool = False
    """Stage 1/2 with offload in DeepSpeed: spread gradient copies over ranks; no effect otherwise."""
    sub_group_size: NonNegInt = 1_000_000_000
    """Stage 3: elements per optimizer sub-group stepped at a time."""
    stage3_prefetch_bucket_size: NonNegInt = 50_000_000
    """Stage 3: elements of parameters fetched ahead of use."""
    stage3_param_persistence_threshold: NonNegInt = 100_000
    """Stage 3: params with fewer elements than this stay whole on every rank."""
    stage3_max_live_parameters: NonNegInt = 1_000_000_000
    """Stage 3: most gathered elements alive at once before released."""
    stage3_max_reuse_distance: NonNegInt = 1_000_000_000
    """Stage 3: keep a gathered param if it is reused within this many elements."""
    stage3_gather_16bit_weights_on_model_save: bool = False
    """Stage 3: gather full 16-bit weights when the model is saved."""

    mics_shard_size: Int = -1
    """Hybrid sharding (DeepSpeed's MiCS, FSDP's HSDP): shard states over groups of this many
    data-parallel ranks and replicate across the groups, at stages 1-3 (DeepSpeed: stage 3 only).
    -1: every data-parallel rank is one group (flat ZeRO). Must divide the data-parallel size."""
    mics_hierarchical_params_gather: bool = False
    """DeepSpeed's two-hop gather for a shard group that spans nodes; not implemented (refused)."""
    zero_hpz_partition_size: PositiveInt = 1
    """Stage 3: keep, after each block's forward, a second partition of its parameters over groups
    of this many ranks (a node's), so backward gathers inside the group (ZeRO++'s hpZ). 1: off."""
    zero_quantized_weights: bool = False
    """Stage 3: gather parameters as int8 with one scale per 256 elements (ZeRO++'s qwZ)."""
    zero_quantized_gradients: bool = False
    """Stages 1-3: reduce gradients into shards as int8 with block scales in one all-to-all (ZeRO++'s
    qgZ; DeepSpeed: stage 3)."""

    offload_optimizer: Optional[OffloadOptimizerConfig] = None
    """Optimizer states and fp32 master weights in CPU memory, stepped there (ZeRO-Offload), stages 1-3."""
    offload_param: Optional[OffloadParamConfig] = None
    """Stage 3: each rank's parameter shards in CPU memory, copied to the device for each gather."""

    @classmethod
    def known_keys(cls) -> list[str]:
        return [*super().known_keys(), *_DEPRECATED_OFFLOAD, "cpu_offload_use_pin_memory"]

    @model_validator(mode="before")
    @classmethod
    def _deprecated_offload_keys(cls, data: Any) -> Any:
        """DeepSpeed's `cpu_offload` / `cpu_offload_param` booleans, read as their blocks."""
        return normalize_offload_keys(data) if isinstance(data, dict) else data

    @model_validator(mode="after")
    def _offload_stage(self) -> "ZeroConfig":
        check_offload_stage(self.stage, self.offload_optimizer, self.offload_param)
        return self

    @property
    def offloads_optimizer(self) -> bool:
        return self.offload_optimizer is not None and self.offload_optimizer.enabled

    @property
    def offloads_params(self) -> bool:
        return self.offload_param is not None and self.offload_param.enabled

    @field_validator("mics_shard_size", mode="after")
    @classmethod
    def _shard_size_positive(cls, size: int) -> int:
        if size != -1 and size < 1:
            raise rule(f"must be -1 (flat ZeRO over every data-parallel rank) or a positive number of ranks, "
                       f"got {size}")
        return size

    @field_validator("mics_hierarchical_params_gather", mode="after")
    @classmethod
    def _no_hierarchical_gather(cls, value: bool) -> bool:
        if value:
            raise rule("is not supported: Zero3D gathers parameters inside a shard group in one collective; "
                       "choose mics_shard_size so that a group stays inside a node (a group spans mics_shard_size "
                       "x tensor_parallel.size x context_parallel.size consecutive ranks: keep that at most the "
                       "node's GPUs), where that gather already runs over the node's links; allowed: false")
        return value

    @model_validator(mode="after")
    def _quantized_stages(self) -> "ZeroConfig":
        if self.zero_quantized_weights and self.stage != 3:
            raise problem(f"zero_optimization.zero_quantized_weights needs ZeRO stage 3 (only there are parameters "
                          f"gathered before each use), got stage {self.stage}; set zero_optimization.stage to 3 or "
                          "remove the key")
        if self.zero_hpz_partition_size > 1 and self.stage != 3:
            raise problem(f"zero_optimization.zero_hpz_partition_size {self.zero_hpz_partition_size} needs ZeRO stage 3 "
                          f"(only there are parameters gathered again for backward), got stage {self.stage}; set "
                          "zero_optimization.stage to 3 or zero_hpz_partition_size to 1")
        if self.zero_quantized_gradients and self.stage == 0:
            raise problem("zero_optimization.zero_quantized_gradients needs ZeRO stage 1, 2 or 3: stage 0 all-reduces "
                          "whole gradients and reduce-scatters none; set zero_optimization.stage or remove the key")
        return self

    @model_validator(mode="after")
    def _hybrid_needs_sharding(self) -> "ZeroConfig":
        if self.mics_shard_size != -1 and self.stage == 0:
            raise problem(f"zero_optimization.mics_shard_size {self.mics_shard_size} needs ZeRO stage 1, 2 or 3: "
                          "stage 0 shards nothing, so there is nothing to shard inside a group; set "
                          "zero_optimization.stage or remove the key")
        return self

    def shard_size(self, data_parallel_size: int) -> int:
        """Ranks of one shard group (the whole data-parallel size unless ``mics_shard_size`` is set)."""
        return data_parallel_size if self.mics_shard_size == -1 else self.mics_shard_size

    @field_validator("stage", mode="after")
    @classmethod
    def _stage_known(cls, stage: int) -> int:
        if stage not in (0, 1, 2, 3):
            raise rule("is not allowed; must be one of 0, 1, 2, 3")
        return stage

    @model_validator(mode="after")
    def _default_overlap_comm(self) -> "ZeroConfig":
        if self.overlap_comm is None:
            object.__setattr__(self, "overlap_comm", self.stage == 3)
        return self


class TensorParallelConfig(Section):
    """`tensor_parallel`: the tp dimension of the mesh (Megatron-style layers)."""

    ds_unimplemented = {"dtype": NOT_SET, "tp_overlap_comm": False, "vocab_parallel_lm_head": None,
                        "vocab_parallel_ce_backend": "torch", "tp": {}, "partition_config": None,
                        "preset_model": None, "keep_module_on_host": False, "kernel_inject": False,
                        "replace_with_kernel_inject": False, "injection_policy_tuple": None}

    size: PositiveInt = 1
    """Ranks each layer is split over. DeepSpeed's AutoTP spelling `autotp_size` is the same
    setting (0 there means off, i.e. 1)."""

    sequence_parallel: bool = False
    """Run norms, residuals and dropout between the tensor-parallel regions on 1/size of the
    sequence (Megatron's sequence parallelism): all-gather / reduce-scatter replace the
    all-reduces; same numbers, less activation memory. The sequence length must divide by size."""

    @classmethod
    def known_keys(cls) -> list[str]:
        return [*super().known_keys(), "autotp_size"]

    @model_validator(mode="before")
    @classmethod
    def _autotp_size(cls, data: Any) -> Any:
        if not isinstance(data, dict) or "autotp_size" not in data:
            return data
        data = dict(data)
        raw = data.pop("autotp_size")
        try:
            autotp = _to_int(raw)
        except PydanticCustomError:
            autotp = None
        if not isinstance(autotp, int) or autotp < 0:
            raise key_rule("autotp_size", f"must be an integer >= 0 (0 means off), got {show(raw)}")
        autotp = autotp or 1
        if "size" in data and data["size"] != autotp:
            raise key_rule("autotp_size", f"= {autotp} differs from tensor_parallel.size = {data['size']}; "
                           "they are the same setting, give one")
        data["size"] = autotp
        return data


class PipelineConfig(Section):
    """`pipeline`: the pp dimension of the mesh."""

    ds_unimplemented = {"seed_layers": False, "activation_checkpoint_interval": 0,
                        "pipe_partitioned": True, "grad_partitioned": True}

    stages: PositiveInt = 1
    """Pipeline stages the model is split into (DeepSpeed's "auto" is not supported)."""

    schedule: Literal["gpipe", "1f1b", "interleaved_1f1b", "zb_h1"] = "1f1b"
    """The schedule over the gradient_accumulation_steps micro-batches of a batch: GPipe,
    1F1B (PipeDream-Flush), Megatron's interleaved 1F1B (needs virtual_stages >= 2) or
    zero-bubble ZB-H1 (backward split into input- and weight-gradient passes)."""

    virtual_stages: PositiveInt = 1
    """Model chunks per rank for interleaved_1f1b (chunk c of rank r is stage c*stages + r)."""

    partition: Optional[list[PositiveInt]] = None
    """Blocks per stage (per chunk with virtual stages), summing to the model's block count;
    None balances by `balance`."""

    balance: Literal["parameters", "layers"] = "parameters"
    """How blocks are spread when `partition` is not given: equal parameter counts (the
    embedding counted on the first stage, norm and head on the last) or equal block counts."""

    activation_checkpointing: bool = False
    """Recompute each block's forward in backward instead of keeping its activations."""

    record_timeline: bool = False
    """Record every pipeline action's start and end on every rank, for
    `engine.write_timeline(path)` (a Chrome-trace JSON that `zero3d plot` can draw)."""

    keep_full_gradients: bool = False
    """ZeRO stages 2-3: accumulate full gradients through the step and reduce-scatter each
    chunk's once, after its last backward, instead of after every micro-batch's backward
    (stage 2's memory saving given up for one reduction per step). Stages 0-1 always do."""


class ContextParallelConfig(Section):
    """`context_parallel`: the cp dimension of the mesh (docs/context_parallel.md).

    Each rank of a cp group is handed the same micro-batch and keeps 1/size of every
    sequence's tokens through the whole model; attention gathers what it needs from the
    others. DeepSpeed's top-level `sequence_parallel_size` sets the same axis with Ulysses."""

    size: PositiveInt = 1
    """Ranks a sequence is split over; it must divide world / (tensor_parallel.size x
    pipeline.stages), and every micro-batch's sequence length must divide by it."""

    method: Literal["ulysses", "ring"] = "ulysses"
    """How attention runs across the split: "ulysses" (all-to-all from sequence-split to
    head-split around the model's own attention kernel, DeepSpeed-Ulysses; the heads after
    tensor parallelism must divide by size) or "ring" (keys and values pass around the cp ring
    point to point, partial results combined with the online-softmax rule; any head count,
    sliding windows and softcapping; sequence lengths must divide by 2 x size)."""


_DEEPCOMPILE_KEYS = {
    # DeepSpeed 0.19's compile section is DeepCompile's (deepspeed/compile/config.py): graph passes
    # over a whole-model compile, which Zero3D does not implement; accepted at their defaults only
    # (``deepcompile`` itself is a field, refused with its own message)
    "autoep_non_moe": False, "free_activation": False, "free_activation_threshold": 10 * 1024 * 1024,
    "offload_activation": False, "offload_activation_pin_memory": True, "offload_opt_states": False,
    "double_buffer": True, "symmetric_memory": False, "debug_log": False, "offload_parameters": False,
    "sync_before_reduce": False, "sync_after_reduce": False, "sync_before_allgather": False,
    "sync_after_allgather": False, "keep_int_input_tensors": True, "keep_all_input_tensors": False, "passes": None,
}

COMPILE_KWARGS = ("fullgraph", "dynamic", "mode", "options")
"""The ``torch.compile`` keywords ``compile.kwargs`` may set (``backend`` has its own key)."""

CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")
"""``torch.compile`` modes that record CUDA graphs (refused: see ``CompileConfig.kwargs``)."""


class CompileConfig(Section):
    """`compile`: each repeated block (decoder layer) compiled with ``torch.compile`` on its own
    (regional compilation, as torchtitan does), its forward only: ZeRO-3's gather/release hooks,
    the pipeline's and tensor parallelism's module hooks run outside the compiled code
    (parallel3d/build/compiled_blocks.py, docs/compile.md). Keys are DeepSpeed's ``enabled``,
    ``backend`` and ``kwargs`` (its runtime/compiler.py block before DeepCompile); DeepCompile's
    keys are refused unless at their defaults."""

    ds_unimplemented = _DEEPCOMPILE_KEYS

    enabled: bool = False
    """Compile every repeated block's forward with torch.compile."""
    backend: str = "inductor"
    """The torch.compile backend (``torch._dynamo.list_backends()``; "inductor", "aot_eager", "eager")."""
    kwargs: dict[str, Any] = {}
    """Further torch.compile keywords: ``fullgraph``, ``dynamic``, ``mode`` and ``options``. Modes and
    options that record CUDA graphs are refused: a graph replays fixed addresses, and ZeRO-3
    gathers each block's parameters into new memory at every use."""
    deepcompile: bool = False
    """DeepSpeed's DeepCompile (graph passes that schedule ZeRO's collectives): not implemented."""

    @field_validator("deepcompile", mode="after")
    @classmethod
    def _no_deepcompile(cls, value: bool) -> bool:
        if value:
            raise rule("is not supported: Zero3D does not implement DeepSpeed's DeepCompile passes; "
                       "compile.enabled: true compiles each block with torch.compile instead; allowed: false")
        return value

    @field_validator("kwargs", mode="after")
    @classmethod
    def _known_kwargs(cls, kwargs: dict[str, Any]) -> dict[str, Any]:
        for key in kwargs:
            if key == "backend":
                raise key_rule(key, "is set by compile.backend; give it there")
            if key not in COMPILE_KWARGS:
                raise key_rule(key, f"is not a torch.compile keyword Zero3D passes on; allowed: {', '.join(COMPILE_KWARGS)}")
        if not isinstance(kwargs.get("fullgraph", False), bool):
            raise key_rule("fullgraph", f"must be true or false, got {show(kwargs['fullgraph'])}")
        if kwargs.get("dynamic") not in (None, True, False):
            raise key_rule("dynamic", f"must be true, false or null, got {show(kwargs['dynamic'])}")
        mode = kwargs.get("mode")
        if mode in CUDA_GRAPH_MODES:
            raise key_rule("mode", f"{show(mode)} records CUDA graphs, which replay fixed memory addresses, while "
                           "ZeRO-3 gathers a block's parameters into new memory at each use (and Zero3D has not "
                           'tested CUDA graphs); allowed: "default", "max-autotune-no-cudagraphs" or no mode')
        if mode not in (None, "default", "max-autotune-no-cudagraphs"):
            raise key_rule("mode", f'{show(mode)} is not a torch.compile mode; allowed: "default", '
                           '"max-autotune-no-cudagraphs"')
        options = kwargs.get("options", {})
        if not isinstance(options, dict):
            raise key_rule("options", f"must be a mapping of inductor options, got {show(options)}")
        if options.get("triton.cudagraphs"):
            raise key_rule("options", "triton.cudagraphs records CUDA graphs, refused for the reason given for mode")
        if "options" in kwargs and kwargs.get("mode") is not None:
            raise key_rule("options", "and mode cannot both be given (torch.compile refuses the pair)")
        return kwargs


class ExpertParallelConfig(Section):
    """`expert_parallel`: DeepSpeed AutoEP's section (docs/expert_parallel.md).

    Each MoE layer the model's ``base_model_ep_plan`` names keeps ``1/autoep_size`` of its routed
    experts on each rank of an expert-parallel group folded over the data-parallel shard and
    context-parallel ranks; tokens reach their experts' ranks and come back by all-to-all, with no
    capacity limit (no token dropped). AutoEP's tuning keys are accepted at their defaults."""

    ds_unimplemented = {
        "validate_folding_routing": False, "async_split_plan": False, "preset_model": None,
        "moe_layer_pattern": None, "expert_pattern": None, "router_pattern": None, "use_grouped_mm": True,
        "disable_triton_grouped_mm": False, "route_norm": None, "route_scale": 1.0, "score_apply": "auto",
        "combine_impl": "auto", "row_weighting_impl": "auto", "gate_up_impl": "separate", "comm_backend": "comm",
        "comm_num_sm": 12, "comm_qp_margin": 4, "comm_max_tokens_per_rank": 0, "num_expert_groups": None,
        "num_limited_groups": None, "score_func": "auto", "top_k": "auto",
    }

    enabled: bool = False
    """Split the experts (off: every rank holds every expert, as ZeRO lays them out)."""

    autoep_size: PositiveInt = 1
    """Ranks each layer's experts are split over (``E``): it must divide the number of routed
    experts and the data-parallel shard ranks times the context-parallel size."""

    expert_tensor_parallel_size: PositiveInt = 1
    """Tensor-parallel ranks each expert is split over: 1 (each tp rank holds its experts whole) or
    ``tensor_parallel.size`` (each expert split like a dense MLP; checked with the world size). With
    ``enabled`` false it has no effect: the tensor-parallel plan splits the experts as any MLP."""

    load_balance_coeff: Optional[PositiveFloat] = None
    """DeepSeek V3's auxiliary-loss-free balancing (Megatron's ``moe_router_bias_update_rate``): after
    every step each router's ``e_score_correction_bias`` moves by ``coeff * sign(mean_load - load)``,
    the loads counted over the global batch; also without ``enabled`` (docs/expert_parallel.md)."""

    @property
    def size(self) -> int:
        """The expert-parallel degree in effect: ``autoep_size`` when enabled, else 1."""
        return self.autoep_size if self.enabled else 1

    def unused_size_notice(self) -> str | None:
        """The line to log when ``autoep_size`` asks for more than one rank and ``enabled`` is not true:
        DeepSpeed AutoEP then ignores the section's sizes silently, and so does Zero3D (same keys, same
        result), but says so once."""
        if self.enabled or self.autoep_size == 1:
            return None
        return (f"expert_parallel.autoep_size {self.autoep_size} has no effect without expert_parallel.enabled: true "
                "(as in DeepSpeed AutoEP): every rank holds every expert; set enabled: true to split the experts, "
                "or remove autoep_size")

    def unused_etp_notice(self, tp_size: int) -> str | None:
        """The line to log when ``expert_tensor_parallel_size`` 1 is written out under tensor parallelism
        while ``enabled`` is not true: it applies only to the experts expert parallelism splits, so the
        tensor-parallel plan still splits the experts over the tp ranks as any MLP; said once, as for
        ``autoep_size``."""
        if (self.enabled or tp_size == 1 or self.expert_tensor_parallel_size != 1
                or "expert_tensor_parallel_size" not in self.model_fields_set):
            return None
        return (f"expert_parallel.expert_tensor_parallel_size 1 has no effect without expert_parallel.enabled: true: "
                f"without expert parallelism tensor_parallel.size {tp_size} splits every expert over the "
                "tensor-parallel ranks as any MLP; set enabled: true (with autoep_size) to keep the experts whole "
                "on each tensor-parallel rank, or remove expert_tensor_parallel_size")


class CheckpointConfig(Section):
    """`checkpoint`: how `engine.save_checkpoint` writes (DeepSpeed's section, plus async_save)."""

    ds_unimplemented = {
        # Zero3D always refuses a tag that could leave save_dir, whatever DeepSpeed's setting says
        "tag_validation": lambda v: str(v).lower() in ("ignore", "warn", "fail"),
        # every Zero3D checkpoint is universal: it loads on any layout with either value
        "load_universal": lambda v: isinstance(v, bool),
        "use_node_local_storage": False,
        # DCP writes every rank's chunks in parallel already
        "parallel_write": lambda v: isinstance(v, dict),
    }

    async_save: bool = False
    """Copy the checkpoint to CPU memory and write it in a background thread while training
    goes on; `latest` moves to it once every rank has written it. The next save or load, and
    `engine.wait_for_checkpoint()`, wait for it."""


class CommConfig(Section):
    """`comm`: how long a collective may wait for the other ranks (Zero3D's own section)."""

    timeout_s: Annotated[float, BeforeValidator(_to_float), Field(ge=0.001)] = 300.0
    """Seconds (at least 0.001) a collective or a pipeline transfer waits for the other ranks of its group. Then
    the job stops with a message naming the group, the operation and the ranks that did not
    arrive. Set on every group Zero3D creates, and on the default group when Zero3D creates it
    or this key is given (torch's own defaults are 30 minutes for gloo, 10 for NCCL)."""


# --- optimizer -----------------------------------------------------------------------------

_TORCH_OPTIMIZERS = {"adam": "Adam", "adamw": "AdamW", "sgd": "SGD"}
_DS_ONLY_ADAM_KEYS = ("torch_adam", "adam_w_mode")
_DS_OTHER_OPTIMIZERS = ("adagrad", "lamb", "onebitadam", "zerooneadam", "onebitlamb", "lion", "muon",
                        "muadam", "muadamw", "musgd", "cpuadam", "fusedadam")


def torch_optimizer_keywords(class_name: str) -> list[str]:
    """Keyword names of torch.optim.<class_name>'s constructor (torch is imported lazily)."""
    import torch.optim

    params = inspect.signature(getattr(torch.optim, class_name).__init__).parameters
    return [n for n, p in params.items() if n not in ("self", "params") and p.kind != p.VAR_KEYWORD]


class OptimizerConfig(Section):
    """`optimizer`: the inner torch.optim optimizer, run on each rank's fp32 master shard."""

    ds_unimplemented = {"legacy_fusion": False}

    type: str
    """Adam, AdamW or SGD, case-insensitive like DeepSpeed; stored as the canonical name."""
    params: dict[str, Any] = {}
    """Constructor keywords of the torch class, plus DeepSpeed's `torch_adam` and `adam_w_mode`
    for Adam/AdamW."""

    @field_validator("type", mode="before")
    @classmethod
    def _canonical_type(cls, value: Any) -> Any:
        if not isinstance(value, str):
            raise rule("must be a string: Adam, AdamW or SGD")
        if value.lower() in _TORCH_OPTIMIZERS:
            return _TORCH_OPTIMIZERS[value.lower()]
        if value.lower() in _DS_OTHER_OPTIMIZERS:
            raise rule("is a DeepSpeed optimizer Zero3D does not implement yet; use Adam, AdamW or SGD")
        raise rule("is not allowed; must be one of Adam, AdamW, SGD")

    @model_validator(mode="after")
    def _check_params(self) -> "OptimizerConfig":
        if "max_grad_norm" in self.params:
            raise problem("optimizer.params.max_grad_norm is not supported (as in DeepSpeed); "
                          "use the top-level gradient_clipping")
        allowed = torch_optimizer_keywords(self.torch_optimizer_class_name())
        if self.type in ("Adam", "AdamW"):
            allowed += _DS_ONLY_ADAM_KEYS
        for key, value in self.params.items():
            if key not in allowed:
                near = difflib.get_close_matches(str(key), allowed, n=1)
                hint = f"did you mean 'optimizer.params.{near[0]}'? " if near else ""
                raise problem(f"unknown config key 'optimizer.params.{key}' for {self.type}; {hint}"
                              f"allowed: {', '.join(sorted(allowed))}")
            if key == "lr" and (isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0):
                raise problem(f"optimizer.params.lr: {show(value)} must be a number >= 0")
            if not all_finite(value):
                what = "finite numbers" if isinstance(value, (list, tuple)) else "a finite number"
                raise problem(f"optimizer.params.{key}: {show(value)} must be {what} (not inf or nan)")
        return self

    def torch_optimizer_class_name(self) -> str:
        """The torch.optim class DeepSpeed would run: its "Adam" is AdamW unless adam_w_mode is false
        (engine.py `_configure_basic_optimizer`: AdamW if type is AdamW or adam_w_mode, default true)."""
        if self.type == "Adam":
            return "AdamW" if self.params.get("adam_w_mode", True) else "Adam"
        return self.type

    def torch_optimizer_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for the torch class, DeepSpeed-only keys dropped. DeepSpeed runs its
        Fused/CPU Adam (weight_decay default 0.0) unless torch_adam is set, where torch.optim.AdamW
        would default to 0.01: the 0.0 is filled in so both agree with DeepSpeed."""
        kwargs = {k: v for k, v in self.params.items() if k not in _DS_ONLY_ADAM_KEYS}
        if "betas" in kwargs and isinstance(kwargs["betas"], list):
            kwargs["betas"] = tuple(kwargs["betas"])
        if self.torch_optimizer_class_name() == "AdamW" and not self.params.get("torch_adam", False):
            kwargs.setdefault("weight_decay", 0.0)
        return kwargs


# --- scheduler -----------------------------------------------------------------------------


def _warmup_type(value: Any) -> Any:
    if value not in ("log", "linear"):
        raise rule('is not allowed; must be one of "log", "linear"')
    return value


WarmupType = Annotated[str, BeforeValidator(_warmup_type)]


def _lr_value(value: Any) -> Any:
    """A learning rate for every param group, or a list with one per group (as DeepSpeed reads it)."""
    values = value if isinstance(value, list) else [value]
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise rule("must be a finite number >= 0 or a list of them, one per param group")
    return [float(v) for v in value] if isinstance(value, list) else float(value)


LrValue = Annotated[Union[float, list[float]], BeforeValidator(_lr_value)]


class WarmupLRParams(Section):
    """`scheduler.params` of WarmupLR: warm up from min to max lr, then stay."""

    warmup_min_lr: LrValue = 0.0
    """Learning rate at step 0."""
    warmup_max_lr: Optional[LrValue] = None
    """Learning rate reached after warmup; unset means the optimizer's lr (DeepSpeed's default)."""
    warmup_num_steps: PositiveInt = 1000
    """Steps of warmup (DeepSpeed uses at least 2)."""
    warmup_type: WarmupType = "log"
    """Warmup curve: "log" or "linear"."""


class WarmupDecayLRParams(WarmupLRParams):
    """`scheduler.params` of WarmupDecayLR: WarmupLR, then linear decay to 0 at total_num_steps."""

    total_num_steps: PositiveInt
    """Step at which the learning rate reaches 0."""
    warmup_max_lr: LrValue = 0.001
    """Learning rate reached after warmup."""


class WarmupCosineLRParams(Section):
    """`scheduler.params` of WarmupCosineLR: ratios of the optimizer's lr, warmup then cosine."""

    total_num_steps: PositiveInt
    """Step at which the cosine decay ends."""
    warmup_min_ratio: NonNegFloat = 0.0
    """lr ratio at step 0."""
    warmup_num_steps: PositiveInt = 1000
    """Steps of warmup."""
    cos_min_ratio: NonNegFloat = 0.0001
    """lr ratio at the end of the cosine decay."""
    warmup_type: WarmupType = "log"
    """Warmup curve: "log" or "linear"."""


NonNegFloatOrList = Union[NonNegFloat, list[NonNegFloat]]


class OneCycleParams(Section):
    """`scheduler.params` of OneCycle: one lr triangle (momentum the other way), then decay."""

    cycle_min_lr: NonNegFloatOrList
    """Lower lr of the cycle (one value, or one per param group)."""
    cycle_max_lr: NonNegFloatOrList
    """Upper lr of the cycle."""
    decay_lr_rate: NonNegFloat = 0.0
    """After the cycle: lr = cycle_min_lr / (1 + decay_lr_rate * steps / decay_step_size)."""
    cycle_first_step_size: PositiveInt = 2000
    """Steps of the rising half."""
    cycle_second_step_size: Optional[NonNegInt] = None
    """Steps of the falling half (unset: as the rising one)."""
    cycle_first_stair_count: NonNegInt = 0
    """Stairs of the rising half (0: continuous)."""
    cycle_second_stair_count: Optional[NonNegInt] = None
    """Stairs of the falling half (unset: as the rising one)."""
    decay_step_size: NonNegInt = 0
    """Steps per decay interval after the cycle (0: no decay)."""
    cycle_momentum: bool = True
    """Cycle the first beta inversely to the lr (optimizers with betas)."""
    cycle_min_mom: NonNegFloatOrList = 0.8
    """Lower first beta."""
    cycle_max_mom: NonNegFloatOrList = 0.9
    """Upper first beta."""
    decay_mom_rate: NonNegFloat = 0.0
    """After the cycle: beta = cycle_max_mom * (1 + decay_mom_rate * steps / decay_step_size)."""


class LRRangeTestParams(Section):
    """`scheduler.params` of LRRangeTest: lr = min_lr * (1 + step_rate * steps / step_size)."""

    lr_range_test_min_lr: NonNegFloatOrList = 0.001
    """lr at the start."""
    lr_range_test_step_size: PositiveInt = 2000
    """Steps per increase interval."""
    lr_range_test_step_rate: NonNegFloat = 1.0
    """Increase per interval."""
    lr_range_test_staircase: bool = False
    """Increase in stairs instead of continuously."""


SCHEDULER_PARAMS: dict[str, type[Section]] = {
    "WarmupLR": WarmupLRParams, "WarmupDecayLR": WarmupDecayLRParams, "WarmupCosineLR": WarmupCosineLRParams,
    "OneCycle": OneCycleParams, "LRRangeTest": LRRangeTestParams}


class SchedulerConfig(Section):
    """`scheduler`: one of DeepSpeed's warmup schedules, stepped once per optimizer step."""

    type: str
    """WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle or LRRangeTest."""
    params: dict[str, Any] = {}
    """The schedule's parameters; see WarmupLRParams, WarmupDecayLRParams, WarmupCosineLRParams,
    OneCycleParams, LRRangeTestParams."""

    @field_validator("type", mode="before")
    @classmethod
    def _known_type(cls, value: Any) -> Any:
        names = {n.lower(): n for n in SCHEDULER_PARAMS}
        if isinstance(value, str) and value.lower() in names:
            return names[value.lower()]
        raise rule(f"is not allowed; must be one of {', '.join(SCHEDULER_PARAMS)}")

    @model_validator(mode="after")
    def _check_params(self) -> "SchedulerConfig":
        model = SCHEDULER_PARAMS[self.type]
        try:
            model.model_validate(self.params)
        except ValidationError as err:
            raise problem(describe_validation_error(err, model, prefix="scheduler.params")) from None
        return self

    def typed_params(self) -> dict[str, Any]:
        """The validated params with DeepSpeed's defaults filled in, as a plain dict."""
        return SCHEDULER_PARAMS[self.type].model_validate(self.params).model_dump()


# --- turning a pydantic ValidationError into one readable sentence -------------------------


def section_of(model: type[BaseModel], name: str) -> Optional[type[BaseModel]]:
    """The model class of field `name` of `model`, if that field holds a model."""
    field = model.model_fields.get(name)
    if field is None:
        return None
    candidates = [field.annotation, *getattr(field.annotation, "__args__", ())]
    return next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)


def show(value: Any) -> str:
    """A value as the user wrote it in JSON."""
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def unknown_key_message(model: Optional[type[BaseModel]], path: list[str]) -> str:
    """Unknown key at `path` of `model`: suggest the nearest known key, else list the implemented ones."""
    dotted, parent = ".".join(path), "".join(p + "." for p in path[:-1])
    fields = list(model.model_fields) if model is not None else []
    known = model.known_keys() if model is not None and issubclass(model, Section) else fields
    near = difflib.get_close_matches(path[-1], known, n=1)
    if near:
        return f"unknown config key '{dotted}'; did you mean '{parent}{near[0]}'?"
    where = f" in {parent[:-1]}" if parent else ""
    return f"unknown config key '{dotted}'; keys Zero3D implements{where}: {', '.join(sorted(fields))}"


_BOUNDS = {"greater_than": ("> ", "gt"), "greater_than_equal": (">= ", "ge"),
           "less_than": ("< ", "lt"), "less_than_equal": ("<= ", "le")}


def describe_validation_error(err: ValidationError, root: type[BaseModel], prefix: str = "") -> str:
    """First error of `err` as '<dotted.key>: <value> <rule>'."""
    first = err.errors(include_url=False)[0]
    loc = [str(part) for part in first["loc"]]
    path = ([prefix] if prefix else []) + loc
    dotted, kind, ctx = ".".join(path), first["type"], first.get("ctx") or {}
    value = show(first.get("input"))
    if kind == "zero3d":
        return ctx["message"]
    if kind == "zero3d_key":
        return f"{'.'.join(path + [ctx['key']])} {ctx['rule']}"
    if kind == "zero3d_rule":
        return f"{dotted}: {value} {ctx['rule']}"
    if kind == "extra_forbidden":
        model: Optional[type[BaseModel]] = root
        for part in loc[:-1]:
            model = section_of(model, part) if model is not None else None
        return unknown_key_message(model, path)
    if kind == "invalid_key":
        return f"{dotted}: config keys must be strings"
    if kind == "missing":
        return f"{dotted} is required"
    if kind == "finite_number":
        return f"{dotted}: {value} must be a finite number (not inf or nan)"
    if kind in _BOUNDS:
        op, name = _BOUNDS[kind]
        return f"{dotted}: {value} must be {op}{ctx.get(name)}"
    for start, text in (("int_", "must be an integer"), ("float_", "must be a number"),
                        ("bool_", "must be true or false"), ("string_", "must be a string"),
                        ("dict_", "must be a mapping of keys to values"),
                        ("model_", "must be a mapping of keys to values")):
        if kind.startswith(start):
            return f"{dotted}: {value} {text}"
    return f"{dotted}: {value} is invalid: {first['msg']}"

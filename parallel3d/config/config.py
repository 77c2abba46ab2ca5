"""The Zero3D config: DeepSpeed's JSON schema, typed, validated before any collective.

    cfg = load_config("ds_config.json", world_size=8)   # or .yaml/.yml, a dict, a Zero3DConfig
    cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps, cfg.data_parallel_size

A DeepSpeed user keeps their JSON: key names and defaults are DeepSpeed's. Every problem is
one `ConfigError` naming the dotted key, the value and the rule. Three kinds of keys:

* implemented: the fields of `Zero3DConfig` and its sections (config_sections.py);
* accepted and ignored (`IGNORED_KEYS`): their only effect in DeepSpeed is logging, or a
  permission Zero3D always grants, so ignoring them changes no result;
* known to DeepSpeed but not implemented (`ds_unimplemented` of each section): refused unless
  set to DeepSpeed's default, where writing them out means the same as leaving them out.
Anything else is an unknown key, reported with the nearest known one.

This module imports no torch.distributed and starts nothing; torch.optim is imported lazily,
only to read the optimizer constructor's keyword names.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml
from pydantic import Field, PrivateAttr, ValidationError, field_validator, model_validator

from parallel3d.config.sections import (
    NOT_SET, BF16Config, CheckpointConfig, CommConfig, CompileConfig, ContextParallelConfig, DataTypesConfig,
    ExpertParallelConfig, FP16Config, NonNegFloat, OptimizerConfig, PipelineConfig, PositiveFloat, PositiveInt,
    SchedulerConfig, Section,
    TensorParallelConfig, ZeroConfig,
    describe_validation_error, disabled_block, problem)
from parallel3d.errors import ConfigError

__all__ = ["Zero3DConfig", "load_config", "IGNORED_KEYS", "BATCH_KEYS"]

BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")

IGNORED_KEYS: dict[str, str] = {
    "wall_clock_breakdown": "only turns on DeepSpeed's timer logging",
    "memory_breakdown": "only logs memory usage around forward/backward",
    "dump_state": "only prints the engine's state after initialization",
    "log_level": "only sets DeepSpeed's logger level",
    "timers": "only configures DeepSpeed's throughput timer logging",
    "zero_force_ds_cpu_optimizer": "only makes DeepSpeed insist on its own CPU Adam under offload_optimizer; "
                                   "Zero3D steps any torch.optim optimizer on the offloaded shards",
}
"""Top-level DeepSpeed keys accepted with any value and ignored, with the reason."""

_DS_TOP_LEVEL_UNIMPLEMENTED: dict[str, Any] = {
    # training semantics Zero3D does not offer: accepted at DeepSpeed's default only
    "managed_gradient_accumulation": True, "disable_allgather": False, "disable_python_gc": False,
    "communication_data_type": None, "seq_parallel_communication_data_type": "fp32",
    "use_data_before_expert_parallelism": False,
    "vocabulary_size": None, "aio": {}, "datastates_ckpt": {},
    "activation_checkpointing": NOT_SET, "weight_quantization": NOT_SET,
    # feature blocks with an `enabled` switch: accepted while switched off
    **{key: disabled_block for key in (
        "torch_autocast", "flops_profiler", "tensorboard", "wandb", "csv_monitor", "comet", "comms_logger",
        "autotuning", "hybrid_engine", "data_efficiency")},
    # removed from DeepSpeed itself (runtime/config.py _REMOVED_TOP_LEVEL_CONFIG_KEYS)
    **{key: NOT_SET for key in (
        "nebula", "compression_training", "amp", "quantize_training", "sparse_gradients", "eigenvalue",
        "sparse_attention", "elasticity", "graph_harvesting", "curriculum_learning", "progressive_layer_drop")},
}


class Zero3DConfig(Section):
    """A whole training config: DeepSpeed's top-level keys plus the 3D mesh sizes.

    Build it with `load_config` (or `Zero3DConfig.from_dict`), which also resolves the three
    batch sizes for a world size; a config straight from the constructor may leave them unset.
    """

    ds_unimplemented = {**_DS_TOP_LEVEL_UNIMPLEMENTED, **{key: (lambda v: True) for key in IGNORED_KEYS}}
    renames = {"bfloat16": "bf16"}

    train_batch_size: Optional[PositiveInt] = None
    """Samples per optimizer step over all data-parallel ranks (micro x accumulation x dp)."""
    train_micro_batch_size_per_gpu: Optional[PositiveInt] = None
    """Samples per forward/backward on one rank."""
    gradient_accumulation_steps: Optional[PositiveInt] = None
    """Micro-batches whose gradients are summed before one optimizer step."""
    steps_per_print: PositiveInt = 10
    """Log progress every this many optimizer steps."""
    dataloader_drop_last: bool = False
    """The dataloader `initialize` builds from `training_data` drops a last incomplete micro-batch."""
    zero_allow_untested_optimizer: bool = False
    """Let an optimizer not known to update elementwise step on sharded parameters (ZeRO stage >= 1
    or tensor parallelism), where a per-tensor update is computed on pieces
    (``parallel3d/build/optimizer_check.py``); DeepSpeed's key and default."""
    gradient_clipping: NonNegFloat = 1.0
    """Clip the global gradient norm to this value; 0 turns clipping off (DeepSpeed default 1.0)."""
    gradient_allreduce_op: Literal["mean", "sum"] = "mean"
    """How gradients are combined over data-parallel ranks: their mean, or (DeepSpeed's "sum") their
    sum, which is the mean times the data-parallel size (upper case is read too)."""
    prescale_gradients: bool = False
    """DeepSpeed divides gradients by the data-parallel size before its sum rather than after.
    Zero3D averages with one ReduceOp.AVG collective either way: the same mean, rounded in the
    collective; the value is kept for `engine.postscale_gradients()`."""
    gradient_predivide_factor: PositiveFloat = 1.0
    """DeepSpeed's split of that division (before / after the sum); like prescale_gradients it
    moves rounding only, and Zero3D's AVG collective gives the same mean for every value."""
    loss_normalization: Literal["micro_batch", "tokens"] = "micro_batch"
    """What ``train_batch``/``eval_batch`` average the loss over. "micro_batch" (DeepSpeed's, the
    default): the mean of the micro-batches' losses over accumulation and dp ranks. "tokens": the
    mean over the label tokens of the whole global batch, counted before the step and passed to
    the model as ``num_items_in_batch`` (HF Trainer's rule), with gradients summed over
    micro-batches and dp ranks; the same data then gives the same loss at any dp, micro-batch and
    accumulation. Under "tokens", ``engine.backward`` does not divide by the accumulation steps and
    multiplies by the data-parallel size (parallel3d/engine/token_mean.py)."""
    data_types: DataTypesConfig = Field(default_factory=DataTypesConfig)
    """`data_types.grad_accum_dtype`: the dtype gradients accumulate in."""
    optimizer: Optional[OptimizerConfig] = None
    """The optimizer to build; unset means the caller passes one to initialize()."""
    scheduler: Optional[SchedulerConfig] = None
    """The learning-rate schedule to build; unset means none (or the caller's)."""
    fp16: FP16Config = Field(default_factory=FP16Config)
    """float16 mixed precision with loss scaling."""
    bf16: BF16Config = Field(default_factory=BF16Config)
    """bfloat16 mixed precision (`bfloat16` is read as a synonym, as DeepSpeed does)."""
    zero_optimization: ZeroConfig = Field(default_factory=ZeroConfig)
    """ZeRO stage and its communication settings."""
    tensor_parallel: TensorParallelConfig = Field(default_factory=TensorParallelConfig)
    """Tensor-parallel size of the mesh."""
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig)
    """Pipeline stages of the mesh."""
    context_parallel: ContextParallelConfig = Field(default_factory=ContextParallelConfig)
    """Context-parallel size of the mesh and its attention method (docs/context_parallel.md)."""
    sequence_parallel_size: PositiveInt = 1
    """DeepSpeed's spelling of ``context_parallel: {"size": N, "method": "ulysses"}``; when above 1
    it sets context_parallel (giving both with different sizes is refused)."""
    expert_parallel: ExpertParallelConfig = Field(default_factory=ExpertParallelConfig)
    """Expert parallelism for mixture-of-experts models (DeepSpeed AutoEP's keys)."""
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    """How checkpoints are written (`async_save`)."""
    comm: CommConfig = Field(default_factory=CommConfig)
    """The collective timeout (`timeout_s`)."""
    compile: CompileConfig = Field(default_factory=CompileConfig)
    """Compiled blocks: torch.compile on each repeated block (`enabled`, `backend`, `kwargs`)."""

    _world_size: Optional[int] = PrivateAttr(default=None)
    _given_batch: Optional[tuple] = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _one_precision(self) -> "Zero3DConfig":
        if self.fp16.enabled and self.bf16.enabled:
            raise problem("fp16.enabled and bf16.enabled are both true; enable at most one")
        return self

    @model_validator(mode="after")
    def _token_mean_sums_itself(self) -> "Zero3DConfig":
        if self.loss_normalization == "tokens" and self.gradient_allreduce_op == "sum":
            raise problem('loss_normalization "tokens" with gradient_allreduce_op "sum": the token mean already sums '
                          'the gradients over data-parallel ranks (each loss is divided by the global token count); '
                          'leave gradient_allreduce_op at "mean"')
        return self

    @model_validator(mode="after")
    def _deepspeed_sequence_parallel(self) -> "Zero3DConfig":
        """``sequence_parallel_size: N`` is DeepSpeed-Ulysses over N ranks: context_parallel's axis."""
        n, cp = self.sequence_parallel_size, self.context_parallel
        if n == 1:
            return self
        if "context_parallel" in self.model_fields_set and cp.size not in (1, n):
            raise problem(f"sequence_parallel_size {n} and context_parallel.size {cp.size} are the same axis; give "
                          "one of them, or the same size")
        self.context_parallel = ContextParallelConfig(size=n, method=cp.method)
        return self

    @field_validator("gradient_allreduce_op", mode="before")
    @classmethod
    def _lower_case_op(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value

    @model_validator(mode="after")
    def _data_types_match_precision(self) -> "Zero3DConfig":
        why = {"grad_accum_dtype": "Zero3D accumulates gradients in the working precision",
               "param_dtype": "the working precision is chosen by fp16.enabled / bf16.enabled"}
        for key, reason in why.items():
            wanted = getattr(self.data_types, key)
            if wanted is not None and wanted != self.precision:
                raise problem(f"data_types.{key}: \"{wanted}\" with {self.precision} working params: {reason}; "
                              f"leave it unset or set \"{self.precision}\"")
        return self

    # --- construction -------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: Any) -> "Zero3DConfig":
        """Validate a DeepSpeed-style dict; every problem becomes one ConfigError."""
        if not isinstance(data, dict):
            raise ConfigError(f"a config must be a mapping of keys to values, got {type(data).__name__}")
        try:
            return cls.model_validate(data)
        except ValidationError as err:
            raise ConfigError(describe_validation_error(err, cls)) from None

    # --- derived values -----------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        """World size the batch sizes were resolved for (set by load_config / resolve)."""
        if self._world_size is None:
            raise ConfigError("this config has not been resolved for a world size; use load_config()")
        return self._world_size

    @property
    def data_parallel_size(self) -> int:
        """world_size // (tensor_parallel.size * pipeline.stages * context_parallel.size): the ranks
        given different micro-batches (a context-parallel group shares its micro-batch)."""
        return self.world_size // (self.tensor_parallel.size * self.pipeline.stages * self.context_parallel.size)

    @property
    def precision(self) -> str:
        """"fp16", "bf16" or "fp32": the dtype of working params."""
        return "fp16" if self.fp16.enabled else "bf16" if self.bf16.enabled else "fp32"

    def resolve(self, world_size: int) -> "Zero3DConfig":
        """A copy with the mesh checked against world_size and all three batch sizes set."""
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ConfigError(f"world_size: {world_size!r} must be a positive integer")
        tp, pp, cp = self.tensor_parallel.size, self.pipeline.stages, self.context_parallel.size
        if world_size % (tp * pp):
            raise ConfigError(f"world size {world_size} is not divisible by tensor_parallel.size {tp} x "
                              f"pipeline.stages {pp} = {tp * pp}")
        if (world_size // (tp * pp)) % cp:
            raise ConfigError(f"context_parallel.size {cp} does not divide world size {world_size} / "
                              f"(tensor_parallel.size {tp} x pipeline.stages {pp}) = {world_size // (tp * pp)}: the "
                              "context-parallel ranks are taken from the data-parallel ones")
        given = self._given_batch or tuple(getattr(self, key) for key in BATCH_KEYS)
        batch = resolve_batch_sizes(*given, data_parallel_size=world_size // (tp * pp * cp))
        dp, shard = world_size // (tp * pp * cp), self.zero_optimization.mics_shard_size
        if shard != -1 and dp % shard:
            with_cp = f" x context_parallel.size {cp}" if cp > 1 else ""
            raise ConfigError(f"zero_optimization.mics_shard_size {shard} does not divide the data-parallel size {dp} "
                              f"(world {world_size} / (tensor_parallel.size {tp} x pipeline.stages {pp}{with_cp})); "
                              f"allowed: a divisor of {dp}, or -1 for one group of all {dp}")
        hpz, shard_ranks = self.zero_optimization.zero_hpz_partition_size, self.zero_optimization.shard_size(dp) * cp
        _divides_shard_ranks("zero_optimization.zero_hpz_partition_size", hpz, shard_ranks, " (the GPUs of a node, typically)")
        ep = self.expert_parallel.size
        _divides_shard_ranks("expert_parallel.autoep_size", ep, shard_ranks, " (expert parallelism is folded over them)")
        etp = self.expert_parallel.expert_tensor_parallel_size
        if etp not in (1, tp):
            allowed = (f"1 (experts whole on every tensor-parallel rank) or {tp} (each expert split over them)"
                       if tp > 1 else "1 (tensor parallelism is off)")
            raise ConfigError(f"expert_parallel.expert_tensor_parallel_size {etp} with tensor_parallel.size {tp}: "
                              f"each expert is split over all the tensor-parallel ranks or none; allowed: {allowed}")
        if ep > 1 and hpz > 1:
            raise ConfigError("expert_parallel with zero_optimization.zero_hpz_partition_size > 1 is not supported: "
                              "the secondary partition is cut from the data-parallel shard group, which expert "
                              "parameters are not sharded over; set zero_hpz_partition_size to 1")
        if self.zero_optimization.offloads_params and self.zero_optimization.shard_size(dp) * cp == 1:
            raise ConfigError('zero_optimization.offload_param with device "cpu" needs at least 2 ranks to shard over '
                              "(data-parallel ranks, or with zero_optimization.mics_shard_size the ranks of one shard "
                              "group): with one, ZeRO stage 3 keeps every parameter whole on the device (nothing is "
                              "sharded, so nothing would be offloaded); run more data-parallel ranks, raise "
                              "mics_shard_size, or remove the key (offload_optimizer works with one)")
        if pp > 1:  # interleaving's rule on the micro-batch count, before any process group exists
            from parallel3d.pipeline.schedules import validate_schedule_args

            validate_schedule_args(self.pipeline.schedule, pp, batch[2], self.pipeline.virtual_stages)
        resolved = self.model_copy(update=dict(zip(BATCH_KEYS, batch)))
        resolved._world_size, resolved._given_batch = world_size, given
        return resolved


def resolve_batch_sizes(train_batch: Optional[int], micro_batch: Optional[int], grad_acc: Optional[int],
                        data_parallel_size: int) -> tuple[int, int, int]:
    """DeepSpeed's rule (runtime/config.py `_set_batch_related_parameters`, `_batch_assertion`),
    counted over the data-parallel size: derive what is missing with floor division, then require
    train_batch_size == micro x accumulation x dp."""
    dp, derived = data_parallel_size, []
    if train_batch is None and micro_batch is None:
        raise ConfigError("neither train_batch_size nor train_micro_batch_size_per_gpu is set; set at least "
                          "one of them (gradient_accumulation_steps alone does not fix the batch size)")
    if train_batch is not None and micro_batch is not None and grad_acc is None:
        grad_acc, derived = train_batch // micro_batch // dp, ["gradient_accumulation_steps"]
    elif train_batch is not None and micro_batch is None:
        grad_acc = 1 if grad_acc is None else grad_acc
        micro_batch, derived = train_batch // dp // grad_acc, ["train_micro_batch_size_per_gpu"]
    elif train_batch is None:
        grad_acc = 1 if grad_acc is None else grad_acc
        train_batch, derived = micro_batch * grad_acc * dp, ["train_batch_size"]
    if train_batch != micro_batch * grad_acc * dp:
        note = f" ({', '.join(derived)} derived from the others by DeepSpeed's rule)" if derived else ""
        raise ConfigError(f"train_batch_size {train_batch} != train_micro_batch_size_per_gpu {micro_batch} x "
                          f"gradient_accumulation_steps {grad_acc} x data-parallel size {dp}{note}")
    return train_batch, micro_batch, grad_acc


# --- files ------------------------------------------------------------------------------------


def _divides_shard_ranks(key: str, size: int, shard_ranks: int, note: str) -> None:
    """ConfigError unless ``size`` (of ``key``; 1 is always fine) divides the ``shard_ranks`` ZeRO shards over."""
    if size > 1 and shard_ranks % size:
        raise ConfigError(f"{key} {size} does not divide the {shard_ranks} ranks ZeRO shards over (the data-parallel "
                          f"size, or mics_shard_size, times context_parallel.size); allowed: a divisor of "
                          f"{shard_ranks}{note}")


class _YamlLoader(yaml.SafeLoader):
    """SafeLoader that reads 5e8 and 1e-4 as numbers (YAML 1.2, like JSON) and refuses duplicate keys."""


_YamlLoader.yaml_implicit_resolvers = {k: list(v) for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"))


def _mapping_without_duplicates(loader: yaml.SafeLoader, node: yaml.MappingNode) -> dict:
    seen = set()
    for key_node, _ in node.value:
        if isinstance(key_node, yaml.ScalarNode):
            if key_node.value in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key_node.value!r}", key_node.start_mark)
            seen.add(key_node.value)
    return loader.construct_mapping(node, deep=True)


_YamlLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping_without_duplicates)


def _json_object_without_duplicates(pairs: list) -> dict:
    keys = [key for key, _ in pairs]
    duplicates = sorted({key for key in keys if keys.count(key) > 1})
    if duplicates:
        raise ValueError(f"duplicate key {duplicates[0]!r}")
    return dict(pairs)


def _read_hjson(text: str) -> dict | None:
    """The mapping in ``text`` read as Hjson (JSON with comments and unquoted keys, which
    DeepSpeed accepts in its .json configs), or None when hjson is not installed or cannot read it."""
    try:
        import hjson
    except ImportError:
        return None
    try:
        data = hjson.loads(text, object_pairs_hook=_json_object_without_duplicates)
    except (hjson.HjsonDecodeError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def read_config_file(path: Union[str, Path]) -> dict:
    """The mapping in a .json, .yaml or .yml file; ConfigError naming the file otherwise."""
    path = Path(path)
    if path.suffix.lower() not in (".json", ".yaml", ".yml"):
        raise ConfigError(f"config file {path}: unsupported extension {path.suffix!r}; use .json, .yaml or .yml")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        reason = getattr(err, "strerror", None) or str(err)
        raise ConfigError(f"config file {path} cannot be read: {reason}") from None
    if path.suffix.lower() == ".json":
        try:
            data = json.loads(text, object_pairs_hook=_json_object_without_duplicates)
        except json.JSONDecodeError as err:
            data = _read_hjson(text)
            if data is None:
                raise ConfigError(f"config file {path} is not valid JSON: {err.msg} at line {err.lineno} "
                                  f"column {err.colno}") from None
        except ValueError as err:
            raise ConfigError(f"config file {path} is not valid JSON: {err}") from None
    else:
        try:
            data = yaml.load(text, Loader=_YamlLoader)
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f" at line {mark.line + 1} column {mark.column + 1}" if mark is not None else ""
            reason = getattr(err, "problem", None) or str(err).replace("\n", " ")
            raise ConfigError(f"config file {path} is not valid YAML: {reason}{where}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of config keys at the top level, "
                          f"got {type(data).__name__}")
    return data


def load_config(source: Union[str, Path, dict, Zero3DConfig], world_size: int) -> Zero3DConfig:
    """Parse, validate and resolve a config for `world_size` ranks.

    `source` is a path to a .json/.yaml/.yml file, a dict in DeepSpeed's format, or a Zero3DConfig
    (re-resolved from the batch sizes its user gave). The result has train_batch_size,
    train_micro_batch_size_per_gpu and gradient_accumulation_steps set, and data_parallel_size.
    """
    if isinstance(source, Zero3DConfig):
        config = source
    elif isinstance(source, dict):
        config = Zero3DConfig.from_dict(source)
    elif isinstance(source, (str, Path)):
        config = Zero3DConfig.from_dict(read_config_file(source))
    else:
        raise ConfigError(f"config source must be a path, a dict or a Zero3DConfig, got {type(source).__name__}")
    return config.resolve(world_size)

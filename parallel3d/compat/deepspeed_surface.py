"""The parts of DeepSpeed's ``DeepSpeedEngine`` a training script reaches for, on Zero3D's ``Engine``.

``DeepSpeedSurface`` is mixed into ``Engine``: DeepSpeed's config getters
(``engine.train_micro_batch_size_per_gpu()``, ``engine.zero_optimization_stage()``, ...), the
counters and flags (``skipped_steps``, ``was_step_applied()``, ``get_global_grad_norm()``),
``destroy()``, ``save_16bit_model`` and attribute forwarding to the wrapped module (an
attribute the engine lacks is looked up on ``engine.module``, as DeepSpeed does). Values come
from the validated config, so each getter returns what DeepSpeed's would for the same JSON.

``CallableInt`` lets ``engine.gradient_accumulation_steps`` be both Zero3D's int attribute
and DeepSpeed's method: ``engine.gradient_accumulation_steps() == engine.gradient_accumulation_steps``.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from parallel3d.errors import ConfigError
from parallel3d.compat.gathered import GatheredParameters

if TYPE_CHECKING:
    from parallel3d.engine.train_state import TrainState
    from parallel3d.config.config import Zero3DConfig
    from parallel3d.config.sections import OffloadOptimizerConfig, OffloadParamConfig
    from parallel3d.runtime.mesh import ParallelMesh
    from zero import ZeroOptimizer

logger = logging.getLogger(__name__)

_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


class CallableInt(int):
    """An int that also answers a call with itself (DeepSpeed's getter spelling of an attribute)."""

    def __call__(self) -> int:
        return int(self)


class DeepSpeedSurface:
    """DeepSpeed engine getters and helpers over ``self.config``, ``self.optimizer`` and ``self.module``."""

    config: Zero3DConfig
    optimizer: ZeroOptimizer
    mesh: ParallelMesh
    module: torch.nn.Module
    client_optimizer: torch.optim.Optimizer | None
    train_state: TrainState

    # -- attribute forwarding ------------------------------------------------------------

    def __getattr__(self, name: str) -> Any:
        parallel = self.__dict__.get("parallel")  # absent while unpickling: no recursion through here
        module = parallel.module if parallel is not None else None
        if module is not None and not name.startswith("__"):
            try:
                return getattr(module, name)
            except AttributeError:
                pass
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}', nor has the model it wraps")

    # -- batch and step --------------------------------------------------------------------

    def train_batch_size(self) -> int:
        return self.config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.train_micro_batch_size_per_gpu

    def steps_per_print(self) -> int:
        return self.config.steps_per_print

    def dataloader_drop_last(self) -> bool:
        return self.config.dataloader_drop_last

    def gradient_clipping(self) -> float:
        return self.config.gradient_clipping

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped because fp16 gradients overflowed (counted in ``global_steps``)."""
        return self.optimizer.skipped_steps

    def was_step_applied(self) -> bool:
        """Whether the last optimizer step updated the parameters (False after an fp16 overflow)."""
        return self.train_state.step_applied

    def get_global_grad_norm(self) -> float | None:
        """The gradient norm of the last optimizer step (before clipping), or None before the first one."""
        return self.optimizer.last_grad_norm

    def get_mom(self) -> list:
        """Each param group's momentum (SGD) or betas (Adam family), as DeepSpeed reports them."""
        key = "momentum" if "momentum" in self.optimizer.param_groups[0] else "betas"
        return [g.get(key) for g in self.optimizer.param_groups]

    # -- optimizer and scheduler -----------------------------------------------------------

    def optimizer_name(self) -> str | None:
        """The client optimizer's class name, else the config's type (lower case, as DeepSpeed keeps it)."""
        if self.client_optimizer is not None:
            return type(self.client_optimizer).__name__
        return self.config.optimizer.type.lower() if self.config.optimizer is not None else None

    def optimizer_params(self) -> dict | None:
        return dict(self.config.optimizer.params) if self.config.optimizer is not None else None

    def scheduler_name(self) -> str | None:
        return self.config.scheduler.type if self.config.scheduler is not None else None

    def scheduler_params(self) -> dict | None:
        return dict(self.config.scheduler.params) if self.config.scheduler is not None else None

    # -- precision ---------------------------------------------------------------------------

    def fp16_enabled(self) -> bool:
        return self.config.fp16.enabled

    def bfloat16_enabled(self) -> bool:
        return self.config.bf16.enabled

    def fp16_auto_cast(self) -> bool:
        return False

    def loss_scale(self) -> float:
        """The configured static loss scale (0 means dynamic), as DeepSpeed's getter returns it."""
        return self.config.fp16.loss_scale

    def dynamic_loss_scale(self) -> bool:
        return self.config.fp16.loss_scale == 0

    def initial_dynamic_scale(self) -> float:
        return 2.0 ** self.config.fp16.initial_scale_power

    def dynamic_loss_scale_args(self) -> dict:
        """The ``fp16`` section's dynamic loss scaler arguments, under DeepSpeed's names."""
        fp16 = self.config.fp16
        return {"init_scale": 2.0 ** fp16.initial_scale_power, "scale_window": fp16.loss_scale_window,
                "delayed_shift": fp16.hysteresis, "consecutive_hysteresis": fp16.consecutive_hysteresis,
                "min_scale": fp16.min_loss_scale}

    def get_data_types(self) -> tuple[torch.dtype, torch.dtype]:
        """(working dtype, gradient accumulation dtype): Zero3D accumulates gradients in the working dtype."""
        dtype = _DTYPES[self.config.precision]
        return dtype, dtype

    @property
    def communication_data_type(self) -> torch.dtype:
        """Gradients are reduced in the working dtype."""
        return _DTYPES[self.config.precision]

    def postscale_gradients(self) -> bool:
        return not self.config.prescale_gradients

    def gradient_predivide_factor(self) -> float:
        return self.config.gradient_predivide_factor

    # -- ZeRO ----------------------------------------------------------------------------------

    def zero_optimization(self) -> bool:
        return self.config.zero_optimization.stage > 0

    def zero_optimization_stage(self) -> int:
        return self.config.zero_optimization.stage

    def zero_optimization_partition_gradients(self) -> bool:
        return self.config.zero_optimization.stage >= 2

    def zero_optimization_partition_weights(self) -> bool:
        return self.config.zero_optimization.stage >= 3

    def zero_reduce_bucket_size(self) -> int:
        return self.config.zero_optimization.reduce_bucket_size

    def zero_allgather_bucket_size(self) -> int:
        return self.config.zero_optimization.allgather_bucket_size

    def zero_overlap_comm(self) -> bool:
        return self.config.zero_optimization.overlap_comm

    def zero_contiguous_gradients(self) -> bool:
        return self.config.zero_optimization.contiguous_gradients

    def zero_reduce_scatter(self) -> bool:
        return self.config.zero_optimization.reduce_scatter

    def zero_allgather_partitions(self) -> bool:
        return self.config.zero_optimization.allgather_partitions

    def zero_round_robin_gradients(self) -> bool:
        return self.config.zero_optimization.round_robin_gradients

    def zero_sub_group_size(self) -> int:
        return self.config.zero_optimization.sub_group_size

    def zero_prefetch_bucket_size(self) -> int:
        return self.config.zero_optimization.stage3_prefetch_bucket_size

    def zero_param_persistence_threshold(self) -> int:
        return self.config.zero_optimization.stage3_param_persistence_threshold

    def zero_max_live_parameters(self) -> int:
        return self.config.zero_optimization.stage3_max_live_parameters

    def zero_max_reuse_distance(self) -> int:
        return self.config.zero_optimization.stage3_max_reuse_distance

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        return self.config.zero_optimization.stage3_gather_16bit_weights_on_model_save

    def zero_offload_optimizer(self) -> OffloadOptimizerConfig | None:
        """The `offload_optimizer` block (DeepSpeed's fields and values), None when absent."""
        return self.config.zero_optimization.offload_optimizer

    def zero_offload_param(self) -> OffloadParamConfig | None:
        """The `offload_param` block (DeepSpeed's fields and values), None when absent."""
        return self.config.zero_optimization.offload_param

    def zero_cpu_offload(self) -> bool:
        """Whether the optimizer states are offloaded to the CPU."""
        return self.config.zero_optimization.offloads_optimizer

    def zero_use_cpu_optimizer(self) -> bool:
        """Whether the optimizer steps on the CPU (offloaded optimizer states)."""
        return self.config.zero_optimization.offloads_optimizer

    def zero_partial_offload(self) -> float:
        """The share of optimizer states offloaded (always all: 1.0)."""
        offload = self.config.zero_optimization.offload_optimizer
        return offload.ratio if offload is not None else 1.0

    # -- features Zero3D does not run (their DeepSpeed keys are refused unless off) --------------

    def wall_clock_breakdown(self) -> bool:
        return False

    def memory_breakdown(self) -> bool:
        return False

    def flops_profiler_enabled(self) -> bool:
        return False

    def autotuning_enabled(self) -> bool:
        return False

    # -- ranks ---------------------------------------------------------------------------------

    @property
    def dp_world_size(self) -> int:
        return self.mesh.dp

    @property
    def mp_world_size(self) -> int:
        return self.mesh.tp

    @property
    def world_size(self) -> int:
        return self.mesh.world_size

    @property
    def global_rank(self) -> int:
        return dist.get_rank() if dist.is_initialized() else 0

    def get_data_parallel_rank(self) -> int:
        return self.mesh.local_rank("dp")

    def get_tensor_parallel_rank(self) -> int:
        return self.mesh.local_rank("tp")

    def get_model_parallel_rank(self) -> int:
        return self.mesh.local_rank("tp")

    # -- compiled blocks -------------------------------------------------------------------------

    def compile(self, backend: str | Any = "inductor", compile_kwargs: dict | None = None, schedule: Any = None,
                compiled_autograd_enabled: bool = False) -> None:
        """DeepSpeed's ``engine.compile()``: here each repeated block is compiled on its own
        (parallel3d/build/compiled_blocks.py), as the config's ``compile.enabled`` does. A second call
        with the same arguments does nothing; DeepCompile's ``schedule`` and compiled autograd are
        not implemented."""
        from parallel3d.build import compiled_blocks

        if schedule is not None:
            raise ConfigError("engine.compile(schedule=...) is DeepSpeed's DeepCompile schedule, which Zero3D does not "
                              "implement; call engine.compile() without it")
        if compiled_autograd_enabled:
            raise ConfigError("engine.compile(compiled_autograd_enabled=True) is not supported: Zero3D compiles each "
                              "block's forward (and its backward through AOTAutograd), and its gradient hooks stay eager")
        kwargs = dict(compile_kwargs or {})
        compiled_blocks.check_backend(backend)
        compiled_blocks.check_kwargs(kwargs)
        current = self.__dict__.get("compiled")
        if current is not None:
            if (current.backend, current.kwargs) == (backend, kwargs):
                return
            raise ConfigError(f"the engine's blocks are already compiled with backend {current.backend!r} and "
                              f"{current.kwargs}; compile once (in the config's compile section or one engine.compile call)")
        self.compiled = compiled_blocks.compile_blocks(self.module, self.pipe, self.tp_info, backend, kwargs,
                                                       self.mesh.size("cp"), self.config.expert_parallel.size)

    @property
    def is_compiled(self) -> bool:
        """Whether the blocks run compiled (DeepSpeed's property)."""
        return self.__dict__.get("compiled") is not None

    # -- lifetime and export ---------------------------------------------------------------------

    def destroy(self) -> None:
        """Wait for a background save, stop the heartbeat thread and detach the engine's hooks
        from the model (DeepSpeed's destroy)."""
        self.wait_for_checkpoint()
        if self.watchdog is not None:
            self.watchdog.close()
        self.optimizer.reducer.remove_hooks()
        if self.optimizer.fetcher is not None:
            self.optimizer.fetcher.remove_hooks()
        if self.__dict__.get("compiled") is not None:
            self.compiled.undo()
            self.compiled = None
        group = self.__dict__.get("_save_group")
        if group is not None:
            dist.destroy_process_group(group)
            self._save_group = None

    def save_16bit_model(self, save_dir: str | os.PathLike, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """Write the whole model's state dict, parameters in the working precision, with ``torch.save``.

        A collective over data and tensor parallelism; rank 0 writes ``save_dir/save_filename``.
        Returns True once written. At ZeRO stage 3, as in DeepSpeed, only with
        ``zero_optimization.stage3_gather_16bit_weights_on_model_save`` (the whole model is
        gathered): without it nothing is written and False is returned, with a warning.
        Pipeline stages: save a checkpoint and use ``zero3d export``, which writes a Hugging Face
        directory from any layout.
        """
        zero = self.config.zero_optimization
        if zero.stage == 3 and not zero.stage3_gather_16bit_weights_on_model_save:
            logger.warning("save_16bit_model did not save %s: at ZeRO stage 3 it needs "
                           "zero_optimization.stage3_gather_16bit_weights_on_model_save: true (as in DeepSpeed)",
                           Path(save_dir) / save_filename)
            return False
        if self.mesh.pp > 1:
            raise ConfigError("save_16bit_model with pipeline.stages > 1: each stage holds part of the model; "
                              "use engine.save_checkpoint and `zero3d export CKPT OUT --dtype bf16` instead")
        state = self._whole_state_dict(exclude_frozen_parameters)
        if self.global_rank == 0:
            path = Path(save_dir) / save_filename
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(state, path)
            logger.info("saved the 16-bit model to %s", path)
        if dist.is_initialized():
            dist.barrier()
        return True

    def _whole_state_dict(self, exclude_frozen: bool) -> dict[str, torch.Tensor]:
        """The module's state dict with every parameter whole: trainable ones from the masters."""
        trainable = self.full_parameters()
        frozen = [] if exclude_frozen else [p for p in self.module.parameters() if not p.requires_grad]
        with GatheredParameters(frozen):  # stage 3 shards them over dp
            return self._state_dict_of_whole(trainable, exclude_frozen)

    def _state_dict_of_whole(self, trainable: dict[str, torch.Tensor], exclude_frozen: bool) -> dict[str, torch.Tensor]:
        dtype = _DTYPES[self.config.precision]
        name_of = {p: n for n, p in self.module.named_parameters()}
        specs = self.tp_info.shard_specs if self.tp_info is not None else {}
        state = {}
        for name, value in self.module.state_dict(keep_vars=True).items():
            first = name_of.get(value) if isinstance(value, torch.nn.Parameter) else None
            if first in trainable:
                state[name] = trainable[first].to(dtype)
                continue
            if first is not None and exclude_frozen:
                continue
            tensor = value.detach()
            if first in specs:
                shards = [torch.empty_like(tensor) for _ in range(self.mesh.tp)]
                dist.all_gather(shards, tensor.contiguous(), group=self.mesh.groups.tp)
                tensor = specs[first].unshard(shards)
            if self.ep_info is not None and first in self.ep_info.params:  # a frozen expert weight: every expert
                parts = [torch.empty_like(tensor) for _ in range(self.ep_info.size)]
                dist.all_gather(parts, tensor.contiguous(), group=self.ep_info.group)
                tensor = torch.cat(parts)
            state[name] = tensor.clone()
        return state

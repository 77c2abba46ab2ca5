"""``parallel3d.initialize``: validate the config, build the mesh, shard the model, return an engine.

The order matters and is fixed: (1) validate everything that can be validated without
talking to other ranks (config, optimizer options, a pretrained directory against the model);
(2) join the process group (collective timeout ``comm.timeout_s``) and agree, in one small
collective, that every rank has the same resolved config, world size and model signature, or
that one rank's input was bad (parallel3d/runtime/agreement.py), so every rank stops with the same
message; (3) a meta model gets its buffers and storage-less params (parallel3d/build/meta_init.py);
(4) build the pp x dp x cp x tp mesh; (5) ``apply_tp`` -> context parallelism's attention
(parallel3d/context_parallel) -> ``apply_pipeline`` -> ``apply_zero`` (parallel3d/build/apply.py).
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from parallel3d.runtime.agreement import agree, describe
from parallel3d.build.apply import apply_ep, apply_pipeline, apply_tp, apply_zero
from parallel3d.build.parallel_model import ParallelModel
from parallel3d.config.config import Zero3DConfig, load_config
from parallel3d.compat.ds_arguments import (check_distributed_arguments, check_model, refuse_deepspeed_partitioned,
                                     resolve_config)
from parallel3d.config.sections import CommConfig
from parallel3d.context_parallel import apply_context_parallel, check_context_parallel
from parallel3d.engine.engine import Engine
from parallel3d.expert_parallel import check_expert_parallel
from parallel3d.expert_parallel.bias_balance import ExpertBiasBalancer, balanced_routers, check_bias_balance
from parallel3d.errors import ConfigError, UsageError
from parallel3d.compat.gathered import register
from parallel3d.runtime.lifeline import install_exit_guard
from parallel3d.lr.build import build_lr_scheduler
from parallel3d.build.optimizer_check import check_sharded_optimizer
from parallel3d.build.peft_model import unwrap_peft
from parallel3d.pipeline.model_checkpointing import reentrant_checkpointing
from parallel3d.pipeline.schedules import has_weight_pass
from parallel3d.runtime.mesh import build_mesh
from parallel3d.runtime.world import default_device, ensure_process_group
from parallel3d.build.meta_init import buffer_values, detach_from_meta, load_in_place, on_meta, pretrained_source, take_source
from parallel3d.planner.auto import resolve_auto
from parallel3d.build.stage3_notice import persistence_notice
from parallel3d.build import compiled_blocks
from parallel3d.engine import token_mean
from parallel3d.runtime.watchdog import Watchdog, set_timeout
from parallel3d.runtime.worker_errors import install as install_worker_errors
from zero import ZeroOptimizer

logger = logging.getLogger(__name__)

_TORCH_OPTIMIZERS = {"Adam": torch.optim.Adam, "AdamW": torch.optim.AdamW, "SGD": torch.optim.SGD}


def _param_groups(model: nn.Module, model_parameters: Iterable | None) -> list[dict]:
    """Torch-style param groups of trainable params (each param once, tied weights too)."""
    if model_parameters is None:
        items: list = [p for p in model.parameters() if p.requires_grad]
    else:
        items = list(model_parameters)
    if items and isinstance(items[0], dict):
        groups = [dict(g, params=[p for p in g["params"] if p.requires_grad]) for g in items]
    else:
        groups = [{"params": [p for p in items if p.requires_grad]}]
    owned = {id(p) for p in model.parameters()}
    seen: set[int] = set()
    for g in groups:
        for p in g["params"]:
            if id(p) not in owned:
                raise ConfigError("model_parameters holds a parameter that is not a parameter of the model")
            if id(p) in seen:
                raise ConfigError("model_parameters lists a parameter twice (in two param groups?)")
            seen.add(id(p))
    groups = [g for g in groups if g["params"]]
    if not groups:
        raise ConfigError("the model has no trainable parameters (requires_grad=True)")
    return groups


def _optimizer_factory(cfg: Zero3DConfig, optimizer: Any, groups: list[dict]) -> Callable[[list[dict]], torch.optim.Optimizer]:
    """How to build the inner optimizer over master shards: from the argument or the config.

    An optimizer passed to initialize() wins over the config's 'optimizer' section, as in DeepSpeed.
    """
    if optimizer is not None and cfg.optimizer is not None:
        logger.info("initialize() got an optimizer and the config an 'optimizer' section: using the one passed "
                    "(as DeepSpeed does)")
    if isinstance(optimizer, torch.optim.Optimizer):
        # Like DeepSpeed, reuse the client's optimizer object over the master shards, so an
        # lr scheduler the user built on it keeps driving the lr that is used.
        for g in groups:
            for key, value in optimizer.defaults.items():
                g.setdefault(key, value)
        return functools.partial(_rebind_optimizer, optimizer)
    if callable(optimizer):
        return optimizer
    if optimizer is not None:
        raise ConfigError(f"optimizer must be a torch.optim.Optimizer or a callable(param_groups), got {type(optimizer).__name__}")
    if cfg.optimizer is None:
        if cfg.scheduler is not None:
            raise ConfigError("the config has a 'scheduler' section but no 'optimizer' section and initialize() got "
                              "no optimizer=: a learning-rate schedule needs an optimizer")
        return ForwardOnly
    cls = _TORCH_OPTIMIZERS[cfg.optimizer.torch_optimizer_class_name()]
    kwargs = cfg.optimizer.torch_optimizer_kwargs()
    return lambda inner_groups: cls(inner_groups, **kwargs)


class ForwardOnly(torch.optim.Optimizer):
    """The inner optimizer of an engine built without one (DeepSpeed allows that for evaluation)."""

    holds_no_state = True  # a checkpoint's optimizer state of any type loads into it (and is never used)

    def __init__(self, param_groups: list[dict]) -> None:
        super().__init__(param_groups, {})

    def step(self, closure=None):
        raise UsageError("this engine was built without an optimizer (the config has no 'optimizer' section and "
                         "initialize() got no optimizer=), so it runs forward passes and eval_batch only; add an "
                         "'optimizer' section (type Adam, AdamW or SGD) or pass optimizer= to train")


def _rebind_optimizer(optimizer: torch.optim.Optimizer, inner_groups: list[dict]) -> torch.optim.Optimizer:
    """Point a client optimizer's groups at the master shards (its state starts empty)."""
    optimizer.param_groups = []
    optimizer.state.clear()
    for group in inner_groups:
        optimizer.add_param_group(group)
    return optimizer


def _check_optimizer_options(factory: Callable, groups: list[dict]) -> type:
    """Build the optimizer once over stand-in params, so bad options stop before any collective;
    its type."""
    stand_ins = [dict(g, params=[torch.zeros(1, requires_grad=True)]) for g in groups]
    try:
        return type(factory(stand_ins))
    except (ValueError, TypeError, KeyError) as exc:
        raise ConfigError(f"optimizer options are invalid: {exc}") from None


def _lr_scheduler(cfg: Zero3DConfig, lr_scheduler: Any, optimizer: ZeroOptimizer):
    """The caller's scheduler (or what its callable builds) wins over the config's, as in DeepSpeed."""
    if lr_scheduler is not None:
        if hasattr(lr_scheduler, "step"):
            return lr_scheduler
        # torch's schedulers insist on a torch.optim.Optimizer: hand them the inner one,
        # whose param_groups are the engine's, so the lr they set is the lr used.
        return lr_scheduler(optimizer.inner)
    if cfg.scheduler is None:
        return None
    return build_lr_scheduler(optimizer, cfg.scheduler.type, cfg.scheduler.typed_params())


def _dataloader(cfg: Zero3DConfig, mesh, training_data, collate_fn):
    """DeepSpeed's default loader: shuffled, sharded over dp only, micro-batch sized."""
    if training_data is None:
        return None
    sampler = torch.utils.data.DistributedSampler(training_data, num_replicas=mesh.dp, rank=mesh.local_rank("dp"))
    return torch.utils.data.DataLoader(
        training_data, batch_size=cfg.train_micro_batch_size_per_gpu, sampler=sampler, collate_fn=collate_fn,
        drop_last=cfg.dataloader_drop_last,
    )


@dataclass
class _Checked:
    """What `_validate` found valid: the resolved config, param groups, optimizer factory, weights."""

    cfg: Zero3DConfig
    groups: list[dict]
    named_groups: list[dict]
    factory: Callable
    weights: Any


def _validate(model, config, world, device, model_parameters, optimizer, lr_scheduler, pretrained) -> _Checked:
    """Everything checked without talking to other ranks; raises ConfigError (see `initialize`)."""
    cfg = load_config(resolve_auto(config, model, world, device), world)
    if isinstance(optimizer, torch.optim.Optimizer) and model_parameters is None:
        model_parameters = optimizer.param_groups  # a client optimizer names its params
    check_context_parallel(model, cfg)
    check_expert_parallel(model, cfg.expert_parallel.size)
    _check_split_backward(model, cfg)
    if cfg.expert_parallel.load_balance_coeff is not None:
        check_bias_balance(model, cfg.compile.enabled)
    if cfg.loss_normalization == "tokens" and (problem := token_mean.model_problem(model)) is not None:
        raise ConfigError(problem)
    groups = _param_groups(model, model_parameters)
    names = {p: n for n, p in model.named_parameters()}
    named_groups = [dict(g, params=[names[p] for p in g["params"]]) for g in groups]
    factory = _optimizer_factory(cfg, optimizer, groups)
    if isinstance(optimizer, torch.optim.Optimizer):
        optimizer_type: type = type(optimizer)
    else:
        optimizer_type = _check_optimizer_options(factory, groups)
    if optimizer_type is not ForwardOnly:
        check_sharded_optimizer(optimizer_type, cfg.zero_optimization.stage, cfg.tensor_parallel.size,
                                cfg.zero_allow_untested_optimizer)
    if lr_scheduler is not None and cfg.scheduler is not None:
        logger.info("initialize() got an lr_scheduler and the config a 'scheduler' section: using the one passed "
                    "(as DeepSpeed does)")
    weights = pretrained_source(pretrained, model) if pretrained is not None else None
    _check_backend(cfg, device)
    if cfg.compile.enabled:
        compiled_blocks.check_backend(cfg.compile.backend)
        compiled_blocks.check_layout(model, cfg.tensor_parallel.size, cfg.context_parallel.size,
                                     cfg.expert_parallel.size)
    return _Checked(cfg, groups, named_groups, factory, weights)


def _check_split_backward(model: nn.Module, cfg: Zero3DConfig) -> None:
    """ZB-H1's input- and weight-gradient passes (``torch.autograd.grad``, ``backward(inputs=...)``) cannot
    run through torch's reentrant checkpointing: it raised on every stage but the first, mid-step, while
    the first waited for it (parallel3d/pipeline/model_checkpointing.py)."""
    schedule = cfg.pipeline.schedule
    if cfg.pipeline.stages == 1 or not has_weight_pass(schedule) or (name := reentrant_checkpointing(model)) is None:
        return
    raise ConfigError(f"pipeline.schedule {schedule!r} splits each backward into an input-gradient and a weight-gradient "
                      f"pass, which torch's reentrant checkpointing cannot run, and the model checkpoints {name} with "
                      "use_reentrant=True (gradient_checkpointing_enable); use pipeline.activation_checkpointing "
                      "instead (model.gradient_checkpointing_disable()), or gradient_checkpointing_enable("
                      "gradient_checkpointing_kwargs={'use_reentrant': False}), or another pipeline.schedule")


def _check_backend(cfg: Zero3DConfig, device: torch.device) -> None:
    """Pipeline stages send activations point to point, which gloo cannot do with CUDA tensors
    (it aborts the process: ``gloo::IoException ... writev: Bad address``)."""
    if cfg.pipeline.stages > 1 and device.type == "cuda" and dist.is_initialized() and dist.get_backend() == "gloo":
        raise ConfigError("pipeline.stages > 1 on CUDA needs a process group that can send CUDA tensors point to "
                          "point, and this one is gloo: initialize it with backend 'nccl' (or let initialize create "
                          "it), or run on the CPU")


def initialize(
    model: nn.Module = None,
    config: Any = None,
    model_parameters: Iterable | None = None,
    optimizer: Any = None,
    lr_scheduler: Any = None,
    training_data: Any = None,
    collate_fn: Callable | None = None,
    device: torch.device | str | None = None,
    pretrained: str | os.PathLike | None = None,
    *,
    args: Any = None,
    config_params: Any = None,
    dist_init_required: bool | None = None,
    distributed_port: int | None = None,
    mpu: Any = None,
    mesh_param: Any = None,
):
    """Build a training engine for ``model`` from ``config`` (DeepSpeed JSON/YAML path or dict).

    Returns ``(engine, optimizer, dataloader, lr_scheduler)`` like ``deepspeed.initialize``;
    the dataloader is None without ``training_data``, the scheduler None without one.
    Launch under torchrun (any world size) or as a plain single process. ``"auto"`` for
    ``tensor_parallel.size``, ``pipeline.stages``, ``zero_optimization.stage`` or
    ``train_micro_batch_size_per_gpu`` lets the planner choose (parallel3d/planner/auto.py).

    ``model`` may be built on the meta device (``with torch.device("meta"): ...``): each rank
    then fills in only what it holds, with the values eager construction under the same seed
    gives, or with ``pretrained`` weights: a Hugging Face directory (``model.safetensors`` or
    shards with ``model.safetensors.index.json``) of which each rank reads only its slices.

    DeepSpeed's keyword arguments are read as ``deepspeed.initialize`` reads them (``args``,
    ``config_params``, ``dist_init_required``, ``distributed_port``; parallel3d/compat/ds_arguments.py).
    An ``optimizer`` or ``lr_scheduler`` passed here wins over the config's section, as there.
    """
    install_worker_errors()  # under torchrun: a ConfigError/UsageError ends a worker with one line
    check_model(model)
    refuse_deepspeed_partitioned(model)
    model = unwrap_peft(model)  # train the HF model inside a PeftModel (parallel3d/build/peft_model.py)
    check_distributed_arguments(mpu, mesh_param, dist_init_required, distributed_port)
    config = resolve_config(config, config_params, args)
    device = torch.device(device) if device is not None else default_device()
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    try:
        checked = _validate(model, config, world, device, model_parameters, optimizer, lr_scheduler, pretrained)
    except ConfigError as exc:  # the other ranks learn it in the agreement instead of waiting there
        ensure_process_group(device, CommConfig().timeout_s)
        agree(exc, None)
        raise
    cfg, groups, named_groups, factory, weights = (
        checked.cfg, checked.groups, checked.named_groups, checked.factory, checked.weights)
    timeout_s = cfg.comm.timeout_s
    if dist.is_initialized() and "comm" in cfg.model_fields_set:
        set_timeout([dist.group.WORLD], timeout_s)  # the caller's own group: only when the config says so
    ensure_process_group(device, timeout_s)
    node_shard_ranks = _node_shard_ranks(cfg)  # from each rank's LOCAL_WORLD_SIZE: all must agree, or the groups hang
    agree(None, describe(cfg.model_dump(mode="json"),
                         {"world size": world, "ZeRO shard ranks per node (qgZ; LOCAL_WORLD_SIZE / tp)": node_shard_ranks},
                         model))
    _warn_on_rank0(cfg.expert_parallel.unused_size_notice())
    _warn_on_rank0(cfg.expert_parallel.unused_etp_notice(cfg.tensor_parallel.size))
    source = None  # where a meta model's parameters come from
    if on_meta(model):
        replay = take_source(model)  # before anything changes the model
        source = weights or replay
        detach_from_meta(model, buffer_values(replay, source), device)
    elif weights is not None:
        load_in_place(model, weights)
    dp = cfg.data_parallel_size
    mesh = build_mesh(cfg.tensor_parallel.size, cfg.pipeline.stages, device, timeout_s, cp=cfg.context_parallel.size,
                      dp_replicate=dp // cfg.zero_optimization.shard_size(dp),
                      hpz=cfg.zero_optimization.zero_hpz_partition_size, ep=cfg.expert_parallel.size,
                      node_shard_ranks=node_shard_ranks)
    install_exit_guard()  # the mesh's gloo groups must not outlive the interpreter's teardown
    if source is None:
        model.to(device)
    ep_info = apply_ep(model, mesh)
    tp_info = apply_tp(model, cfg.tensor_parallel, mesh, ep_info, cfg.expert_parallel.expert_tensor_parallel_size)
    sequence_split = apply_context_parallel(model, cfg, mesh)
    routers = balanced_routers(model) if cfg.expert_parallel.load_balance_coeff is not None else None
    pipe = apply_pipeline(model, cfg.pipeline, mesh, tp_info)
    expert_bias = None
    if routers is not None:  # the routers of the layers this pipeline stage kept
        expert_bias = ExpertBiasBalancer.attach(routers, pipe.chunks if pipe is not None else [model],
                                                cfg.expert_parallel.load_balance_coeff, mesh.groups.gradient_mean,
                                                tp_info)
        del routers
    zero_opt = apply_zero(model, cfg, mesh, named_groups, factory, tp_info, pipe, source, ep_info)
    _warn_on_rank0(persistence_notice(zero_opt))
    register(zero_opt)
    compiled = (compiled_blocks.compile_blocks(model, pipe, tp_info, cfg.compile.backend, cfg.compile.kwargs)
                if cfg.compile.enabled else None)
    scheduler = _lr_scheduler(cfg, lr_scheduler, zero_opt)
    client = optimizer if isinstance(optimizer, torch.optim.Optimizer) else None
    parallel = ParallelModel(model, mesh, zero_opt, tp=tp_info, pipe=pipe, ep=ep_info, sequence_split=sequence_split)
    engine = Engine(parallel, cfg, scheduler, client_optimizer=client, watchdog=Watchdog.for_default_group(timeout_s),
                    compiled=compiled, expert_bias=expert_bias)
    return engine, zero_opt, _dataloader(cfg, mesh, training_data, collate_fn), scheduler


def _warn_on_rank0(notice: str | None) -> None:
    """Log a start-up notice once for the job (rank 0), when there is one."""
    if notice is not None and (not dist.is_initialized() or dist.get_rank() == 0):
        logger.warning(notice)


def _node_shard_ranks(cfg) -> int:
    """ZeRO's shard-group members on one node, for qgZ's two hops (0: not quantizing gradients, or
    the node size unknown). The node is the launcher's ``LOCAL_WORLD_SIZE`` ranks (torchrun and
    ``zero3d launch`` set it); tp is the mesh's fastest axis, so they hold LOCAL_WORLD_SIZE / tp
    consecutive members of each shard group."""
    local, tp = os.environ.get("LOCAL_WORLD_SIZE", ""), cfg.tensor_parallel.size
    if not cfg.zero_optimization.zero_quantized_gradients or not local.isdigit() or int(local) % tp:
        return 0
    return int(local) // tp

"""``parallel3d.initialize``: validate the config, build the mesh, shard the model, return an engine.

The order matters and is fixed: (1) validate everything that can be validated without
talking to other ranks, so a bad config fails the same way on every rank before any
collective; (2) build the pp x dp x tp mesh; (3) cast the model to its working precision;
(4) with tp > 1, replace the model's projections by tensor-parallel layers holding this
rank's shards; (5) hand the trainable parameters to ZeRO over the dp group (stage 3 also
gets the model's repeated blocks as fetch units; tp-split params are marked for the norm).
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from models import fetch_unit_modules
from parallel3d.config import Zero3DConfig, load_config
from parallel3d.engine import Engine
from parallel3d.errors import ConfigError
from parallel3d.lr_schedules import build_lr_scheduler
from parallel3d.mesh import build_mesh, default_device, ensure_process_group
from parallel3d.meta_init import (
    buffer_values,
    detach_from_meta,
    load_in_place,
    on_meta,
    pretrained_source,
    take_source,
    value_provider,
)
from parallel3d.pipeline.stage import PipelineModel, split_model
from parallel3d.pipeline_engine import PipelineEngine
from parallel3d.tensor_parallel import apply_tensor_parallel, causal_lm_loss
from zero import DynamicLossScaler, LossScaler, ZeroOptimizer, ZeroSettings

logger = logging.getLogger(__name__)

_TORCH_OPTIMIZERS = {"Adam": torch.optim.Adam, "AdamW": torch.optim.AdamW, "SGD": torch.optim.SGD}


def _working_dtype(cfg: Zero3DConfig) -> torch.dtype:
    if cfg.bf16.enabled:
        return torch.bfloat16
    if cfg.fp16.enabled:
        return torch.float16
    return torch.float32


def _loss_scaler(cfg: Zero3DConfig) -> LossScaler:
    fp16 = cfg.fp16
    if not fp16.enabled:
        return LossScaler(1.0)
    if fp16.loss_scale:
        return LossScaler(fp16.loss_scale)
    return DynamicLossScaler(
        initial_scale_power=fp16.initial_scale_power,
        loss_scale_window=fp16.loss_scale_window,
        hysteresis=fp16.hysteresis,
        consecutive_hysteresis=fp16.consecutive_hysteresis,
        min_loss_scale=fp16.min_loss_scale,
    )


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
    """How to build the inner optimizer over master shards: from the argument or the config."""
    if optimizer is not None and cfg.optimizer is not None:
        raise ConfigError("an optimizer was passed to initialize() and the config has an 'optimizer' section; give one")
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
        raise ConfigError("no optimizer: add an 'optimizer' section to the config (type Adam, AdamW or SGD) or pass optimizer=")
    cls = _TORCH_OPTIMIZERS[cfg.optimizer.torch_optimizer_class_name()]
    kwargs = cfg.optimizer.torch_optimizer_kwargs()
    return lambda inner_groups: cls(inner_groups, **kwargs)


def _rebind_optimizer(optimizer: torch.optim.Optimizer, inner_groups: list[dict]) -> torch.optim.Optimizer:
    """Point a client optimizer's groups at the master shards (its state starts empty)."""
    optimizer.param_groups = []
    optimizer.state.clear()
    for group in inner_groups:
        optimizer.add_param_group(group)
    return optimizer


def _check_optimizer_options(factory: Callable, groups: list[dict]) -> None:
    """Build the optimizer once over stand-in params, so bad options stop before any collective."""
    stand_ins = [dict(g, params=[torch.zeros(1, requires_grad=True)]) for g in groups]
    try:
        factory(stand_ins)
    except (ValueError, TypeError, KeyError) as exc:
        raise ConfigError(f"optimizer options are invalid: {exc}") from None


def _split_for_pipeline(model: nn.Module, cfg: Zero3DConfig, mesh, tp_info) -> PipelineModel:
    """Keep this pp rank's chunks of ``model`` (the rest is removed from it).

    Under tensor parallelism the last stage's head yields vocabulary-sharded logits, so its
    loss is the vocab-parallel cross entropy over the tp group.
    """
    p = cfg.pipeline
    loss_fn = None
    if tp_info is not None:
        loss_fn = functools.partial(
            _tp_causal_lm_loss, group=tp_info.group, vocab_start=tp_info.head.vocab_start, vocab_size=tp_info.vocab_size
        )
    return split_model(
        model,
        mesh.pp,
        mesh.local_rank("pp"),
        virtual_stages=p.virtual_stages,
        partition=p.partition,
        balance=p.balance,
        activation_checkpointing=p.activation_checkpointing,
        loss_fn=loss_fn,
    )


def _tp_causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, *, group, vocab_start: int, vocab_size: int):
    return causal_lm_loss(logits, labels, group, vocab_start=vocab_start, vocab_size=vocab_size)


def _stage_groups(pipe: PipelineModel, groups: list[dict], group_names: list[list[str]]) -> list[dict]:
    """The user's param groups restricted to this stage's params (a tied copy joins its original's group)."""
    group_of = {n: gi for gi, names in enumerate(group_names) for n in names}
    for tied in pipe.tied:
        owner = next((group_of[n] for n in tied.names if n in group_of), None)
        for n in tied.names:
            if owner is not None:
                group_of.setdefault(n, owner)
    staged: list[list[nn.Parameter]] = [[] for _ in groups]
    for name, param in pipe.hf_named_parameters():
        if name in group_of and param.requires_grad:
            staged[group_of[name]].append(param)
    return [dict(g, params=ps) for g, ps in zip(groups, staged) if ps]


def _meta_values(source, model: nn.Module, tp_info, trainable: set[int], dtype: torch.dtype):
    """ZeRO's value provider for a meta model; frozen params are filled in the same read, whole.

    One read only: a replay of eager init draws the whole model's random numbers each time.
    """
    specs = tp_info.shard_specs if tp_info is not None else {}
    rank, world = (tp_info.tp_rank, tp_info.tp_size) if tp_info is not None else (0, 1)
    provide = value_provider(source, list(model.named_parameters()), specs, rank, world)
    frozen = {p: torch.empty(p.numel()) for p in model.parameters() if id(p) not in trainable}

    def provide_with_frozen(wanted) -> None:
        provide({**wanted, **{p: (0, p.numel(), flat) for p, flat in frozen.items()}})
        for param, flat in frozen.items():
            kind = dtype if param.is_floating_point() else param.dtype
            param.data = flat.view(param.shape).to(device=param.device, dtype=kind)

    return provide_with_frozen


def _lr_scheduler(cfg: Zero3DConfig, lr_scheduler: Any, optimizer: ZeroOptimizer):
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
        training_data, batch_size=cfg.train_micro_batch_size_per_gpu, sampler=sampler, collate_fn=collate_fn
    )


def initialize(
    model: nn.Module,
    config: Any,
    model_parameters: Iterable | None = None,
    optimizer: Any = None,
    lr_scheduler: Any = None,
    training_data: Any = None,
    collate_fn: Callable | None = None,
    device: torch.device | str | None = None,
    pretrained: str | os.PathLike | None = None,
):
    """Build a training engine for ``model`` from ``config`` (DeepSpeed JSON/YAML path or dict).

    Returns ``(engine, optimizer, dataloader, lr_scheduler)`` like ``deepspeed.initialize``;
    the dataloader is None without ``training_data``, the scheduler None without one.
    Launch under torchrun (any world size) or as a plain single process.

    ``model`` may be built on the meta device (``with torch.device("meta"): ...``): each rank
    then fills in only what it holds, with the values eager construction under the same seed
    gives, or with ``pretrained`` weights: a Hugging Face directory (``model.safetensors`` or
    shards with ``model.safetensors.index.json``) of which each rank reads only its slices.
    """
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    device = torch.device(device) if device is not None else default_device()
    ensure_process_group(device)
    world = dist.get_world_size() if dist.is_initialized() else 1
    cfg = load_config(config, world)
    if isinstance(optimizer, torch.optim.Optimizer) and model_parameters is None:
        model_parameters = optimizer.param_groups  # a client optimizer names its params
    groups = _param_groups(model, model_parameters)
    names = {p: n for n, p in model.named_parameters()}
    group_names = [[names[p] for p in g["params"]] for g in groups]
    factory = _optimizer_factory(cfg, optimizer, groups)
    if not isinstance(optimizer, torch.optim.Optimizer):
        _check_optimizer_options(factory, groups)
    if lr_scheduler is not None and cfg.scheduler is not None:
        raise ConfigError("an lr_scheduler was passed to initialize() and the config has a 'scheduler' section; give one")
    weights = pretrained_source(pretrained, model) if pretrained is not None else None
    source = None  # where a meta model's parameters come from
    if on_meta(model):
        replay = take_source(model)  # before anything changes the model
        source = weights or replay
        detach_from_meta(model, buffer_values(replay, source), device)
    elif weights is not None:
        load_in_place(model, weights)
    mesh = build_mesh(cfg.tensor_parallel.size, cfg.pipeline.stages, device)
    dtype = _working_dtype(cfg)
    if source is None:
        model.to(device)
    # Order (torchtitan's): tensor parallelism first, on full-precision weights, then ZeRO
    # shards each tp rank's pieces over its dp group.
    tp_info = pipe = None
    if mesh.tp > 1:
        tp_info = apply_tensor_parallel(model, mesh.group("tp"), sequence_parallel=cfg.tensor_parallel.sequence_parallel)
        by_name = dict(model.named_parameters())
        groups = [dict(g, params=[by_name[n] for n in ns]) for g, ns in zip(groups, group_names)]
    if mesh.pp > 1:
        pipe = _split_for_pipeline(model, cfg, mesh, tp_info)
        groups = _stage_groups(pipe, groups, group_names)
    trainable = {id(p) for g in groups for p in g["params"]}
    for p in model.parameters():
        if id(p) not in trainable and p.is_floating_point() and source is None:
            p.data = p.data.to(dtype)
    values = None
    if source is not None:
        values = _meta_values(source, model, tp_info, trainable, dtype)
    z = cfg.zero_optimization
    settings = ZeroSettings(
        stage=z.stage,
        overlap_comm=z.overlap_comm,
        reduce_bucket_size=z.reduce_bucket_size,
        prefetch_bucket_size=z.stage3_prefetch_bucket_size,
        param_persistence_threshold=z.stage3_param_persistence_threshold,
        max_live_parameters=z.stage3_max_live_parameters,
        gradient_clipping=cfg.gradient_clipping,
        defer_reduction=pipe is not None,
    )
    zero_opt = ZeroOptimizer(
        groups,
        factory,
        mesh.dp_group,
        settings,
        dtype=dtype,
        loss_scaler=_loss_scaler(cfg),
        fetch_modules=fetch_unit_modules(model) if z.stage == 3 else (),
        model_parallel_params=tp_info.sharded_params if tp_info else (),
        model_parallel_group=mesh.group("tp") if tp_info else None,
        norm_groups=[mesh.group("pp")] if pipe else (),
        norm_duplicate_params=[t.param for t in pipe.tied if not t.first] if pipe else (),
        param_order=list(model.parameters()),
        initial_values=values,
    )
    scheduler = _lr_scheduler(cfg, lr_scheduler, zero_opt)
    if pipe is not None:
        engine = PipelineEngine(model, cfg, mesh, zero_opt, scheduler, pipe, tp_info=tp_info)
    else:
        engine = Engine(model, cfg, mesh, zero_opt, scheduler, tp_info=tp_info)
    return engine, zero_opt, _dataloader(cfg, mesh, training_data, collate_fn), scheduler

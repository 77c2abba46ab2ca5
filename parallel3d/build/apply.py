"""The three steps of ``initialize`` that change the model, in their fixed order.

``apply_ep`` -> ``apply_tp`` -> ``apply_pipeline`` -> ``apply_zero`` (torchtitan's order: experts cut
to this rank's share, tensor parallelism on full-precision weights, then the pipeline keeps this pp rank's chunks, then ZeRO shards
each rank's pieces over its dp group). Each takes the model as the previous step left it (real
or storage-less: see parallel3d/build/meta_init.py), its config section and the mesh, and returns a
small record (or None when its dimension is 1). Parameter groups travel by name until ZeRO
takes them, so no step has to re-map parameter objects that an earlier one replaced.
"""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable

import torch
from torch import nn

from models import fetch_unit_modules
from parallel3d.config.config import Zero3DConfig
from parallel3d.config.sections import PipelineConfig, TensorParallelConfig, ZeroConfig
from parallel3d.expert_parallel import ExpertParallelInfo, apply_expert_parallel
from parallel3d.runtime.mesh import ParallelMesh
from parallel3d.build.meta_init import value_provider
from parallel3d.pipeline.schedules import has_weight_pass
from parallel3d.pipeline.stage import PipelineModel, split_model
from parallel3d.tensor_parallel import TensorParallelInfo, apply_tensor_parallel, causal_lm_loss
from parallel3d.tensor_parallel.sequence import sequence_segment_hooks
from zero import DynamicLossScaler, LossScaler, ZeroOptimizer, ZeroSettings
from zero.inputs import FetchModules, GradSyncSets, NormShares
from zero.offload import OffloadSettings
from zero.partition import stage3_fetch_modules, standalone_head


def apply_ep(model: nn.Module, mesh: ParallelMesh) -> ExpertParallelInfo | None:
    """Keep this rank's experts of each MoE layer and route tokens to them (``expert_parallel``)."""
    return apply_expert_parallel(model, mesh.ep, mesh.groups.ep, mesh.groups.expert_shard)


def apply_tp(model: nn.Module, section: TensorParallelConfig, mesh: ParallelMesh,
             ep_info: ExpertParallelInfo | None = None, expert_tp: int = 1) -> TensorParallelInfo | None:
    """Replace the model's projections, embedding and head by tensor-parallel layers (tp > 1). Experts
    that expert parallelism split stay whole at ``expert_tp`` 1 (``expert_tensor_parallel_size``); at
    ``expert_tp`` = tp each rank keeps its tensor-parallel slice of its experts, as without expert
    parallelism (docs/expert_parallel.md)."""
    if mesh.tp == 1:
        return None
    # under pipeline stages each chunk is its own sequence-parallel run (apply_pipeline)
    whole = frozenset(m.name for m in ep_info.modules) if ep_info is not None and expert_tp == 1 else frozenset()
    info = apply_tensor_parallel(model, mesh.groups.tp, sequence_parallel=section.sequence_parallel,
                                 sequence_segments=mesh.pp == 1, whole=whole)
    if ep_info is not None:
        ep_info.take_params(model)
    return info


def apply_pipeline(model: nn.Module, section: PipelineConfig, mesh: ParallelMesh,
                   tp_info: TensorParallelInfo | None) -> PipelineModel | None:
    """Keep this pp rank's chunks of ``model`` (pp > 1); the rest is removed from it.

    Under tensor parallelism the last stage's head yields vocabulary-sharded logits, so its
    loss is the vocab-parallel cross entropy over the tp group.
    """
    if mesh.pp == 1:
        return None
    loss_fn = None
    if tp_info is not None:
        loss_fn = functools.partial(
            _tp_causal_lm_loss, group=tp_info.group, vocab_start=tp_info.head.vocab_start, vocab_size=tp_info.vocab_size
        )
    pipe = split_model(
        model,
        mesh.pp,
        mesh.local_rank("pp"),
        virtual_stages=section.virtual_stages,
        partition=section.partition,
        balance=section.balance,
        activation_checkpointing=section.activation_checkpointing,
        loss_fn=loss_fn,
    )
    # The removed chunks' modules sit in reference cycles (a module and its hooks, HF's
    # attention back-references): without a collection they, and under tp their weight shards,
    # stay resident until Python's cyclic GC happens to run (3 MiB of a 20 MiB stage measured
    # in docs/planner.md's eager pp 2 x tp 2 rows).
    gc.collect()
    if tp_info is not None:
        tp_info.keep_held(model)
        if tp_info.sequence_parallel:
            # the sequence is split inside each chunk and whole between stages, so every stage's
            # program builds its masks and positions from the full sequence, as without tp
            tp_info.hooks += [h for chunk in pipe.chunks if len(chunk.layers)
                              for h in sequence_segment_hooks(chunk.layers[0], chunk.layers[-1], tp_info.group,
                                                              tp_info.rng)]
    return pipe


def apply_zero(
    model: nn.Module,
    cfg: Zero3DConfig,
    mesh: ParallelMesh,
    named_groups: list[dict],
    optimizer_factory: Callable,
    tp_info: TensorParallelInfo | None,
    pipe: PipelineModel | None,
    source=None,
    ep_info: ExpertParallelInfo | None = None,
) -> ZeroOptimizer:
    """Hand this rank's trainable params to ZeRO over the dp group (``cfg.zero_optimization``).

    ``named_groups`` are torch-style param groups whose ``params`` are HF names; the model's other
    floating-point params are ZeRO's frozen params (sharded like the trained ones at stage 3,
    with no gradient, master or optimizer state). With a ``source`` (a meta model) ZeRO fills
    its buffers from it, each rank reading its part; otherwise ZeRO takes current values.
    """
    groups = _stage_groups(pipe, named_groups) if pipe is not None else _model_groups(model, named_groups)
    dtype = _working_dtype(cfg)
    trainable = {id(p) for g in groups for p in g["params"]}
    untrained = [p for p in model.parameters() if id(p) not in trainable]
    frozen = [p for p in untrained if p.is_floating_point()]  # ZeRO lays them out (and shards them at stage 3)
    values = None
    if source is not None:
        values = _meta_values(source, model, tp_info, [p for p in untrained if not p.is_floating_point()], ep_info)
    _cast_buffers(model, cfg.data_types.buffer_dtype)
    z = cfg.zero_optimization
    settings = ZeroSettings(
        stage=z.stage,
        overlap_comm=z.overlap_comm,
        reduce_bucket_size=z.reduce_bucket_size,
        prefetch_bucket_size=z.stage3_prefetch_bucket_size,
        param_persistence_threshold=z.stage3_param_persistence_threshold,
        max_live_parameters=z.stage3_max_live_parameters,
        gradient_clipping=cfg.gradient_clipping,
        windowed=pipe is not None,
        keep_full_gradients=cfg.pipeline.keep_full_gradients,
        check_overflow=not (cfg.bf16.enabled and not cfg.bf16.check_grad_overflow),
        gradient_sum=cfg.gradient_allreduce_op == "sum",
        data_parallel_size=mesh.dp,
        offload=_offload_settings(z),
        ignore_unused_parameters=z.ignore_unused_parameters,
        quantized_weights=z.zero_quantized_weights,
        quantized_gradients=z.zero_quantized_gradients,
    )
    blocks = fetch_unit_modules(model) if z.stage == 3 else []
    heads = standalone_head(model, blocks) if z.stage == 3 and blocks else []
    fetch = FetchModules(modules=stage3_fetch_modules(model, blocks) if z.stage == 3 else (), held_to_backward=heads,
                         release_early=_heads_released_early(heads, pipe, cfg.pipeline.schedule))
    return ZeroOptimizer(
        groups,
        optimizer_factory,
        mesh.groups,
        settings,
        dtype=dtype,
        loss_scaler=_loss_scaler(cfg),
        fetch=fetch,
        norm=NormShares(split=tp_info.sharded_params if tp_info else (),
                        counted_elsewhere=_norm_duplicates(pipe, tp_info)),
        sync=_sync_sets(pipe),
        param_order=list(model.parameters()),
        initial_values=values,
        param_names={p: n for n, p in (pipe.hf_named_parameters() if pipe else model.named_parameters())},
        frozen_params=frozen,
        expert_params=list(ep_info.params.values()) if ep_info else (),
    )


def _sync_sets(pipe: PipelineModel | None) -> GradSyncSets:
    """ZeRO's gradient-sync sets: one per pipeline chunk of this rank, by the chunk's index (the
    schedule's backward passes name it; ``PipelineLoop``), and the tied copies summed across stages."""
    if pipe is None:
        return GradSyncSets()
    return GradSyncSets(set_of={p: ci for ci, chunk in enumerate(pipe.chunks) for p in chunk.parameters()},
                        tied_elsewhere=[t.param for t in pipe.tied])


def _heads_released_early(heads: list[nn.Module], pipe: PipelineModel | None, schedule: str) -> list[nn.Module]:
    """The stage-3 heads whose backward frees the gathered weight before its gradient (``zero.head``):
    not a tied copy on the last pipeline stage (its gradient is summed across stages at the end of
    the step) and not under a schedule with a W pass (``zb_h1``), whose input-gradient pass cannot
    tell the head that the weight's gradient comes in a later pass."""
    if pipe is None:
        return heads
    if has_weight_pass(schedule):
        return []
    tied = {id(t.param) for t in pipe.tied}
    return [h for h in heads if not any(id(p) in tied for p in h.parameters())]


def _offload_settings(z: ZeroConfig) -> OffloadSettings:
    """``offload_optimizer`` / ``offload_param`` with device cpu, as ZeRO's settings."""
    return OffloadSettings(optimizer=z.offloads_optimizer, params=z.offloads_params,
                           pin_optimizer=z.offload_optimizer is None or z.offload_optimizer.pin_memory,
                           pin_params=z.offload_param is None or z.offload_param.pin_memory)


def _cast_buffers(model: nn.Module, name: str | None) -> None:
    """``data_types.buffer_dtype``: floating-point buffers in that dtype (unset: as they are)."""
    if name is None:
        return
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[name]
    for buffer in model.buffers():
        if buffer.is_floating_point():
            buffer.data = buffer.data.to(dtype)


def _norm_duplicates(pipe: PipelineModel | None, tp_info: TensorParallelInfo | None) -> list[nn.Parameter]:
    """Params another rank's gradient norm already counts: a tied copy on a later pipeline stage,
    a kv-head shard that a lower tp rank also holds."""
    tied = [t.param for t in pipe.tied if not t.first] if pipe is not None else []
    return tied + list(tp_info.norm_duplicate_params if tp_info is not None else ())


def _model_groups(model: nn.Module, named_groups: list[dict]) -> list[dict]:
    by_name = dict(model.named_parameters())
    return [dict(g, params=[by_name[n] for n in g["params"]]) for g in named_groups]


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


def _tp_causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, *, group, vocab_start: int, vocab_size: int,
                       num_items_in_batch: torch.Tensor | int | None = None, shift_labels: torch.Tensor | None = None):
    return causal_lm_loss(logits, labels, group, vocab_start=vocab_start, vocab_size=vocab_size,
                          num_items_in_batch=num_items_in_batch, shift_labels=shift_labels)


def _stage_groups(pipe: PipelineModel, named_groups: list[dict]) -> list[dict]:
    """The user's param groups restricted to this stage's params (a tied copy joins its original's group).

    A group with no parameter on this stage stays, empty: every rank then has the user's
    groups in the user's order, so an LR schedule's per-group values and a checkpoint's
    per-group options mean the same group on every stage.
    """
    group_of = {n: gi for gi, g in enumerate(named_groups) for n in g["params"]}
    for tied in pipe.tied:
        owner = next((group_of[n] for n in tied.names if n in group_of), None)
        for n in tied.names:
            if owner is not None:
                group_of.setdefault(n, owner)
    staged: list[list[nn.Parameter]] = [[] for _ in named_groups]
    for name, param in pipe.hf_named_parameters():
        if name in group_of and param.requires_grad:
            staged[group_of[name]].append(param)
    return [dict(g, params=ps) for g, ps in zip(named_groups, staged)]


def _meta_values(source, model: nn.Module, tp_info, whole: list[nn.Parameter], ep_info: ExpertParallelInfo | None):
    """ZeRO's value provider for a meta model; ``whole`` (params ZeRO does not hold: integer ones)
    are filled in the same read, whole. Expert weights are read from this rank's experts' rows.

    One read only: a replay of eager init draws the whole model's random numbers each time.
    """
    specs = tp_info.shard_specs if tp_info is not None else {}
    rank, world = (tp_info.tp_rank, tp_info.tp_size) if tp_info is not None else (0, 1)
    first_rows = ep_info.first_experts() if ep_info is not None else None
    provide = value_provider(source, list(model.named_parameters()), specs, rank, world, first_rows)
    outside = {p: torch.empty(p.numel(), dtype=p.dtype) for p in whole}

    def provide_with_outside(wanted) -> None:
        provide({**wanted, **{p: (0, p.numel(), flat) for p, flat in outside.items()}})
        for param, flat in outside.items():
            param.data = flat.view(param.shape).to(device=param.device)

    return provide_with_outside

"""Which parameters each rank hands to ZeRO, in ZeRO's order, for a pp x dp x tp layout.

``initialize`` gives ZeRO this rank's trainable parameters after tensor parallelism and the
pipeline split: in the model's order without pipeline stages (``apply._model_groups``), else in
the order of the rank's chunks (each chunk: its blocks, then the embedding on global stage 0,
then norm and head on the last; ``apply._stage_groups``). ``ZeroOptimizer`` then splits the
group by (split over tp?, counted by another rank's norm?), then by pipeline chunk with a tied
copy on its own, and stage 3 groups by fetch module
(the rank's blocks). This module reproduces that list from a meta model, for any rank, without
a process group: tensor-parallel shapes from the engine's ``apply_tensor_parallel`` on a fake
process group (``planner.fake_tp``), stage contents from
``pipeline.stage.make_layout`` (the same partition, on the tp-local sizes, since ``apply_tp``
runs first). The planner's test holds the result to ``memory_report()``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import nn

from models.anatomy import fetch_unit_modules
from models.pipeline_anatomy import AnatomyError, AnatomyPaths, PipelineAnatomy, anatomy_paths, pipeline_anatomy
from parallel3d.errors import ConfigError
from parallel3d.expert_parallel.plan import resolve_experts
from parallel3d.build.meta_init import detach_from_meta
from parallel3d.pipeline.stage import StageLayout, make_layout
from parallel3d.planner.fake_tp import fake_tp_group
from parallel3d.tensor_parallel.apply import apply_tensor_parallel
from zero.partition import embedding_tables, output_head, standalone_embeddings, standalone_head


@dataclass(frozen=True)
class Param:
    """One parameter as a tp rank holds it."""

    name: str
    numel: int
    sharded: bool  # split over tp (its gradient norm is summed over tp)
    replicas: int  # consecutive tp ranks holding the same shard (replicated kv heads)
    block: int | None  # index of the block (stage-3 fetch module) holding it
    expert: bool = False  # a routed expert's stacked weight split by expert parallelism (its 1/ep counted)


@dataclass(frozen=True, eq=False)
class RankParams:
    """What ZeRO gets on one rank: kind groups in ZeroOptimizer's order and the fetch modules in
    ``zero.partition.stage3_fetch_modules``' order: ``embeddings`` tables first (gathered for their
    forward only), the blocks, then ``heads`` heads (kept from their forward to their backward)."""

    groups: tuple[tuple[Param, ...], ...]
    fetch_modules: tuple[tuple[Param, ...], ...]
    embeddings: int = 0
    heads: int = 0
    ep: int = 1  # expert parallelism: the expert params' units shard over dp / ep ranks (``states.shard_sets``)

    @property
    def numel(self) -> int:
        return sum(p.numel for g in self.groups for p in g)


def pipeline_split(model: nn.Module) -> tuple[PipelineAnatomy | AnatomyPaths | None, str | None]:
    """Where a pipeline splits ``model`` (its anatomy: paths and programs, nothing of the copy it was
    read from) or why it cannot (None and the reason): the same at every tp, ep and etp."""
    try:
        return _checked_anatomy(model), None
    except AnatomyError as exc:
        refusal = str(exc)
        return None, refusal if refusal.startswith("pipeline parallelism") else f"pipeline parallelism: {refusal}"


def _checked_anatomy(model: nn.Module) -> PipelineAnatomy | AnatomyPaths:
    """``split_model``'s checks (its cut of the forward run on a probe included) on a copy of
    ``model`` (one copy: a 7B meta model's takes a fifth of a second), whose meta tensors are made CPU
    ones that read as shapes: buffers zeros, parameters storage-less (the probe runs no block and
    reads no weight); where that cannot be, the structure alone is checked, which reads ``model``."""
    probe = copy.deepcopy(model)
    if not any(t.is_meta for t in (*probe.parameters(), *probe.buffers())):
        return pipeline_anatomy(probe)
    buffers = ((n, torch.zeros(b.shape, dtype=b.dtype)) for n, b in probe.named_buffers(remove_duplicate=False))
    try:
        detach_from_meta(probe, buffers, torch.device("cpu"))
    except ConfigError:  # a meta tensor outside params and buffers: the structure alone is checked
        return anatomy_paths(model)
    return pipeline_anatomy(probe)


def _keep_share(module: nn.Module, local: int) -> list[str]:
    """Cut an experts module's stacked weights to ``local`` experts, as ``split_experts`` does on a
    rank (a view: only the shapes matter), before tensor parallelism and the pipeline split see them;
    the names of the weights cut (tensor parallelism may replace them by its slices, under the same names)."""
    kept = []
    for name, param in list(module.named_parameters(recurse=False)):
        setattr(module, name, nn.Parameter(param.data[:local], requires_grad=param.requires_grad))
        kept.append(name)
    return kept


class ModelShapes:
    """The parameters of one model at tensor-parallel size ``tp`` and expert-parallel size ``ep`` (the
    model is copied, not changed).

    Under expert parallelism (``ep > 1``) the experts modules ``base_model_ep_plan`` names hold
    ``1/ep`` of their stacked weights on a rank (``expert_parallel.experts.split_experts``; so the
    pipeline's partition by parameters sees that share, as ``apply_pipeline`` after ``apply_ep``
    does) and are flagged ``expert``: ZeRO gives them units of their own, sharded over the
    expert-shard group. Under tensor parallelism they stay whole at ``etp`` 1
    (``expert_tensor_parallel_size``; ``apply.apply_tp``'s ``whole``); at ``etp`` = tp the tp plan
    splits them as it does without expert parallelism (``sharded``: ``1/(ep x tp)`` of each).
    """

    def __init__(self, model: nn.Module, tp: int, sequence_parallel: bool = False, ep: int = 1,
                 etp: int = 1, split: tuple[PipelineAnatomy | AnatomyPaths | None, str | None] | None = None) -> None:
        """``split``: :func:`pipeline_split` of ``model``, if known (a planner reads it once for every tp)."""
        if etp not in (1, tp):
            raise ConfigError(f"expert_parallel.expert_tensor_parallel_size {etp} with tensor_parallel.size {tp}: "
                              f"allowed: 1 or {tp}")
        # on the whole model: tensor parallelism keeps every module's name, and its hooks hold the
        # group, which the probe's copy could not copy
        self.paths, self.pipeline_refusal = split if split is not None else pipeline_split(model)
        local = copy.deepcopy(model)
        self.tp, self.ep, self.etp = tp, ep, etp
        experts = resolve_experts(local, ep) if ep > 1 else []
        expert_names = {f"{m.name}.{name}" for m in experts
                        for name in _keep_share(local.get_submodule(m.name), m.num_experts // ep)}
        with fake_tp_group(tp) as group:
            specs = {} if group is None else apply_tensor_parallel(
                local, group, sequence_parallel=sequence_parallel,
                whole=frozenset(m.name for m in experts) if etp == 1 else frozenset()).shard_specs
        blocks = fetch_unit_modules(local)
        block_of = {id(p): i for i, b in enumerate(blocks) for p in b.parameters()}
        self.params: list[Param] = []
        self._by_id: dict[int, Param] = {}
        for name, p in local.named_parameters():
            if not p.requires_grad:
                continue
            spec = specs.get(name)
            expert = name in expert_names
            param = Param(name, p.numel(), spec is not None,
                          spec.replicas if spec else 1, block_of.get(id(p)), expert)
            self._by_id[id(p)] = param
            self.params.append(param)
        self.block_params = [[self._by_id[id(p)] for p in b.parameters() if id(p) in self._by_id] for b in blocks]
        # ZeroOptimizer's stage-3 tables and head outside the blocks (zero.partition):
        # (params, tied to another module: then a fetch module only as a pipeline stage's copy)
        head = output_head(local, blocks) if blocks else None
        tables = embedding_tables(local, blocks) if blocks else []
        alone = {id(m) for m in standalone_embeddings(local, blocks) + standalone_head(local, blocks)}

        def own(module: nn.Module) -> tuple[list[Param], bool]:
            return [self._by_id[id(p)] for p in module.parameters() if id(p) in self._by_id], id(module) not in alone

        self.embeddings = [own(m) for m in tables]
        self.heads = [own(head)] if head is not None else []
        self.first = [self._by_id[id(p)] for path in (self.paths.first.values() if self.paths else ())
                      for p in local.get_submodule(path).parameters() if id(p) in self._by_id]
        self.last = [self._by_id[id(p)] for path in (self.paths.last.values() if self.paths else ())
                     for p in local.get_submodule(path).parameters() if id(p) in self._by_id]
        self._local = local
        self._layouts: dict[tuple, StageLayout] = {}
        self._ranks: dict[tuple, RankParams] = {}

    @cached_property
    def total(self) -> int:
        return sum(p.numel for p in self.params)

    @cached_property
    def tied_numel(self) -> int:
        """Elements of parameters held by both the first and the last stage (a tied embedding)."""
        first = {p.name for p in self.first}
        return sum(p.numel for p in self.last if p.name in first)

    def stage_layout(self, pp: int, virtual_stages: int = 1, partition: tuple[int, ...] | None = None,
                     balance: str = "parameters") -> StageLayout:
        """The blocks of every global stage, as ``split_model`` decides them on this tp size."""
        if self.paths is None:
            raise ConfigError(self.pipeline_refusal)
        key = (pp, virtual_stages, partition, balance)
        if key not in self._layouts:
            self._layouts[key] = make_layout(self._local, self.paths, pp, virtual_stages,
                                             list(partition) if partition else None, balance)
        return self._layouts[key]

    def rank_params(self, *, tp_rank: int = 0, pp: int = 1, pp_rank: int = 0, layout: StageLayout | None = None,
                    stage3: bool = False) -> RankParams:
        """ZeRO's input on the rank at (pp_rank, tp_rank): ``layout`` from :meth:`stage_layout` when pp > 1."""
        key = (tp_rank, pp, pp_rank, layout, stage3)
        if key not in self._ranks:
            self._ranks[key] = self._rank_params(tp_rank, pp, pp_rank, layout, stage3)
        return self._ranks[key]

    def _rank_params(self, tp_rank: int, pp: int, pp_rank: int, layout: StageLayout | None,
                     stage3: bool) -> RankParams:
        chunk_of: dict[str, int] = {}
        tied: set[str] = set()
        if pp == 1:
            ordered = list(self.params)
            blocks = list(range(len(self.block_params)))
            duplicates: set[str] = set()
        else:
            ordered, blocks, duplicates, chunk_of, tied = self._stage_params(layout, pp_rank)
        duplicates |= {p.name for p in ordered if p.replicas > 1 and tp_rank % p.replicas}
        groups = []
        for kind in ((False, False), (True, False), (False, True), (True, True)):
            # ZeroOptimizer's unit boundaries: never across chunks, a tied copy on its own, experts apart
            parts: dict[tuple, list[Param]] = {}
            for p in ordered:
                if (p.sharded, p.name in duplicates) == kind:
                    key = (chunk_of.get(p.name, 0), p.name if p.name in tied else None, p.expert)
                    parts.setdefault(key, []).append(p)
            groups += [tuple(part) for part in parts.values()]
        if not stage3:
            return RankParams(tuple(groups), (), ep=self.ep)
        # a tied table and head are each their stage's own parameter when pp > 1
        held = {p.name for p in ordered}

        def mine(modules: list[tuple[list[Param], bool]]) -> tuple[tuple[Param, ...], ...]:
            return tuple(tuple(ps) for ps, tied in modules if ps and all(p.name in held for p in ps)
                         and (pp > 1 or not tied))

        tables, heads = mine(self.embeddings), mine(self.heads)
        modules = tables + tuple(tuple(self.block_params[b]) for b in blocks) + heads
        return RankParams(tuple(groups), modules, len(tables), len(heads), self.ep)

    def _stage_params(self, layout: StageLayout,
                      rank: int) -> tuple[list[Param], list[int], set[str], dict[str, int], set[str]]:
        """The rank's parameters in chunk order, its blocks, the tied copies it does not count, each
        parameter's chunk and the tied copies (shared with another pipeline rank)."""
        last = layout.total_stages - 1
        stages = [layout.stage_of(rank, c) for c in range(layout.virtual_stages)]
        ordered: list[Param] = []
        chunk_of: dict[str, int] = {}
        for chunk, stage in enumerate(stages):
            held = [p for b in layout.block_range(stage) for p in self.block_params[b]]
            held += self.first if stage == 0 else []
            held += self.last if stage == last else []
            ordered += held
            chunk_of.update((p.name, chunk) for p in held)
        seen: set[str] = set()
        ordered = [p for p in ordered if not (p.name in seen or seen.add(p.name))]
        blocks = sorted(b for s in stages for b in layout.block_range(s))
        holders = {0: layout.rank_of(0), last: layout.rank_of(last)}
        duplicates: set[str] = set()
        tied: set[str] = set()
        if holders[0] != holders[last] and rank in holders.values():
            tied = {p.name for p in self.first} & {p.name for p in self.last}
            if rank == holders[last]:
                duplicates = set(tied)
        return ordered, blocks, duplicates, chunk_of, tied

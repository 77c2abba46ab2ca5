"""Expert parallelism for Hugging Face MoE models (docs/expert_parallel.md).

``apply_expert_parallel`` cuts each experts module that ``base_model_ep_plan`` names to this
rank's share of its experts and routes tokens to them by all-to-all over the mesh's ``ep`` group;
ZeRO then shards those parameters over ``expert_shard`` (the ranks holding the same experts).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist
from torch import nn

from parallel3d.errors import ConfigError
from parallel3d.expert_parallel.experts import split_experts
from parallel3d.expert_parallel.plan import ExpertsModule, resolve_experts

__all__ = ["ExpertParallelInfo", "ExpertsModule", "apply_expert_parallel", "check_expert_parallel", "resolve_experts"]


@dataclass
class ExpertParallelInfo:
    """What expert parallelism changed on this rank."""

    size: int
    rank: int
    group: dist.ProcessGroup
    """The expert-parallel group (tokens cross it)."""
    shard_group: dist.ProcessGroup
    """The ranks holding the same experts (ZeRO shards expert states over it)."""
    modules: list[ExpertsModule]
    params: dict[str, nn.Parameter] = field(default_factory=dict)
    """This rank's expert parameters by full name ([num_experts / size, ...] of each stacked weight)."""
    experts: dict[str, int] = field(default_factory=dict)
    """The routed-expert count (in one process) of each of ``params``."""

    def first_experts(self) -> dict[str, int]:
        """Where each of ``params`` starts in its full stacked weight (dim 0): a meta start reads from there."""
        return {name: self.rank * (count // self.size) for name, count in self.experts.items()}

    def take_params(self, model: nn.Module) -> None:
        """Point ``params`` at ``model``'s current parameters of those names (expert tensor parallelism
        replaces each by its tensor-parallel slice)."""
        self.params = {name: model.get_parameter(name) for name in self.params}


def check_expert_parallel(model: nn.Module, size: int) -> None:
    """ConfigError, before any collective, when ``model`` cannot be split over ``size`` expert-parallel ranks."""
    if size == 1:
        return
    resolve_experts(model, size)


def apply_expert_parallel(model: nn.Module, size: int, group: dist.ProcessGroup | None,
                          shard_group: dist.ProcessGroup | None) -> ExpertParallelInfo | None:
    """Split the experts of ``model`` over ``group`` (``size`` ranks; None when ``size`` is 1)."""
    if size == 1:
        return None
    modules = resolve_experts(model, size)
    info = ExpertParallelInfo(size, dist.get_rank(group), group, shard_group, modules)
    for experts in modules:
        module = model.get_submodule(experts.name)
        names = [n for n, _ in module.named_parameters(recurse=False)]
        for name, param in zip(names, split_experts(module, experts.num_experts, group)):
            info.params[f"{experts.name}.{name}"] = param
            info.experts[f"{experts.name}.{name}"] = experts.num_experts
    return info

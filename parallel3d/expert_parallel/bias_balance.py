"""DeepSeek V3's auxiliary-loss-free load balancing: each router's expert bias follows the load.

DeepSeek V3 (paper, sec. 2.1.2), GLM-4 MoE, MiniMax-M2, dots1 and others add a per-expert bias,
``e_score_correction_bias``, to the router's scores when choosing experts (not when weighting
them). Hugging Face keeps it as a buffer its forward never changes; in training it is updated
after every step by ``bias += rate * sign(mean_load - load)``, ``load`` being the number of
(token, choice) pairs each expert got over the step's global batch and ``mean_load`` its mean
over the layer's experts: an overloaded expert's bias goes down, an idle one's up.

``expert_parallel.load_balance_coeff`` (DeepSpeed AutoEP's key, torchtitan's name; Megatron's
``moe_router_bias_update_rate``) turns it on. Each experts module's calls are counted (a forward
pre-hook reads ``top_k_index``, the global expert ids, before any dispatch): every micro-batch of
the window, once, when the backward pass reaches that call's routing weights (a gradient hook on
them); a call no backward pass will reach (its inputs and routing weights need no gradient: a frozen
layer below every trained one, PEFT's ``layers_to_transform``) counts when it runs, unless it runs inside
a backward pass (a recomputation). So evaluation (no backward) counts nothing, and under activation checkpointing only the
forward whose graph the backward runs through counts: the first forward without reentrant
checkpointing, the recomputation inside backward with it (its first forward runs under
``no_grad``). At the window's end the counts are
summed over ``dp_cp`` (every data-parallel and context-parallel rank of this pipeline stage and
tp rank, which hold the same routers and see disjoint tokens; tensor-parallel ranks see the same
tokens and each count them alone), so every rank applies the update one process would make from
the whole global batch. Expert parallelism does not enter: the routers run where the tokens are.

Under sequence parallelism each tp rank routes its own part of the sequence. An experts module
split over tp (expert tensor parallelism) gathers the tp ranks' tokens on entry, in a pre-hook
registered before the counting one, so every tp rank counts every token: the ``dp_cp`` sum stays
right. An experts module whole on every tp rank (``expert_tensor_parallel_size`` 1) sees this
rank's part only: its counts are summed over tp as well.

The balancer keeps each bias in float32 and writes it to the buffer after every update: a buffer cast to
bf16 (``data_types.buffer_dtype``, or a model cast whole) cannot hold ``bias + rate`` for any bias over
``256 * rate`` in size (bf16 keeps 8 significant bits), so updating it in place would drop every step.
Checkpoints hold the float32 values. A buffer written since (the model's state loaded by the user) is
taken back into float32 before the next update or save, so the write is not undone.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from parallel3d.errors import ConfigError
from parallel3d.expert_parallel.plan import resolve_experts
from parallel3d.tensor_parallel.apply import TensorParallelInfo

logger = logging.getLogger(__name__)

BIAS = "e_score_correction_bias"
KEY = "expert_parallel.load_balance_coeff"


@dataclass(frozen=True)
class BalancedRouter:
    """One router bias and the experts module whose calls carry that router's choices."""

    name: str
    owner: nn.Module
    experts: nn.Module
    num_experts: int


def balanced_routers(model: nn.Module) -> list[BalancedRouter]:
    """Every ``e_score_correction_bias`` buffer of ``model`` paired with its layer's experts module;
    ConfigError when there is none or a pairing is not one to one."""
    owner_name = type(model).__name__
    params = [n for n, _ in model.named_parameters() if n.rpartition(".")[2] == BIAS]
    if params:
        raise ConfigError(f"{KEY}: {owner_name} holds {params[0]} as a parameter, not a buffer; only a buffer bias is "
                          "updated (a parameter is ZeRO's, sharded at stage 3); remove the key for this model")
    biases = [n for n, _ in model.named_buffers() if n.rpartition(".")[2] == BIAS]
    if not biases:
        model_type = getattr(getattr(model, "config", None), "model_type", "?")
        raise ConfigError(f"{KEY}: {owner_name} (model_type {model_type!r}) has no {BIAS} buffer, so its routers have no "
                          "bias to balance with (DeepSeek V3, GLM-4 MoE, MiniMax-M2, dots1, ... have one); remove the "
                          "key, or use the model's router auxiliary loss (router_aux_loss_coef)")
    try:
        experts = resolve_experts(model, 1)
    except ConfigError as exc:
        raise ConfigError(f"{KEY} needs the experts modules of base_model_ep_plan: {exc}") from None
    found = []
    for name in biases:
        owner = name.rpartition(".")[0]
        layer = [e for e in experts if owner == _parent(e.name) or owner.startswith(_parent(e.name) + ".")]
        if len(layer) != 1:
            raise ConfigError(f"{KEY}: {name} belongs to {len(layer)} experts modules "
                              f"({', '.join(e.name for e in layer) or 'none'}); it must sit in one MoE block")
        bias, module = model.get_buffer(name), model.get_submodule(layer[0].name)
        # cut by expert parallelism: (rank, ranks, experts in one process); the router still picks among all
        count = getattr(module, "expert_parallel", (0, 1, layer[0].num_experts))[2]
        if bias.numel() != count:
            raise ConfigError(f"{KEY}: {name} has {bias.numel()} entries for the {count} experts of {layer[0].name}")
        found.append(BalancedRouter(name, model.get_submodule(owner), module, count))
    return found


def check_bias_balance(model: nn.Module, compiled: bool) -> None:
    """ConfigError, before any collective, when ``load_balance_coeff`` cannot apply to ``model``."""
    if compiled:
        raise ConfigError(f"{KEY} with compile.enabled is not supported: the loads are counted by a hook on each "
                          "experts module, outside what torch.compile traces; turn one of them off")
    balanced_routers(model)


def _parent(name: str) -> str:
    return name.rpartition(".")[0]


def bias_mismatch(shapes: Mapping[str, torch.Size], values: Mapping[str, torch.Tensor]) -> str | None:
    """What in ``values`` (a checkpoint's router biases by name) does not fit the model's biases (``shapes``, by
    name): the first bias whose number of entries differs from the model's, with both shapes; None when all fit.
    The check of the checkpoint loader (this rank's routers) and of ``zero3d export`` (the config's model)."""
    for name, shape in shapes.items():
        saved = values.get(name)
        if saved is not None and saved.numel() != shape.numel():
            return f"the router bias {name} with shape {list(saved.shape)}, this model's is {list(shape)}"
    return None


class ExpertBiasBalancer:
    """Counts each balanced router's expert loads over a window and updates its bias at the window's end."""

    def __init__(self, routers: list[BalancedRouter], rate: float, group: dist.ProcessGroup | None,
                 tp_parts: list[int] = (), tp_group: dist.ProcessGroup | None = None) -> None:
        self.routers, self.rate, self.group = routers, rate, group
        self.tp_parts, self.tp_group = list(tp_parts), tp_group  # routers counting this tp rank's tokens only
        self.loads = [torch.zeros(r.num_experts, dtype=torch.int64) for r in routers]
        # float32 values of the biases, taken before buffer_dtype casts the buffers (see the module's docstring)
        self.biases = [r.owner.get_buffer(BIAS).detach().to(torch.float32, copy=True) for r in routers]
        self._hooks = [r.experts.register_forward_pre_hook(self._counter(i), with_kwargs=True)
                       for i, r in enumerate(routers)]

    @classmethod
    def attach(cls, routers: list[BalancedRouter], kept: Iterable[nn.Module], rate: float,
               group: dist.ProcessGroup | None, tp_info: TensorParallelInfo | None = None) -> ExpertBiasBalancer:
        """A balancer for the ``routers`` whose modules this rank kept (a pipeline stage keeps its layers);
        ``tp_info`` after tensor parallelism split the model (its gathering hooks are registered first)."""
        live = {id(m) for root in kept for m in root.modules()}
        routers = [r for r in routers if id(r.owner) in live and id(r.experts) in live]
        if tp_info is None or not tp_info.sequence_parallel:
            return cls(routers, rate, group)
        parts = [i for i, r in enumerate(routers) if not any(p in tp_info.sharded_params for p in r.experts.parameters())]
        return cls(routers, rate, group, parts, tp_info.group)

    def _counter(self, index: int):
        def count(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if not torch.is_grad_enabled():
                return  # evaluation, or reentrant checkpointing's first forward (counted when recomputed)
            carrier = next((t for t in (args[2] if len(args) > 2 else kwargs.get("top_k_weights"),
                                        args[0] if args else kwargs.get("hidden_states"))
                            if isinstance(t, torch.Tensor) and t.requires_grad), None)
            if carrier is None and torch._C._current_graph_task_id() != -1:
                return  # a recomputation inside backward of a call counted when it first ran (below)
            choices = args[1] if len(args) > 1 else kwargs["top_k_index"]
            experts = self.routers[index].num_experts
            flat = choices.detach().reshape(-1)
            counted = torch.bincount(flat[flat < experts], minlength=experts)  # ids >= E: no expert chosen
            if carrier is None:  # a frozen layer below every trained one: no backward reaches it, count it now
                self._add(index, counted)
            else:
                carrier.register_hook(lambda _grad: self._add(index, counted))

        return count

    def _add(self, index: int, counted: torch.Tensor) -> None:
        self.loads[index] = self.loads[index].to(counted.device) + counted

    def update(self) -> None:
        """The window ended: sum the loads over ``dp_cp`` (and over tp, those counting this tp rank's part of
        the sequence) and move every bias by ``rate * sign(mean - load)``."""
        if not self.routers:
            return
        loads = torch.stack(self.loads)
        if self.group is not None and dist.get_world_size(self.group) > 1:
            dist.all_reduce(loads, group=self.group)
        if self.tp_parts:
            parts = loads[self.tp_parts]
            dist.all_reduce(parts, group=self.tp_group)
            loads[self.tp_parts] = parts
        with torch.no_grad():
            for router, load, value in zip(self.routers, loads, self._synced()):
                load = load.to(device=value.device, dtype=torch.float32)
                value.add_((torch.sign(load.mean() - load) * self.rate).view_as(value))
                router.owner.get_buffer(BIAS).copy_(value)
        self.loads = [torch.zeros_like(load) for load in self.loads]

    def _synced(self) -> list[torch.Tensor]:
        """The float32 biases, each taken from its buffer again where the buffer no longer holds its rounded
        value: written since (the model's state loaded by the user), that value wins over the stale one."""
        with torch.no_grad():
            for router, value in zip(self.routers, self.biases):
                buffer = router.owner.get_buffer(BIAS)
                if not torch.equal(buffer, value.to(device=buffer.device, dtype=buffer.dtype)):
                    value.copy_(buffer.view_as(value))
        return self.biases

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's router biases by name, in float32 (a checkpoint holds every stage's)."""
        return {r.name: value.cpu().clone() for r, value in zip(self.routers, self._synced())}

    def state_mismatch(self, values: dict[str, torch.Tensor]) -> str | None:
        """What in ``values`` (a checkpoint's biases by name) does not fit this rank's routers
        (:func:`bias_mismatch`); None when all fit."""
        return bias_mismatch({r.name: value.shape for r, value in zip(self.routers, self.biases)}, values)

    def load_state_dict(self, values: dict[str, torch.Tensor]) -> None:
        """Set the biases a checkpoint holds (one saved without ``load_balance_coeff`` holds none: the
        model's stay)."""
        missing = [r.name for r in self.routers if r.name not in values]
        if missing:
            logger.info("the checkpoint holds no router bias for %s: the model's own values stay", missing[:3])
        with torch.no_grad():
            for router, value in zip(self.routers, self.biases):
                if router.name in values:
                    value.copy_(values[router.name].view_as(value))
                    router.owner.get_buffer(BIAS).copy_(value)

    def detach(self) -> None:
        """Remove the counting hooks."""
        for hook in self._hooks:
            hook.remove()

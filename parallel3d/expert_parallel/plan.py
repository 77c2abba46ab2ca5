"""Which modules of a Hugging Face MoE model expert parallelism splits: read from ``base_model_ep_plan``.

transformers declares, per MoE family, where the experts live and how HF's own expert
parallelism dispatches them (``{"layers.*.mlp.experts": "ep_dispatch_experts",
"layers.*.mlp.experts.gate_up_proj": "grouped_gemm", ...}``, keys relative to the base model).
The ``ep_dispatch_experts`` entries name the experts modules; the weight entries name their
stacked weights ([num_experts, ...]). Nothing is typed per family: a model without the plan, or
whose plan names no module of this config (no MoE layer), is refused with the reason.

An experts module is split when every parameter it holds is stacked over its ``num_experts``
experts (a parameter shared by all experts would get gradients from the local tokens only) and
``num_experts`` divides by the expert-parallel degree. LoRA on the stacked weights themselves
(``peft``'s ``target_parameters``, a ``ParamWrapper`` around the experts module) is refused, here
and under tensor parallelism: its adapters cover all the experts at once, whole (see
``refuse_expert_adapters``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from torch import nn

from models.family import text_config
from models.tp_plans import base_model_prefix
from parallel3d.build.peft_model import is_adapter_module
from parallel3d.errors import ConfigError

DISPATCH_STYLE = "ep_dispatch_experts"


@dataclass(frozen=True)
class ExpertsModule:
    """One experts module to split: its full name and routed-expert count."""

    name: str
    num_experts: int


def _pattern(key: str) -> re.Pattern:
    return re.compile("^" + re.escape(key).replace(r"\*", r"\d+") + "$")


def ep_plan(model: nn.Module) -> dict[str, str]:
    """The model's ``base_model_ep_plan`` (of its text config); ConfigError when it has none."""
    config = getattr(model, "config", None)
    plan = getattr(text_config(config), "base_model_ep_plan", None) if config is not None else None
    if not isinstance(plan, dict) or not plan:
        model_type = getattr(config, "model_type", "?")
        raise ConfigError(f"expert_parallel: {type(model).__name__} (model_type {model_type!r}) declares no "
                          "base_model_ep_plan in its config, so it has no experts Zero3D knows to split; turn "
                          "expert_parallel off for it")
    return dict(plan)


def resolve_experts(model: nn.Module, ep: int) -> list[ExpertsModule]:
    """The experts modules ``base_model_ep_plan`` names in ``model``, checked for a split over ``ep`` ranks."""
    owner = type(model).__name__
    plan = ep_plan(model)
    prefix = base_model_prefix(model)
    base = getattr(model, prefix)
    keys = [key for key, style in plan.items() if style == DISPATCH_STYLE]
    names = [name for name, _ in base.named_modules() if any(_pattern(k).match(name) for k in keys)]
    if not names:
        raise ConfigError(f"expert_parallel: {owner}'s base_model_ep_plan names the experts "
                          f"{', '.join(keys) or '(no ep_dispatch_experts entry)'}, and this config builds none of "
                          "them (no mixture-of-experts layer); turn expert_parallel off for it")
    found = []
    for name in names:
        module = base.get_submodule(name)
        full = f"{prefix}.{name}"
        if ep > 1:
            refuse_expert_adapters(module, full, "expert_parallel", f"expert parallelism (autoep_size {ep})",
                                   "expert parallelism keeps only each rank's share of the experts and routes "
                                   "tokens to them")
        count = getattr(module, "num_experts", None)
        if not isinstance(count, int) or count < 1:
            raise ConfigError(f"expert_parallel: {full} ({type(module).__name__}) has no num_experts attribute, so "
                              "its stacked weights cannot be told apart from shared ones")
        for local, param in module.named_parameters():
            if param.dim() == 0 or param.shape[0] != count:
                raise ConfigError(f"expert_parallel: {full}.{local} (shape {list(param.shape)}) is not stacked over "
                                  f"the module's {count} experts; a weight shared by all experts cannot be split")
        if count % ep:
            divisors = [d for d in range(1, count + 1) if count % d == 0]
            raise ConfigError(f"expert_parallel.autoep_size {ep} does not divide the {count} experts of {full}; "
                              f"allowed: {', '.join(map(str, divisors))}")
        found.append(ExpertsModule(full, count))
    return found


def refuse_expert_adapters(module: nn.Module, full: str, section: str, parallelism: str, keeps: str) -> None:
    """ConfigError when ``peft`` wrapped the experts module ``full`` to put LoRA on its stacked weights, which
    ``parallelism`` (of config ``section``) cannot cut; ``keeps``: the clause saying what it keeps on a rank.

    A ``ParamWrapper`` holds one ``lora_A [r * E, in]`` and ``lora_B [out, r * E]`` per weight for
    all ``E`` experts and adds their product to the whole stacked weight when it runs, while
    expert parallelism keeps ``E / ep`` experts per rank and replaces the module's forward by the
    all-to-all, and tensor parallelism keeps a slice of every expert: the adapters would have to be
    cut as the weight is and run inside the parallel call.
    """
    wrapped, layer = [], module
    while is_adapter_module(layer):
        wrapped.append(f"{full}.{getattr(layer, 'parameter_name', '?')}")
        layer = layer.base_layer
    if wrapped:
        raise ConfigError(f"{section}: LoRA on stacked expert weights ({', '.join(reversed(wrapped))}, peft's "
                          f"target_parameters) is not supported with {parallelism}: peft keeps one adapter pair for "
                          f"all the experts of the module and adds it to the whole stacked weight, while {keeps}; "
                          "instead put the adapters on the attention or dense projections (target_modules such as "
                          "q_proj, v_proj, o_proj, the experts frozen in the base), or train this model without "
                          "expert or tensor parallelism (expert_parallel.enabled false, tensor_parallel.size 1)")

"""Parameters left behind in a split region: found from the module structure and the plan.

A *split region* is a module that owns a row-parallel layer and at least one column layer
whose output stays split (attention, MLP). Between its column and row layers every rank
holds 1/T of the features (or heads). A parameter in that module that belongs to neither
layer acts on those split activations (HF's attention and MLP modules compute nothing else
besides the projections), and the plan often says nothing of it: Apertus' xIELU activation
``mlp.act_fn.alpha_p``/``alpha_n``, per-head q/k norms, Cohere's [heads, head_dim] q/k norms,
attention sinks. Left alone, each rank computes a gradient from its own features only, and
the replicas drift apart. Each such parameter gets one of three treatments:

- **sum its gradient over tp**: a scalar (it scales every feature alike), or a norm whose
  weight spans one head's dimension (Qwen3's q_norm/k_norm: it normalizes each head on its
  own, and every rank holds whole heads, so the forward is exact and the full gradient is
  the sum of the ranks' partial ones; with replicated kv heads each rank's share still comes
  from its own query heads only, so the plain sum over tp counts each once);
- **split it along the heads**: a parameter whose leading dim is the query- or kv-head count
  and that is per head (shape [heads] or [heads, head_dim]); kv-head ones follow the kv
  replication (``heads.py``);
- **sum its gradient over tp, upstream of the split**: a Linear or norm whose output width is
  the input width of one of the region's split column layers, other than the hidden size
  (multi-head latent attention: DeepSeek's ``q_a_proj``, ``q_a_layernorm``, ``kv_a_layernorm``
  compress the hidden states to a rank that ``q_b_proj``/``kv_b_proj`` expand into split heads).
  It computes on replicated activations, so its forward is exact; the gradient reaching it is
  this rank's heads' share until the region's entry sums it, and a parameter's gradient is
  linear in that share, so the sum over tp is the whole. The hidden size is left out because a
  module of that width may sit after the row layer, where the gradient is already whole;
- **refuse the model**, naming the parameter: anything else (a weight over all features, a
  matrix), whose correct handling cannot be read from shapes.

Modules the plan names (``replicated_with_grad_allreduce``, ``replicate``) keep the plan's word.
A region whose column layers all gather their output (OLMo 2's attention: q/k norms over all
heads) computes on replicated activations: its parameters are ordinary replicated ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from models.tp_plans import ModelTPPlan
from parallel3d.errors import ConfigError
from parallel3d.tensor_parallel.heads import HeadLayout
from parallel3d.tensor_parallel.layers import _linear_parts
from parallel3d.tensor_parallel.sharding import ShardSpec, make_spec


@dataclass
class LeftBehind:
    """Parameters of split regions outside the planned layers, by treatment (full names)."""

    summed: set[str] = field(default_factory=set)
    split: dict[str, ShardSpec] = field(default_factory=dict)


def split_regions(plan: ModelTPPlan) -> dict[str, list[str]]:
    """Region module -> its column layers whose output stays split (regions without any are left out)."""
    regions = plan.regions
    out: dict[str, list[str]] = {}
    for name, layer in plan.layers.items():
        parent = name.rpartition(".")[0]
        if layer.kind == "column" and not layer.gather_output and parent in regions:
            out.setdefault(parent, []).append(name)
    return out


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm)) or "Norm" in type(module).__name__


def _out_width(module: nn.Module) -> int | None:
    """The output features of a Linear or a norm (its weight's size), else None."""
    if isinstance(module, nn.Linear):
        return module.out_features
    weight = getattr(module, "weight", None)
    if _is_norm(module) and isinstance(weight, nn.Parameter) and weight.dim() == 1:
        return weight.shape[0]
    return None


def _treatment(param: nn.Parameter, owner: nn.Module, layout: HeadLayout | None, world: int,
               upstream: set[int] = frozenset()) -> str | ShardSpec | None:
    """"sum", the ShardSpec to split with, or None (refuse); see the module docstring. ``upstream``:
    the input widths of the region's split columns (the hidden size left out)."""
    if param.numel() == 1 or _out_width(owner) in upstream:
        return "sum"
    if layout is None:
        return None
    shape = tuple(param.shape)
    if _is_norm(owner) and shape == (layout.head_dim,):
        return "sum"
    if shape[1:] in ((), (layout.head_dim,)):
        if shape[0] == layout.heads:
            return make_spec(layout.heads, 0, world)
        if shape[0] == layout.kv_heads:
            return make_spec(layout.kv_heads, 0, world, replicas=layout.kv_replicas)
    return None


def _planned_owner(owner_name: str, plan: ModelTPPlan, region: str) -> bool:
    """Whether ``owner_name`` is a module the plan names (other than ``region``) or sits inside one
    (the base and adapters of a LoRA layer: parallel3d/tensor_parallel/adapters.py)."""
    parts = owner_name.split(".")
    return any(".".join(parts[:i]) in plan.layers and ".".join(parts[:i]) != region for i in range(len(parts), 0, -1))


def find_left_behind(model: nn.Module, plan: ModelTPPlan, layout: HeadLayout | None, world: int) -> LeftBehind:
    """Classify every parameter of a split region that no planned layer owns; refuse what cannot be handled."""
    found = LeftBehind()
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    for region, columns in sorted(split_regions(plan).items()):
        module = model.get_submodule(region)
        upstream = {model.get_submodule(c).weight.shape[1 - _linear_parts(model.get_submodule(c))[2]] for c in columns}
        upstream.discard(getattr(cfg, "hidden_size", None))
        for local, param in module.named_parameters():
            name = f"{region}.{local}"
            owner_name = name.rpartition(".")[0]
            if _planned_owner(owner_name, plan, region):  # a parallel layer, a module the plan names, or inside one
                continue
            owner = model.get_submodule(owner_name)
            treatment = _treatment(param, owner, layout if region in plan.attention_modules else None, world, upstream)
            if treatment is None:
                raise ConfigError(
                    f"{type(model).__name__}: parameter {name} (shape {list(param.shape)}, in {type(owner).__name__}) "
                    f"acts on the activations that tensor parallelism splits between {columns} and the row layer of "
                    f"{region}, and neither its plan entry nor its shape says how to split it; zero3d handles "
                    f"scalars, per-head-dim norms, per-head parameters (shape [heads] or [heads, head_dim]) and Linears "
                    f"or norms feeding a split column there")
            if treatment == "sum":
                found.summed.add(name)
            else:
                found.split[name] = treatment
    return found


def split_params(model: nn.Module, specs: dict[str, ShardSpec], rank: int, world: int) -> None:
    """Replace each named parameter by this rank's shard (same module attribute, same requires_grad)."""
    for name, spec in specs.items():
        owner_name, _, leaf = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        full = getattr(owner, leaf)
        setattr(owner, leaf, nn.Parameter(spec.shard(full.detach(), rank, world), requires_grad=full.requires_grad))

"""Attention heads under tensor parallelism: how many each rank holds, and key/value replication.

Each of the T ranks holds H/T query heads. Key/value heads: K/T per rank when T divides K.
When T exceeds K (T a multiple of K) the kv heads are *replicated*, as Megatron and vLLM do:
rank r holds kv head r // (T/K), the one its query heads use (query head h reads kv head
h // (H/K), and rank r's H/T heads all fall into one such group). The key/value projections
are then column layers whose slices are held by T/K consecutive ranks (``ShardSpec.replicas``);
each rank's weight gradient comes from its own query heads only, so the gradient of a slice
is the sum over the ranks that hold it, which ``apply_tensor_parallel`` adds with a hook.
Multi-query attention (K = 1) is the case where every rank holds the one kv head.

HF attention modules reshape with ``-1`` heads, so only the attributes that hold head counts
or the query-per-kv group size (``num_key_value_groups``, read by transformers' sdpa/eager
attention to repeat kv heads) have to become per-rank.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
from torch import nn

from models.tp_plans import ModelTPPlan
from parallel3d.errors import ConfigError
from parallel3d.tensor_parallel.layers import _linear_parts

KV_COUNT_ATTRS = ("num_key_value_heads", "num_kv_heads")
Q_COUNT_ATTRS = ("num_heads", "num_attention_heads")


@dataclass(frozen=True)
class HeadLayout:
    """Head counts of the full model and how T ranks share them."""

    heads: int
    kv_heads: int
    head_dim: int
    world: int

    @property
    def kv_replicas(self) -> int:
        """How many consecutive ranks hold each kv head (1 when T divides K)."""
        return self.world // self.kv_heads if self.kv_heads < self.world else 1

    @property
    def local_heads(self) -> int:
        return self.heads // self.world

    @property
    def local_kv_heads(self) -> int:
        return self.kv_heads // self.world if self.kv_heads >= self.world else 1


def head_layout(model: nn.Module, plan: ModelTPPlan, world: int) -> HeadLayout | None:
    """The model's head layout over ``world`` ranks (None when the plan splits no heads).

    Raises ``ConfigError`` when the heads do not split: T must divide H, and T must divide K
    or be a multiple of it.
    """
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    cls = type(model).__name__
    heads = _global(cfg, "num_attention_heads")
    if not plan.heads_sharded or not isinstance(heads, int):
        return None
    kv = next((v for v in (_global(cfg, a) for a in KV_COUNT_ATTRS) if isinstance(v, int) and v), heads)
    for layer_heads, layer_kv in {(heads, kv), *_per_layer_heads(cfg, heads, kv)}:
        _check_split(cls, world, layer_heads, layer_kv, varying=(layer_heads, layer_kv) != (heads, kv))
    head_dim = _global(cfg, "head_dim") or cfg.hidden_size // heads
    return HeadLayout(heads=heads, kv_heads=kv, head_dim=head_dim, world=world)


def _global(cfg: Any, key: str) -> Any:
    """The config's global value of ``key``; transformers refuses to read an attribute that its
    heterogeneous configs (``per_layer_config``) set per layer, so it is read past that check."""
    raw = getattr(cfg, "_getattr_without_heterogeneous_validation", None)
    return raw(key, None) if raw is not None else getattr(cfg, key, None)


def _per_layer_heads(cfg: Any, heads: int, kv: int) -> set[tuple[int, int]]:
    """(query heads, kv heads) of every layer whose config overrides them (dots3's layers)."""
    varying = set(getattr(cfg, "per_layer_attributes", None) or ()) & {"num_attention_heads", *KV_COUNT_ATTRS}
    if not varying:
        return set()
    out = set()
    for layer in cfg.per_layer_config:
        layer_heads = _global(layer, "num_attention_heads") or heads
        out.add((layer_heads, next((v for v in (_global(layer, a) for a in KV_COUNT_ATTRS) if v), layer_heads)))
    return out


def _check_split(cls: str, world: int, heads: int, kv: int, varying: bool) -> None:
    where = " in the layers whose per_layer_config sets them" if varying else ""
    if heads % world:
        raise ConfigError(f"tensor_parallel.size={world} must divide num_attention_heads={heads} of {cls}{where} "
                          f"(each rank holds whole heads)")
    if kv % world and world % kv:
        raise ConfigError(f"tensor_parallel.size={world} must divide num_key_value_heads={kv} of {cls}{where} or be a "
                          f"multiple of it (num_attention_heads={heads}; each rank holds whole key/value heads, "
                          f"replicated when the tp size exceeds their count)")
    if varying and kv < world:
        raise ConfigError(f"{cls}: tensor_parallel.size={world} exceeds num_key_value_heads={kv} in the layers whose "
                          "per_layer_config sets it; replicated key/value heads need one kv-head count in every layer")


def kv_projections(model: nn.Module, plan: ModelTPPlan, layout: HeadLayout) -> set[str]:
    """The column layers to replicate: those of attention modules that output K * head_dim features.

    Empty unless T exceeds K. An attention module that splits heads but has no such layer
    (a fused q|k|v projection) cannot replicate its kv heads: ``ConfigError``.
    """
    if layout.kv_replicas == 1:
        return set()
    found = set()
    for attention in sorted(plan.attention_modules):
        columns = [n for n, layer in plan.layers.items()
                   if layer.kind == "column" and not layer.gather_output and n.rpartition(".")[0] == attention]
        kv = []
        for name in columns:
            weight, _, out_dim = _linear_parts(model.get_submodule(name))
            if weight.shape[out_dim] == layout.kv_heads * layout.head_dim and plan.layers[name].packed == 1:
                kv.append(name)
        if not kv:
            raise ConfigError(
                f"{type(model).__name__}: tensor_parallel.size={layout.world} exceeds num_key_value_heads="
                f"{layout.kv_heads}, so key/value heads must be replicated, but {attention} has no separate key/value "
                f"projection with {layout.kv_heads} x {layout.head_dim} outputs among its column layers {columns}")
        found.update(kv)
    return found


def localize_head_counts(module: nn.Module, attrs: tuple[str, ...], layout: HeadLayout | None, world: int) -> None:
    """Make an attention module's head-count attributes per-rank (``attrs``: those it has).

    Every listed count (query heads, kv heads, GPT-2's ``split_size``, ``embed_dim``) is the
    module's own divided by T, a kv-head count below T becomes 1 (replicated); the group size
    ``num_key_value_groups`` their ratio (K read from the module's own group size), so layers
    with their own head counts keep them.
    """
    own_heads = next((v for v in (getattr(module, a, None) for a in Q_COUNT_ATTRS) if isinstance(v, int)), None)
    for attr in attrs:
        value = getattr(module, attr)
        if layout is not None and attr in KV_COUNT_ATTRS and value < world:
            value = 1  # a replicated kv head
        else:
            value //= world
        setattr(module, attr, value)
    groups = getattr(module, "num_key_value_groups", None)
    if layout is not None and isinstance(groups, int) and groups:
        # this module's own counts, which may differ from the config's (MiMo-V2-Flash doubles its
        # kv heads in its sliding-window layers; dots3 sets head counts per layer)
        heads = own_heads or layout.heads
        kv = heads // groups
        module.num_key_value_groups = (heads // world) // (kv // world if kv >= world else 1)


def _narrow_heads(value: Any, layout: str, heads: int, start: int, count: int) -> Any:
    """This rank's heads of a per-head input (``layout``: see ``FamilyRecord.tp_head_inputs``)."""
    if not isinstance(value, torch.Tensor):
        return value
    if layout == "batch*heads":
        if value.shape[0] % heads:
            raise RuntimeError(f"tensor parallel: a [batch*heads, ...] input of shape {list(value.shape)} does not "
                               f"hold {heads} heads")
        return value.view(-1, heads, *value.shape[1:])[:, start:start + count].reshape(-1, *value.shape[1:])
    if value.dim() >= 2 and value.shape[1] == heads:
        return value[:, start:start + count]
    return value


def head_input_hook(module: nn.Module, inputs: Mapping[str, str], layout: HeadLayout, rank: int) -> Callable:
    """A forward pre-hook (with kwargs) narrowing ``module``'s per-head inputs (BLOOM's ALiBi) to this rank's heads."""
    params = list(inspect.signature(module.forward).parameters)
    start, count = rank * layout.local_heads, layout.local_heads

    def hook(_: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        args = tuple(_narrow_heads(a, inputs[params[i]], layout.heads, start, count)
                     if i < len(params) and params[i] in inputs else a for i, a in enumerate(args))
        kwargs = {k: _narrow_heads(v, inputs[k], layout.heads, start, count) if k in inputs else v
                  for k, v in kwargs.items()}
        return args, kwargs

    return hook

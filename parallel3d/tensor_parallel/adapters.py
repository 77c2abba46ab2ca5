"""LoRA adapters (``peft``) around tensor-parallel layers.

A PEFT model keeps the planned projection as ``base_layer`` of a LoRA layer whose forward adds
``lora_B(lora_A(dropout(x))) * scaling`` to the base output. The plan names the LoRA layer (it
sits where the projection was); the base is split as the projection would be, and the adapter
so that its output is split exactly like the base's:

* around a column-parallel base (output features split): ``lora_B`` is split by output rows
  like the base weight (packed blocks and replicated kv slices alike) and ``lora_A`` stays
  whole. Each rank's ``lora_A`` gradient is then a partial sum over its rows of ``lora_B``, so
  it is summed over tp by a gradient hook (a ``partial_grad`` parameter), and the adapter's
  part of the input gradient is a partial sum like the base's, summed where the region is
  entered. A column layer that enters tensor parallelism itself (outside a region) leaves that
  entry to a pre-hook on the LoRA layer, so the adapter's input is entered too.
* around a row-parallel base (input features split): ``lora_A`` is split by input columns and
  its output all-reduced (a row-parallel ``lora_A`` of rank-r output, a small all-reduce), so
  ``lora_B`` sees the whole low-rank activation and stays whole; its gradient is the same on
  every rank.

LoRA variants that compute with the base weight (DoRA's magnitude) and adapters under
sequence parallelism are refused with a message.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed import ProcessGroup

from models.tp_styles import LayerPlan
from parallel3d.errors import ConfigError
from parallel3d.tensor_parallel.comm import copy_to_tp
from parallel3d.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, is_adapter_layer
from parallel3d.tensor_parallel.sequence import hidden_states_hook
from parallel3d.tensor_parallel.sharding import ShardSpec


def check_adapter(name: str, module: nn.Module, sequence_parallel: bool) -> None:
    """ConfigError for a LoRA layer that tensor parallelism cannot split."""
    if sequence_parallel:
        raise ConfigError(f"LoRA adapter {name}: tensor_parallel.sequence_parallel with PEFT adapters is not "
                          "supported; set tensor_parallel.sequence_parallel: false")
    variants = sorted(getattr(module, "lora_variant", {}) or {})
    if variants or any(len(getattr(module, attr, {}) or {}) for attr in ("lora_magnitude_vector", "lora_embedding_A")):
        raise ConfigError(f"LoRA adapter {name}: a LoRA variant (DoRA and the like: {', '.join(variants) or 'default'}) "
                          "computes with the whole base weight, which tensor parallelism splits; use plain LoRA "
                          "(use_dora: false) or tensor_parallel.size 1")
    for adapter in module.lora_A:
        if not isinstance(module.lora_A[adapter], nn.Linear) or not isinstance(module.lora_B[adapter], nn.Linear):
            raise ConfigError(f"LoRA adapter {name}.{adapter}: only nn.Linear adapters can be split by tensor "
                              f"parallelism (got {type(module.lora_A[adapter]).__name__})")


def shard_adapter(name: str, module: nn.Module, layer: LayerPlan, group: ProcessGroup, *, replicas: int,
                  region_entered: bool) -> tuple[dict[str, ShardSpec], list[nn.Parameter], list[Any]]:
    """Split the adapters of LoRA layer ``name`` (its base already replaced by a parallel layer).

    Returns the adapters' shard specs (by model name), the parameters whose gradient is a partial
    sum over tp, and the hooks added.
    """
    specs: dict[str, ShardSpec] = {}
    partial: list[nn.Parameter] = []
    hooks: list[Any] = []
    for adapter in list(module.lora_A):
        dropout = getattr(module.lora_dropout[adapter], "p", 0.0) if adapter in module.lora_dropout else 0.0
        if layer.kind == "column" and region_entered and dropout > 0:
            raise ConfigError(f"LoRA adapter {name}.{adapter}: lora_dropout {dropout} around a column-parallel layer "
                              "inside a split region is not supported: the region draws dropout masks from each tp "
                              "rank's own stream, so each rank's output rows would see a different mask of the same "
                              "input (one process draws one); set lora_dropout to 0, or tensor_parallel.size 1")
        if layer.kind == "column":
            new = ColumnParallelLinear(module.lora_B[adapter], group, input_comm="none",
                                       gather_output=layer.gather_output, packed=layer.packed, replicas=replicas)
            module.lora_B[adapter] = new
            specs.update({f"{name}.lora_B.{adapter}.{p}": s for p, s in new.specs.items()})
            partial += [p for p in module.lora_A[adapter].parameters() if p.requires_grad]
        else:
            new = RowParallelLinear(module.lora_A[adapter], group, split_input=layer.split_input, packed=layer.packed)
            module.lora_A[adapter] = new
            specs.update({f"{name}.lora_A.{adapter}.{p}": s for p, s in new.specs.items()})
    if layer.kind == "column" and not region_entered:
        hooks.append(module.register_forward_pre_hook(hidden_states_hook(lambda x: copy_to_tp(x, group)),
                                                      with_kwargs=True))
    return specs, partial, hooks

"""Megatron-style tensor-parallel layers, each built FROM an existing full module.

Every layer slices the full module's weights for this tp rank (so a model built identically
on every rank, e.g. from one seed or one checkpoint, needs no broadcast), keeps the
parameter names ``weight`` / ``bias`` (state-dict keys, ZeRO units and tied-weight lookups
stay valid) and the weight layout of the module it replaces: ``nn.Linear`` stores
[out, in], transformers' ``Conv1D`` (GPT-2) stores [in, out]. Each sharded parameter
carries its ``ShardSpec`` in ``layer.specs[name]``.

Where the conjugate collective sits is a constructor choice, because inside a model one
collective at the entry of a whole region (attention, MLP) replaces one per projection:
``input_comm="none"`` means the caller already entered the tensor-parallel region.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from parallel3d.build import storageless
from parallel3d.tensor_parallel.comm import (
    copy_to_tp,
    gather_from_tp,
    gather_seq,
    reduce_from_tp,
    reduce_scatter_seq,
    split_to_tp,
)
from parallel3d.tensor_parallel.sharding import ShardSpec, make_spec

InputComm = Literal["copy", "gather_seq", "none"]
OutputComm = Literal["all_reduce", "reduce_scatter_seq"]


def is_conv1d(module: nn.Module) -> bool:
    """transformers' ``Conv1D`` (weight [in, out]), recognised without importing transformers."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "nx")


def is_adapter_layer(module: nn.Module) -> bool:
    """A ``peft`` LoRA layer: a ``base_layer`` with ``lora_A`` / ``lora_B`` adapters beside it
    (parallel3d/tensor_parallel/adapters.py)."""
    return (isinstance(getattr(module, "base_layer", None), nn.Module)
            and isinstance(getattr(module, "lora_A", None), nn.ModuleDict)
            and isinstance(getattr(module, "lora_B", None), nn.ModuleDict))


def _linear_parts(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """(weight, bias, which weight dim holds the output features) of a Linear or Conv1D (of the
    base layer of a LoRA layer)."""
    if is_adapter_layer(module):
        module = module.base_layer
    if is_conv1d(module):
        return module.weight, module.bias, 1
    if isinstance(module, nn.Linear):
        return module.weight, module.bias, 0
    raise TypeError(f"expected nn.Linear or transformers Conv1D, got {type(module).__name__}")


def _param(t: torch.Tensor, like: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t.to(dtype=like.dtype, device=like.device), requires_grad=like.requires_grad)


def _matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_dim: int) -> torch.Tensor:
    if out_dim == 0:
        return F.linear(x, weight, bias)
    out = x.reshape(-1, x.shape[-1])  # Conv1D: addmm like transformers, same rounding
    out = torch.addmm(bias, out, weight) if bias is not None else out @ weight
    return out.view(*x.shape[:-1], weight.shape[1])


class ColumnParallelLinear(nn.Module):
    """Output features split across ranks: Y_r = X W_r (+ b_r); the input is replicated.

    ``input_comm``: ``"copy"`` (identity forward, all-reduce of the input grad: each rank's
    grad is a partial sum over its columns), ``"gather_seq"`` (input is a sequence shard:
    all-gather along dim 1, reduce-scatter backward) or ``"none"`` (done by the caller).
    ``gather_output`` all-gathers the features afterwards (HF's ``colwise_gather_output``).
    ``packed`` > 1 splits each of that many equal output blocks separately (GPT-2 q|k|v).
    ``replicas`` > 1: that many consecutive ranks hold the same slice (key/value heads when
    the tp size exceeds their count); their weight gradients are partial sums that
    ``apply_tensor_parallel`` adds up over the replicas.
    """

    def __init__(self, full: nn.Module, group: ProcessGroup, *, input_comm: InputComm = "copy",
                 gather_output: bool = False, packed: int = 1, replicas: int = 1) -> None:
        super().__init__()
        weight, bias, out_dim = _linear_parts(full)
        self.group, self.input_comm, self.gather_output, self.out_dim = group, input_comm, gather_output, out_dim
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        self.full_out_features = weight.shape[out_dim]
        self.in_features = weight.shape[1 - out_dim]
        if gather_output and replicas > 1:
            raise ValueError("a column layer whose output is gathered cannot hold replicated slices")
        self.specs: dict[str, ShardSpec] = {
            "weight": make_spec(self.full_out_features, out_dim, world, packed=packed, replicas=replicas)}
        self.weight = _param(self.specs["weight"].shard(weight.detach(), rank, world), weight)
        self.out_features = self.weight.shape[out_dim]
        if bias is not None:
            self.specs["bias"] = make_spec(self.full_out_features, 0, world, packed=packed, replicas=replicas)
            self.bias = _param(self.specs["bias"].shard(bias.detach(), rank, world), bias)
        else:
            self.register_parameter("bias", None)
        self.packed, self.world = packed, world

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_comm == "copy":
            x = copy_to_tp(x, self.group)
        elif self.input_comm == "gather_seq":
            x = gather_seq(x, self.group, -2)
        y = _matmul(x, self.weight, self.bias, self.out_dim)
        if not self.gather_output:
            return y
        y = gather_from_tp(y, self.group, -1)
        if self.packed > 1:  # rank-major [r0: q k v | r1: q k v] -> block-major [q | k | v]
            lead = y.shape[:-1]
            y = y.view(*lead, self.world, self.packed, -1).transpose(-3, -2).reshape(*lead, -1)
        return y

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}/{self.full_out_features}, "
                f"input_comm={self.input_comm}, gather_output={self.gather_output}, packed={self.packed}")


class RowParallelLinear(nn.Module):
    """Input features split across ranks: Y = sum_r X_r W_r, then + b (b replicated).

    ``split_input`` takes this rank's chunk of a replicated input first (HF's
    ``rowwise_split_input``). ``output_comm``: ``"all_reduce"`` or ``"reduce_scatter_seq"``
    (sequence parallelism: each rank keeps its sequence shard of the sum). ``packed`` > 1
    splits each of that many equal input blocks separately (CodeGen's head groups). The bias is added
    after the reduction so it counts once; under sequence parallelism it then only sees this
    rank's tokens, so its gradient is partial (``apply_tensor_parallel`` sums it over tp).
    """

    def __init__(self, full: nn.Module, group: ProcessGroup, *, split_input: bool = False, packed: int = 1,
                 output_comm: OutputComm = "all_reduce") -> None:
        super().__init__()
        weight, bias, out_dim = _linear_parts(full)
        self.group, self.split_input, self.output_comm, self.out_dim = group, split_input, output_comm, out_dim
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        in_dim = 1 - out_dim
        self.full_in_features = weight.shape[in_dim]
        self.out_features = weight.shape[out_dim]
        if packed > 1 and split_input:
            raise ValueError("a row layer that splits its own input cannot hold packed blocks")
        self.specs: dict[str, ShardSpec] = {"weight": make_spec(self.full_in_features, in_dim, world, packed=packed)}
        self.weight = _param(self.specs["weight"].shard(weight.detach(), rank, world), weight)
        self.in_features = self.weight.shape[in_dim]
        self.bias = _param(storageless.clone(bias.detach()), bias) if bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.split_input:
            x = split_to_tp(x, self.group, -1)
        y = _matmul(x, self.weight, None, self.out_dim)
        y = reduce_from_tp(y, self.group) if self.output_comm == "all_reduce" else reduce_scatter_seq(y, self.group, -2)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return (f"in={self.in_features}/{self.full_in_features}, out={self.out_features}, "
                f"split_input={self.split_input}, output_comm={self.output_comm}")


class VocabParallelEmbedding(nn.Module):
    """Embedding rows (the vocabulary) split across ranks; lookups all-reduced.

    The vocabulary is zero-padded to a multiple of T. Each rank looks up the ids in its
    range [vocab_start, vocab_start + rows), zeros the others, and the all-reduce sums the
    one non-zero contribution per token. A scaled embedding (Gemma's ``embed_scale``) keeps
    its scale. Its backward reads no weights (ZeRO-3 does not gather it for backward).
    """

    backward_reads_no_weights = True

    def __init__(self, full: nn.Embedding, group: ProcessGroup) -> None:
        super().__init__()
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        self.group = group
        self.num_embeddings, self.embedding_dim = full.weight.shape
        self.specs: dict[str, ShardSpec] = {"weight": make_spec(self.num_embeddings, 0, world, pad=True)}
        self.padded_vocab_size = self.specs["weight"].padded_size
        self.rows = self.padded_vocab_size // world
        self.vocab_start = rank * self.rows
        self.weight = _param(self.specs["weight"].shard(full.weight.detach(), rank, world), full.weight)
        pad = getattr(full, "padding_idx", None)
        self.padding_idx = pad - self.vocab_start if pad is not None and 0 <= pad - self.vocab_start < self.rows else None
        scale = getattr(full, "embed_scale", None)
        if scale is not None:
            self.register_buffer("embed_scale", torch.as_tensor(scale).clone(), persistent=False)
        else:
            self.embed_scale = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.vocab_start) | (ids >= self.vocab_start + self.rows)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight, self.padding_idx).masked_fill(outside.unsqueeze(-1), 0.0)
        out = reduce_from_tp(out, self.group)
        if self.embed_scale is not None:
            out = out * self.embed_scale.to(out.dtype)
        return out

    def extra_repr(self) -> str:
        return f"{self.rows} of {self.num_embeddings} rows (padded {self.padded_vocab_size}), dim={self.embedding_dim}"


class VocabParallelLMHead(nn.Module):
    """The output projection, column-parallel over the (padded) vocabulary.

    Returns this rank's logits [..., padded_vocab / T]; the loss never needs them gathered
    (``vocab_parallel_cross_entropy``). With ``tied`` the weight IS the embedding's
    parameter (one parameter, one gradient: lookups and logits both accumulate into it).
    """

    def __init__(self, full: nn.Module, group: ProcessGroup, *, tied: VocabParallelEmbedding | None = None) -> None:
        super().__init__()
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        self.group = group
        weight, bias, out_dim = _linear_parts(full)
        if out_dim != 0:
            raise TypeError("an lm head is expected to be an nn.Linear")
        self.vocab_size, self.in_features = weight.shape
        spec = make_spec(self.vocab_size, 0, world, pad=True)
        self.specs: dict[str, ShardSpec] = {"weight": spec}
        if tied is not None:
            self.weight = tied.weight
        else:
            self.weight = _param(spec.shard(weight.detach(), rank, world), weight)
        if bias is not None:
            self.specs["bias"] = spec
            self.bias = _param(spec.shard(bias.detach(), rank, world), bias)
        else:
            self.register_parameter("bias", None)
        self.padded_vocab_size = spec.padded_size
        self.vocab_start = rank * (spec.padded_size // world)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(copy_to_tp(hidden, self.group), self.weight, self.bias)

    def gather(self, local_logits: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits from every rank's shard (padding removed); differentiable."""
        return gather_from_tp(local_logits, self.group, -1)[..., : self.vocab_size]

    def extra_repr(self) -> str:
        return f"in={self.in_features}, vocab={self.vocab_size} (padded {self.padded_vocab_size}), start={self.vocab_start}"

"""The Trainer's data loaders sharded over data-parallel ranks only, and evaluation's results
gathered over them.

``accelerator.prepare`` shards a loader over every process. Under Zero3D the tensor- and
pipeline-parallel ranks of one replica must see the same micro-batches (parallel3d/runtime/mesh.py),
so the shard count is the dp size and the shard index the rank's dp index. accelerate's shard
wrappers read both as plain attributes (transformers' Trainer resets them the same way for its
``BatchRebalanceSampler``), so they are set on the prepared loader. At dp 1 the batch sampler's last batch is left short,
as on one process (accelerate's ``even_batches`` would fill it up with rows from the start).

Evaluation gathers each batch's results with ``accelerator.gather_for_metrics``, over every
process: each replica's batch would come back tp x pp times, except the last, which accelerate
trims to the dataset's remainder (computed from the loader, so for dp shards).
``gather_over_dp`` gathers over the data-parallel group instead, with the same trimming.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from accelerate.data_loader import BatchSamplerShard, IterableDatasetShard
from accelerate.state import GradientState
from accelerate.utils import recursively_apply

from parallel3d.errors import ConfigError


def shard_over_dp(loader, dp: int, dp_rank: int, processes: int):
    """``loader`` (from ``accelerator.prepare`` over ``processes`` processes) with its shards over dp;
    returns it."""
    if processes == 1:
        return loader  # accelerate left it whole
    shards = [s for s in (getattr(loader, "batch_sampler", None), getattr(loader, "dataset", None))
              if isinstance(s, (BatchSamplerShard, IterableDatasetShard))]
    if not shards:
        raise ConfigError(f"the Trainer's data loader ({type(loader).__name__}) was split per process in a way that "
                          "cannot be re-cut over data-parallel ranks (accelerator_config.dispatch_batches or "
                          "split_batches, or a datasets IterableDataset split by its file shards); leave those "
                          "unset, or give a dataset with fewer file shards than processes")
    for shard in shards:
        shard.num_processes, shard.process_index = dp, dp_rank
        if dp == 1 and isinstance(shard, BatchSamplerShard):
            shard.even_batches = False  # one replica: nothing to even out, and rows repeated into a short
            # last batch would enter its loss (one process's loader, which accelerate leaves whole, has none)
    return loader


def gather_over_dp(data: Any, group: dist.ProcessGroup | None, state: GradientState,
                   use_gather_object: bool = False) -> Any:
    """``accelerator.gather_for_metrics(data)`` over the data-parallel ``group`` (None: one replica):
    tensors (nested) concatenated along dim 0 in dp-rank order, or a list of the ranks' objects;
    at the loader's end cut to its remainder (the samples even batches repeated dropped)."""
    try:
        recursively_apply(lambda x: x, data, error_on_other_type=True)
    except TypeError:
        use_gather_object = True
    if group is None or dist.get_world_size(group) == 1:
        gathered = data
    elif use_gather_object:  # lists of objects, as accelerate's gather_object takes them
        parts: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(parts, data, group=group)
        gathered = [x for part in parts for x in part]
    else:
        gathered = recursively_apply(lambda t: _gather_tensor(t, group), data)
    remainder = state.remainder if state.end_of_dataloader else 0
    if remainder <= 0:  # -1: a dataset without a length
        return gathered
    if use_gather_object:
        return gathered[:remainder]
    return recursively_apply(lambda t: t[:remainder], gathered)


def _gather_tensor(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    tensor = (tensor[None] if tensor.ndim == 0 else tensor).contiguous()
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor, group=group)
    return torch.cat(parts)

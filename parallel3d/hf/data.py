"""The Trainer's data loaders sharded over data-parallel ranks only.

``accelerator.prepare`` shards a loader over every process. Under Zero3D the tensor- and
pipeline-parallel ranks of one replica must see the same micro-batches (parallel3d/mesh.py),
so the shard count is the dp size and the shard index the rank's dp index. accelerate's shard
wrappers read both as plain attributes (transformers' Trainer resets them the same way for its
``BatchRebalanceSampler``), so they are set on the prepared loader.
"""

from __future__ import annotations

from accelerate.data_loader import BatchSamplerShard, IterableDatasetShard

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
    return loader

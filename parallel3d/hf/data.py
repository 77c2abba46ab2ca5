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


def shard_over_dp(loader, dp: int, dp_rank: int):
    """``loader`` (from ``accelerator.prepare``) with its shards over dp; returns it."""
    shards = [s for s in (getattr(loader, "batch_sampler", None), getattr(loader, "dataset", None))
              if isinstance(s, (BatchSamplerShard, IterableDatasetShard))]
    if not shards:
        if dp == 1 and getattr(loader, "batch_sampler", None) is not None:
            return loader  # one process or one replica: nothing is sharded
        raise ConfigError(f"the Trainer's data loader ({type(loader).__name__}) is not one accelerate shards per "
                          "process, so it cannot be sharded over data-parallel ranks; leave "
                          "accelerator_config.dispatch_batches and split_batches unset")
    for shard in shards:
        shard.num_processes, shard.process_index = dp, dp_rank
    return loader

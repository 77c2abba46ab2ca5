"""Megatron-style tensor (and sequence) parallelism for unmodified HF causal LMs.

``apply_tensor_parallel(model, tp_group, sequence_parallel=...)`` is the entry point; the
layers, collectives and the vocab-parallel cross entropy are usable on their own.
"""

from parallel3d.tensor_parallel.apply import TensorParallelInfo, apply_tensor_parallel
from parallel3d.tensor_parallel.cross_entropy import causal_lm_loss, vocab_parallel_cross_entropy
from parallel3d.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelLMHead,
)
from parallel3d.tensor_parallel.sharding import ShardSpec

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "ShardSpec",
    "TensorParallelInfo",
    "VocabParallelEmbedding",
    "VocabParallelLMHead",
    "apply_tensor_parallel",
    "causal_lm_loss",
    "vocab_parallel_cross_entropy",
]

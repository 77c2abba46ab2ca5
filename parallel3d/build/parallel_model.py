"""One record of what ``initialize``'s apply steps made of a model on this rank.

``apply_ep`` -> ``apply_tp`` -> ``apply_context_parallel`` -> ``apply_pipeline`` -> ``apply_zero``
(parallel3d/build/apply.py) each return their part; ``ParallelModel`` holds them together with
the model as the steps left it and the mesh. The engine is built from it, and the checkpoint
code takes it to find out how each of this rank's parameters is named and cut, so neither
reads another's attributes to learn the layout (issue 28's typed hand-offs).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from parallel3d.context_parallel import SequenceSplit
    from parallel3d.expert_parallel import ExpertParallelInfo
    from parallel3d.pipeline.stage import PipelineModel
    from parallel3d.runtime.mesh import ParallelMesh
    from parallel3d.tensor_parallel import TensorParallelInfo
    from zero import ZeroOptimizer

__all__ = ["ParallelModel"]


@dataclass(frozen=True)
class ParallelModel:
    """This rank's share of the model and the record of each parallel step (None: its dimension is 1)."""

    module: nn.Module  # the model as the steps left it (under pipeline stages: this rank's chunks only)
    mesh: ParallelMesh
    zero: ZeroOptimizer  # holds this rank's trainable parameters (their shards at stages 1-3)
    tp: TensorParallelInfo | None = None
    pipe: PipelineModel | None = None
    ep: ExpertParallelInfo | None = None
    sequence_split: SequenceSplit | None = None  # context parallelism's cut of each micro-batch

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """(Hugging Face name, parameter) of every parameter this rank holds: under pipeline stages
        the names the unmodified model gives them, not the chunks' own."""
        return self.pipe.hf_named_parameters() if self.pipe is not None else self.module.named_parameters()

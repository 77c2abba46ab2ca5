"""Context parallelism under pipeline stages: the micro-batches cut before the stage programs see them.

A pipeline runs a window's micro-batches through its schedule interleaved, so the cut
(``SequenceSplit.cut_apart``, batch.py) is made for all of them before the schedule starts. The
stage programs then get what the forward without stages gets: this rank's tokens, their global
position ids (the rotary tables per shard, on every stage), the labels shifted over the whole
sequence (``shift_labels``, which the last stage's loss takes as given) and the loss divisor
(the micro-batch's label tokens over the whole sequence divided by cp, or the global count
under ``loss_normalization: "tokens"``). The activations that pass between stages are this
rank's sequence shard, ``[micro_batch, S / cp, hidden]``: the executor reads their shape from
the cut ``input_ids``. The ring's p2p runs on the cp group and the pipeline's on the pp group,
separate process groups (their own gloo contexts, NCCL communicators), so their messages never
match each other's; the cp ranks of a stage run the same schedule, so they enter each layer's
exchange together.

What the attention needs per micro-batch (its padding and packed documents, ``MaskInputs``) is put in
place around every compute action of that micro-batch (``around``): its forward, and its
backward passes, which recompute the forward under activation checkpointing. After each forward
of a chunk its attention calls are checked, as the forward without stages checks the model's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

from parallel3d.context_parallel.batch import SequenceSplit, _sequence_length
from parallel3d.context_parallel.mask_inputs import MaskInputs
from parallel3d.pipeline.actions import Action, Kind


class StageCut:
    """The cp cut of a window's micro-batches for this rank's pipeline chunks.

    ``chunk_layers[c]``: the global indices of the blocks chunk ``c`` runs.
    """

    def __init__(self, split: SequenceSplit, chunk_layers: Sequence[Sequence[int]]) -> None:
        self.split = split
        self.chunk_layers = [tuple(layers) for layers in chunk_layers]
        self._inputs: list[MaskInputs] = []
        self._lengths: list[int] = []

    def cut(self, batches: list[dict]) -> list[dict]:
        """This rank's keyword arguments for each micro-batch of the window (its mask inputs kept)."""
        pieces = [self.split.cut_apart(batch) for batch in batches]
        self._inputs = [inputs for _, inputs in pieces]
        self._lengths = [_sequence_length(batch) for batch in batches]
        return [kwargs for kwargs, _ in pieces]

    @contextlib.contextmanager
    def around(self, action: Action) -> Iterator[None]:
        """Run a compute action of the schedule: its micro-batch's mask inputs in the attention; a
        forward's attention calls counted and checked against its chunk's layers."""
        attention = self.split.attention
        attention.inputs = self._inputs[action.microbatch]
        if action.kind != Kind.F:
            yield
            return
        attention.reset()
        yield
        self.split.check_calls(self.chunk_layers[action.chunk], self._lengths[action.microbatch])

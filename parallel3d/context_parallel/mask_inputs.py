"""What the cp attention needs of the whole micro-batch besides this rank's q, k and v.

The batch cutter (batch.py) finds it for each micro-batch and hands it to the attention before
the micro-batch's compute (``attention.inputs``; under pipeline stages around each of its
forward and backward actions, stages.py). Every rank of a cp group holds the whole micro-batch,
so these are whole rows, read at the global positions of the tokens an attention call holds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MaskInputs:
    """``padding`` [B, S] bool, False at padded tokens (an ``attention_mask`` with zeros), or None;
    ``documents`` [B, S] each token's document in packed rows (transformers'
    ``find_packed_sequence_indices``), or None: one document a row; ``positions`` [B, S] the rows'
    position ids (transformers' packed mask reads the causal rule through them)."""

    padding: torch.Tensor | None = None
    documents: torch.Tensor | None = None
    positions: torch.Tensor | None = None

    def problem(self, rows: int, length: int) -> str | None:
        """Why these do not fit ``rows`` rows of ``length`` tokens, or None."""
        for what, given in (("padding mask", self.padding), ("document ids", self.documents)):
            if given is not None and given.shape != (rows, length):
                return f"{what} of shape {tuple(given.shape)} for {rows} rows of {length} tokens"
        return None

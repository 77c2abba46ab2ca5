"""Cutting a micro-batch along the sequence for one context-parallel rank, and its loss divisor.

Every rank of a cp group is handed the same micro-batch (the whole sequences), as the ranks of
a tp group are, so a data loader does not change; the engine cuts it here before the forward:

* ``input_ids`` / ``inputs_embeds`` and the labels are cut along the sequence. Ulysses: into cp
  equal contiguous slices, rank r keeping slice r. Ring: into 2 x cp equal chunks, rank r keeping
  chunks r and 2cp-1-r (``ring.ring_index``: each rank gets as much causal work). The labels
  are shifted over the whole sequence first (``shift_labels``, which transformers' causal LM
  loss takes as given), so the last token of a piece keeps its target, the next token.
* ``position_ids`` are the global positions of the rank's tokens (RoPE sees the positions one
  process would). Position ids that restart inside a row (packed documents, without an
  ``attention_mask``, as transformers detects them): the whole rows' documents
  (``find_packed_sequence_indices``) and position ids go to the attention (``MaskInputs``),
  which keeps the documents apart as one process's mask does.
* An ``attention_mask`` of ones is dropped (it means no mask); one with zeros (padding, left or
  right) is not cut: the whole micro-batch's mask goes to the attention (Ulysses: into the
  full-sequence mask its kernel gets; ring: each block masks the padded keys it holds), and the
  model gets none. Padded tokens need labels -100, as for one process.

The loss: a rank's loss is its slice's summed token loss divided by ``num_items_in_batch``.
Under the default normalization (the mean per micro-batch) the divisor is the micro-batch's
label tokens over the whole sequence divided by cp, so each rank's loss is cp times its share
and the engine's mean over ``dp_cp`` (of losses and of gradients) is the one-process mean,
with the cp gradients summed. Under ``loss_normalization: "tokens"`` the divisor is already
the global count and the engine's factor ``dp_cp`` turns the mean into the sum.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import xxhash
from torch import nn

from parallel3d.context_parallel.mask_inputs import MaskInputs
from parallel3d.context_parallel.ring import RingAttention, ring_index
from parallel3d.context_parallel.ulysses import UlyssesAttention
from parallel3d.engine.batch_check import IGNORE_INDEX
from parallel3d.errors import ConfigError

_SEQUENCE_KEYS = ("input_ids", "inputs_embeds", "labels", "shift_labels", "position_ids", "attention_mask")


def _rows(batch: dict) -> int:
    present = [batch[key] for key in ("input_ids", "inputs_embeds") if isinstance(batch.get(key), torch.Tensor)]
    return present[0].shape[0]


def _sequence_length(batch: dict) -> int | None:
    for key in ("input_ids", "inputs_embeds"):
        if isinstance(batch.get(key), torch.Tensor):
            return batch[key].shape[1]
    return None


def _digest(batches: list) -> int:
    """A 62-bit digest (so that its negation fits an int64) of the micro-batches' tensors, bit for bit:
    each one's dtype, shape and bytes (XXH3, as the checkpoint's checksums)."""
    digest = xxhash.xxh3_64()
    for batch in batches:
        values = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (tuple, list)) else ()
        for value in values:
            if isinstance(value, torch.Tensor) and value.numel():
                digest.update(f"{value.dtype}{tuple(value.shape)}".encode())
                digest.update(value.detach().to("cpu").contiguous().flatten().view(torch.uint8).numpy())
    return digest.intdigest() >> 2


class SequenceSplit:
    """This rank's cut of each micro-batch (``cut``) and the forward around it (``run``)."""

    def __init__(self, attention: UlyssesAttention | RingAttention, rank: int, token_mean: bool, layers: int,
                 windowed_layers: tuple[tuple[int, ...], int | None] = ((), None)) -> None:
        self.attention = attention
        self.size = attention.size
        self.method = attention.method
        self.pieces = 2 * self.size if self.method == "ring" else self.size  # the length must divide by it
        self.rank = rank
        self.token_mean = token_mean
        self.layers = layers
        # ring: the indices of the layers whose sliding window it applies itself, and the window
        self.windowed_layers, self.window = frozenset(windowed_layers[0]), windowed_layers[1]
        self.length = 0  # the last cut's sequence length

    def problem(self, batch: Any) -> str | None:
        """Why ``batch`` cannot be cut (the same answer on every rank of the cp group), or None."""
        if not isinstance(batch, dict):
            return ("context_parallel needs each micro-batch as a dict of keyword arguments (input_ids, labels, ...), "
                    f"got a {type(batch).__name__}")
        length = _sequence_length(batch)
        if length is None:
            return "context_parallel needs input_ids or inputs_embeds in each micro-batch"
        if length % self.pieces:
            if self.method == "ring":
                return (f"the sequence length {length} is not divisible by 2 x context_parallel.size = {self.pieces} "
                        f"(ring attention cuts it into 2 x {self.size} chunks, rank r keeping chunks r and "
                        f"{2 * self.size - 1}-r); pad or cut the sequences to a multiple of {self.pieces}")
            return (f"the sequence length {length} is not divisible by context_parallel.size {self.size}; pad or "
                    f"cut the sequences to a multiple of {self.size}")
        for key in _SEQUENCE_KEYS:
            value = batch.get(key)
            if isinstance(value, torch.Tensor) and (value.dim() < 2 or value.shape[1] != length):
                return f"context_parallel: {key} has shape {tuple(value.shape)}, not [batch, {length}, ...]"
        mask = batch.get("attention_mask")
        if isinstance(mask, torch.Tensor) and (mask.dim() != 2 or not bool(((mask == 0) | (mask == 1)).all())):
            return (f"context_parallel takes an attention_mask of 0s and 1s shaped [batch, {length}] (padding), got "
                    f"shape {tuple(mask.shape)}" + ("" if mask.dim() != 2 else " with other values"))
        return None

    def differing(self, batches: list, device: torch.device) -> str | None:
        """Whether the cp group's ranks were handed different micro-batches (one all-reduce over cp):
        a loader that shards over every rank instead of over dp would otherwise train on pieces of
        unrelated sequences without a word. The ranks compare a digest of the tensors' bits, so a NaN
        (in inputs_embeds, say) agrees with itself."""
        total = _digest(batches)
        both = torch.tensor([total, -total], dtype=torch.int64, device=device)
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.attention.group)
        if bool(both[0] == -both[1]):
            return None
        return ("the ranks of a context-parallel group were handed different micro-batches; each of them must get the "
                "same micro-batch (the whole sequences), as tensor-parallel ranks do: shard the data over the "
                "data-parallel ranks only (engine.mesh.dp, engine.mesh.local_rank(\"dp\"))")

    def cut(self, batch: dict) -> dict:
        """This rank's keyword arguments for the model (see the module docstring); the attention is
        handed the micro-batch's padding and documents."""
        out, self.attention.inputs = self.cut_apart(batch)
        self.length = _sequence_length(batch)
        return out

    def cut_apart(self, batch: dict) -> tuple[dict, MaskInputs]:
        """This rank's keyword arguments for the model, and the whole micro-batch's padding and
        packed documents the attention needs, without handing them to it: pipeline stages cut a
        window's micro-batches before running any of them."""
        problem = self.problem(batch)
        if problem is not None:
            raise ConfigError(problem)
        length = _sequence_length(batch)
        device = batch.get("input_ids", batch.get("inputs_embeds")).device
        piece = (ring_index(self.rank, self.size, length, device) if self.method == "ring"
                 else slice(self.rank * length // self.size, (self.rank + 1) * length // self.size))
        out = {k: v for k, v in batch.items() if k not in _SEQUENCE_KEYS}
        for key in ("input_ids", "inputs_embeds"):
            if isinstance(batch.get(key), torch.Tensor):
                out[key] = batch[key][:, piece]
        positions = batch.get("position_ids")
        if not isinstance(positions, torch.Tensor):
            positions = torch.arange(length, device=device)[None]
        out["position_ids"] = positions[:, piece]
        mask = batch.get("attention_mask")
        padding = mask.bool() if isinstance(mask, torch.Tensor) and not bool(mask.bool().all()) else None
        inputs = MaskInputs(padding, self._documents(batch, positions), positions.expand(_rows(batch), -1))
        shifted = batch.get("shift_labels")
        if not isinstance(shifted, torch.Tensor) and isinstance(batch.get("labels"), torch.Tensor):
            shifted = nn.functional.pad(batch["labels"], (0, 1), value=IGNORE_INDEX)[..., 1:]
        if isinstance(shifted, torch.Tensor):
            out["shift_labels"] = out["labels"] = shifted[:, piece].contiguous()
            out["num_items_in_batch"] = self._divisor(shifted, batch.get("num_items_in_batch"))
        out["use_cache"] = False  # a cache of this rank's keys would be a slice of the sequence's
        return out, inputs

    @staticmethod
    def _documents(batch: dict, positions: torch.Tensor) -> torch.Tensor | None:
        """Each token's document when the rows are packed (position ids that do not rise by 1), as
        transformers finds them for one process: only without an attention mask (with one, one
        process attends across the documents, and so does the cp attention)."""
        from transformers.masking_utils import find_packed_sequence_indices

        if batch.get("attention_mask") is not None:
            return None
        rows = _rows(batch)
        return find_packed_sequence_indices(positions.expand(rows, -1))

    def _divisor(self, shifted: torch.Tensor, given: Any) -> Any:
        """``num_items_in_batch`` for this rank's loss (see the module docstring)."""
        if self.token_mean:
            return given
        count = given if given is not None else int((shifted != IGNORE_INDEX).sum().clamp_min(1))
        return count / self.size

    def run(self, module: Callable, kwargs: dict) -> Any:
        """The model's forward on this rank's cut, its attention calls checked (``check_calls``)."""
        self.attention.reset()
        output = module(**self.cut(kwargs))
        self.check_calls(range(self.layers), self.length)
        return output

    def check_calls(self, layers: Sequence[int], length: int) -> None:
        """Every attention layer of ``layers`` (global indices: the model's, or a pipeline stage's)
        went through the cp attention once since its last ``reset``, and, for ring, every
        sliding-window layer among them handed it its window (sequences of ``length`` tokens)."""
        if self.attention.calls != len(layers):
            raise ConfigError(f"context_parallel: the forward called the {self.method} attention "
                              f"{self.attention.calls} times for {len(layers)} layers of {self.attention.model_type}, "
                              "not once each: a layer that bypasses transformers' AttentionInterface would attend "
                              "within its slice only, and one that calls attention several times (differential "
                              "attention) is not reproduced")
        windowed = sum(index in self.windowed_layers for index in layers)
        window_matters = self.window is not None and self.window < length
        if self.method == "ring" and self.attention.windowed != windowed and window_matters:
            raise ConfigError(f"context_parallel (ring): {self.attention.model_type} has {windowed} "
                              f"sliding-window layers of {self.window} tokens, shorter than the sequence "
                              f"({length}), but {self.attention.windowed} attention calls passed a "
                              "sliding_window; a window applied through the mask alone would be lost (the ring builds "
                              "its own causal mask)")

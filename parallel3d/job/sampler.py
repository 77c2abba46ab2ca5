"""Training order: a seeded shuffle of the packed blocks, sharded over data-parallel ranks only.

Each epoch is a permutation of the block indices drawn from ``seed + epoch`` (a private
generator: the global RNG is not touched). The permutation is cut into *global* micro-batches
of ``dp x micro`` blocks; dp rank ``r`` takes the r-th slice of ``micro`` blocks of each.
Tensor- and pipeline-parallel ranks of one replica have the same dp rank, so they read the
same batches. An epoch is a whole number of optimizer steps (``gradient_accumulation_steps``
micro-batches each); the leftover blocks of an epoch are skipped.

The position (epoch, samples consumed) is all the state there is: stored in a checkpoint's
client_state, it makes a restarted run read exactly the blocks the uninterrupted run would
have read, with any data-parallel size: global micro-batch g of an epoch is the slice
``[g * dp * micro, (g + 1) * dp * micro)`` of the permutation, so every layout with the same
global batch (train_batch_size) reads the same blocks in each optimizer step.
"""

from __future__ import annotations

import numpy as np
import torch

from parallel3d.errors import ConfigError


class BlockSampler:
    """Which block indices dp rank ``dp_rank`` reads next, micro-batch by micro-batch."""

    def __init__(self, num_blocks: int, micro_batch: int, dp: int, dp_rank: int, grad_accum: int, seed: int) -> None:
        self.num_blocks, self.micro, self.dp, self.dp_rank = num_blocks, micro_batch, dp, dp_rank
        self.grad_accum, self.seed = grad_accum, seed
        self.micro_per_epoch = num_blocks // (dp * micro_batch) // grad_accum * grad_accum
        if self.micro_per_epoch == 0:
            raise ConfigError(
                f"data: the training split has {num_blocks} blocks, fewer than one optimizer step needs "
                f"(train_micro_batch_size_per_gpu {micro_batch} x gradient_accumulation_steps {grad_accum} "
                f"x data-parallel size {dp} = {micro_batch * grad_accum * dp}); use more data or a smaller "
                "batch or data.seq_len")
        self.epoch = 0
        self.position = 0  # micro-batches of this epoch already read (by every rank)
        self._perm: np.ndarray | None = None

    @property
    def steps_per_epoch(self) -> int:
        return self.micro_per_epoch // self.grad_accum

    def permutation(self, epoch: int) -> np.ndarray:
        g = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.num_blocks, generator=g).numpy()

    def next_indices(self) -> list[int]:
        if self.position == self.micro_per_epoch:
            self.epoch, self.position, self._perm = self.epoch + 1, 0, None
        if self._perm is None:
            self._perm = self.permutation(self.epoch)
        start = (self.position * self.dp + self.dp_rank) * self.micro
        self.position += 1
        return self._perm[start : start + self.micro].tolist()

    @property
    def epochs_done(self) -> float:
        return self.epoch + self.position / self.micro_per_epoch

    def state_dict(self) -> dict:
        """The position in global terms (samples of this epoch read by all ranks), so a run that
        resumes with another data-parallel size or micro-batch reads exactly the next blocks."""
        return {"epoch": self.epoch, "samples": self.position * self.dp * self.micro, "seed": self.seed,
                "num_blocks": self.num_blocks, "train_batch_size": self.dp * self.micro * self.grad_accum}

    def load_state_dict(self, state: dict) -> None:
        mine = self.state_dict()
        for key in ("seed", "num_blocks", "train_batch_size"):
            if state.get(key) != mine[key]:
                raise ConfigError(
                    f"cannot resume the data position: the checkpoint's {key} is {state.get(key)} but this run's is "
                    f"{mine[key]} (the data, train.seed or the global batch size changed since it was written)")
        # a checkpoint ends an optimizer step, so its samples are a whole number of global batches
        self.epoch, self.position, self._perm = int(state["epoch"]), int(state["samples"]) // (self.dp * self.micro), None


def model_batch(rows: dict) -> dict:
    """Model arguments from a slice of blocks: input_ids and labels (the ids themselves unless the
    blocks hold labels); with position_ids (whole documents packed, parallel3d/job/packing.py) also
    ``use_cache=False``, without which transformers skips the packed-document mask."""
    tensors = {k: torch.from_numpy(np.asarray(v, dtype=np.int64)) for k, v in rows.items()}
    batch = {"input_ids": tensors["input_ids"], "labels": tensors.get("labels", tensors["input_ids"].clone())}
    if "position_ids" in tensors:
        batch.update(position_ids=tensors["position_ids"], use_cache=False)
    return batch


class TrainLoader:
    """Iterator of micro-batch dicts (input_ids, labels[, position_ids]) for `Engine.train_batch`."""

    def __init__(self, blocks, sampler: BlockSampler) -> None:
        self.blocks = blocks.with_format("numpy")
        self.sampler = sampler

    def __iter__(self) -> "TrainLoader":
        return self

    def __next__(self) -> dict:
        return model_batch(self.blocks[self.sampler.next_indices()])


def eval_batches(blocks, micro_batch: int, dp: int, dp_rank: int, max_batches: int | None):
    """This dp rank's validation micro-batches, in a fixed order; every rank gets the same count."""
    blocks = blocks.with_format("numpy")
    n = len(blocks) // (dp * micro_batch)
    if max_batches is not None:
        n = min(n, max_batches)
    for b in range(n):
        start = (b * dp + dp_rank) * micro_batch
        yield model_batch(blocks[start : start + micro_batch])

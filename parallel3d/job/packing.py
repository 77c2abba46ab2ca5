"""Packing whole documents into blocks that keep them apart.

    blocks, cut, dropped = pack_whole(docs, seq_len, pad_id)   # blocks: [{"input_ids", "labels", "position_ids"}, ...]

Documents (each an ``input_ids`` list with its ``labels``) are placed in order into blocks of
``seq_len`` tokens; one that does not fit in what is left of the current block starts the
next, and the rest of the block is padding (``pad_id``, labels -100) that is a document of its
own. A document longer than ``seq_len`` is cut to its first ``seq_len`` tokens; one left with no
trained label (a conversation whose assistant turn starts after the cut) is dropped, since a
block of -100 labels only has a mean loss of 0/0 = NaN under the per-micro-batch mean. In each block
``position_ids`` restart at 0 at every document, which is how transformers finds the documents
(models/packed_attention.py: the block-diagonal mask, or flash attention's varlen boundaries),
and each document's first label is -100: its first token would otherwise be the target of
the previous document's last one.
"""

from __future__ import annotations

from collections.abc import Iterable

from parallel3d.engine.batch_check import IGNORE_INDEX


def _block(parts: list[tuple[list[int], list[int]]], seq_len: int, pad_id: int) -> dict[str, list[int]]:
    ids, labels, positions = [], [], []
    for doc_ids, doc_labels in parts:
        ids += doc_ids
        labels += [IGNORE_INDEX] + doc_labels[1:]
        positions += range(len(doc_ids))
    pad = seq_len - len(ids)
    return {"input_ids": ids + [pad_id] * pad, "labels": labels + [IGNORE_INDEX] * pad,
            "position_ids": positions + list(range(pad))}


def has_trained_label(labels: list[int]) -> bool:
    """Whether a document has a label its block trains on (its first label is always -100 there)."""
    return any(label != IGNORE_INDEX for label in labels[1:])


def pack_whole(docs: Iterable[tuple[list[int], list[int]]], seq_len: int,
               pad_id: int) -> tuple[list[dict], int, int]:
    """Blocks of whole documents (in order), how many documents were cut to ``seq_len``, and how
    many were dropped for having no trained label (after the cut)."""
    blocks, current, used, cut, dropped = [], [], 0, 0, 0
    for ids, labels in docs:
        if len(ids) > seq_len:
            ids, labels, cut = ids[:seq_len], labels[:seq_len], cut + 1
        if not has_trained_label(labels):
            dropped += 1
            continue
        if used + len(ids) > seq_len:
            blocks.append(_block(current, seq_len, pad_id))
            current, used = [], 0
        current.append((ids, labels))
        used += len(ids)
    if current:
        blocks.append(_block(current, seq_len, pad_id))
    return blocks, cut, dropped

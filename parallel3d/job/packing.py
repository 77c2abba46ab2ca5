"""Packing whole documents into blocks that keep them apart.

    blocks = pack_whole(docs, seq_len, pad_id)   # [{"input_ids", "labels", "position_ids"}, ...]

Documents (each an ``input_ids`` list with its ``labels``) are placed in order into blocks of
``seq_len`` tokens; one that does not fit in what is left of the current block starts the
next, and the rest of the block is padding (``pad_id``, labels -100) that is a document of its
own. A document longer than ``seq_len`` is cut to its first ``seq_len`` tokens. In each block
``position_ids`` restart at 0 at every document, which is how transformers finds the documents
(models/packed_attention.py: the block-diagonal mask, or flash attention's varlen boundaries),
and each document's first label is -100: its first token would otherwise be the target of
the previous document's last one.
"""

from __future__ import annotations

from collections.abc import Iterable

IGNORE_INDEX = -100


def _block(parts: list[tuple[list[int], list[int]]], seq_len: int, pad_id: int) -> dict[str, list[int]]:
    ids, labels, positions = [], [], []
    for doc_ids, doc_labels in parts:
        ids += doc_ids
        labels += [IGNORE_INDEX] + doc_labels[1:]
        positions += range(len(doc_ids))
    pad = seq_len - len(ids)
    return {"input_ids": ids + [pad_id] * pad, "labels": labels + [IGNORE_INDEX] * pad,
            "position_ids": positions + list(range(pad))}


def pack_whole(docs: Iterable[tuple[list[int], list[int]]], seq_len: int, pad_id: int) -> tuple[list[dict], int]:
    """Blocks of whole documents (in order) and how many documents were cut to ``seq_len``."""
    blocks, current, used, cut = [], [], 0, 0
    for ids, labels in docs:
        if len(ids) > seq_len:
            ids, labels, cut = ids[:seq_len], labels[:seq_len], cut + 1
        if used + len(ids) > seq_len:
            blocks.append(_block(current, seq_len, pad_id))
            current, used = [], 0
        current.append((ids, labels))
        used += len(ids)
    if current:
        blocks.append(_block(current, seq_len, pad_id))
    return blocks, cut

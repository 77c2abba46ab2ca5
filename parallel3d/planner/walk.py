"""`memory.rank_peak`'s walk of a long schedule table, as array arithmetic.

The walk keeps three running sums (activations alive, posted receive buffers, input gradients
waiting for their send) and one switch (the gradient buffers exist from the first backward on),
and takes the largest total at each compute pass. Each sum is a prefix sum of what every action
adds, so the totals of all passes come out of a few numpy operations, and the first pass with
the largest total is ``argmax``'s. A plan prices thousands of layouts whose pipeline tables have
hundreds to thousands of actions; walking them one action at a time in Python took most of a
7B Llama's search. The result is the Python walk's exactly (integers throughout, ties to the
earliest pass); tests/test_planner_walk.py compares the two on every schedule.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from parallel3d.pipeline.actions import Kind

_CODES = {Kind.F: 0, Kind.B: 1, Kind.W: 2, Kind.RECV_F: 3, Kind.RECV_B: 3, Kind.SEND_B: 4, Kind.SEND_F: 5}
_LABEL = {0: "F", 1: "B", 2: "W"}


@dataclass(frozen=True, eq=False)
class TableArrays:
    """A rank's table as arrays: action codes (``_CODES``), chunks and micro-batches; and the chunks
    its compute passes run (sorted)."""

    code: np.ndarray
    chunk: np.ndarray
    microbatch: np.ndarray
    split: bool
    chunks: tuple[int, ...] = ()


def table_arrays(table: list) -> TableArrays:
    """The arrays of ``table``, kept on it when it can hold them (`memory.RankTable`)."""
    known = getattr(table, "arrays", None)
    if known is not None:
        return known
    code = np.fromiter((_CODES[a.kind] for a in table), np.int8, len(table))
    chunk = np.fromiter((a.chunk for a in table), np.int64, len(table))
    arrays = TableArrays(code, chunk, np.fromiter((a.microbatch for a in table), np.int64, len(table)),
                         any(a.kind == Kind.W for a in table), tuple(np.unique(chunk[code <= 2]).tolist()))
    try:
        table.arrays = arrays
    except AttributeError:  # a plain list
        pass
    return arrays


class _Same:
    """A cache key of objects compared by identity (profiles need not be hashable); the cache
    holding them keeps them alive, so no other object can take their ids while the entry lives."""

    __slots__ = ("items", "_hash")

    def __init__(self, items: tuple) -> None:
        self.items = items
        self._hash = hash(tuple(map(id, items)))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Same) and len(other.items) == len(self.items) and all(
            a is b for a, b in zip(self.items, other.items))


@dataclass(frozen=True, eq=False)
class _Walk:
    """What a walk of one table with one set of chunk profiles gives before ZeRO's settings enter:
    per action, the pass's activations and buffers, whether its peak is inside a block, and
    the two masks of the passes before the gradients exist (full buffers or reduced shards)."""

    compute: np.ndarray
    activations: tuple[np.ndarray, np.ndarray]  # (extra without staging, backward passes' staging floor)
    buffers: np.ndarray
    block: np.ndarray
    before: dict[bool, np.ndarray]


@lru_cache(maxsize=256)
def _walk(key: _Same, hidden: int) -> _Walk:
    t: TableArrays = key.items[0]
    profiles = key.items[1:]
    code, c = t.code, t.chunk
    is_f, is_b, is_w = code == 0, code == 1, code == 2
    compute = is_f | is_b | is_w
    v = _per_chunk(dict(zip(t.chunks, profiles)).__getitem__, np.asarray(t.chunks, dtype=np.int64), t.split)
    h = hidden
    cc = np.where(compute, c, 0)
    pending = np.cumsum(h * (code == 3) - h * (is_f & (v["recv_in"][cc] == 1)) - h * (is_b & (v["grad_in"][cc] == 1)))
    sends = -h * (code == 4) + h * (is_b & (v["sends"][cc] == 1))
    waiting = np.cumsum(sends) - sends
    at_rest, held_w = v["at_rest"][cc], v["held_w"][cc]
    live_delta = np.where(is_f, at_rest, 0) + np.where(is_b, (held_w - at_rest) if t.split else -at_rest, 0) \
        - np.where(is_w, held_w, 0)
    live = np.cumsum(live_delta) - live_delta
    # a backward (or weight) pass holds max(its own peak, its first gradient + the staging buffers)
    own = np.where(is_b, v["during_b"][cc], 0) + np.where(is_w, v["during_w"][cc], 0)
    floor = np.where(is_b & (not t.split) | is_w, v["after_first_grad"][cc], np.iinfo(np.int64).min // 2)
    base = np.where(is_f, live + v["forward_peak"][cc], 0) + np.where(is_b, live - at_rest, 0) \
        + np.where(is_w, live - held_w, 0)
    block = np.where(is_f, v["forward_in"][cc], v["backward_in"][cc]) == 1
    n = len(code)
    index = np.arange(n)
    reset_after = (is_b & (not t.split)) | is_w
    first_after = int(index[reset_after][0]) if reset_after.any() else n
    before = {}
    for full in (False, True):
        reset_before = (is_b & full & (not t.split)) | (is_w & full)
        first_before = int(index[reset_before][0]) if reset_before.any() else n
        before[full] = (index < first_before) & (index <= first_after)
    return _Walk(compute, (base, own, floor), pending + waiting, block, before)


def _per_chunk(chunk: Callable, ids: np.ndarray, split: bool) -> dict[str, np.ndarray]:
    """What the walk reads of each chunk's profile, indexed by chunk id."""
    size = int(ids.max()) + 1 if len(ids) else 0
    names = ("at_rest", "forward_peak", "forward_in", "backward_in", "during_b", "held_w", "during_w",
             "recv_in", "grad_in", "sends", "after_first_grad")
    out = {name: np.zeros(size, dtype=np.int64) for name in names}
    for c in ids.tolist():
        p = chunk(c)
        out["at_rest"][c], out["forward_peak"][c] = p.at_rest, p.forward_peak
        out["forward_in"][c], out["backward_in"][c] = bool(p.forward_peak_in_block), bool(p.backward_peak_in_block)
        out["recv_in"][c] = out["sends"][c] = p.kind in ("middle", "last")
        out["grad_in"][c] = p.kind in ("first", "middle")
        out["after_first_grad"][c] = p.after_first_grad
        if split:
            out["during_b"][c], out["held_w"][c] = p.input_grad_peak, p.held_for_weights
            out["during_w"][c] = p.weight_grad_peak
        else:
            out["during_b"][c] = p.backward_peak
    return out


def best_pass(table: list, chunk: Callable, hidden_bytes: int, staging_bytes: int, *, full_grads: bool,
              base: int, no_grads: int, held: int, in_block: int) -> tuple[int, int, int, int, str] | None:
    """The first compute pass with the largest total: (total, gathered, activations, buffers, where),
    or None for a table without compute passes. ``base`` is the static bytes plus nothing else;
    ``no_grads`` the gradient bytes not yet allocated before the first backward.

    The walk of a table with a set of chunk profiles is computed once (``_walk``) and shared by
    every ZeRO setting that prices it; ``staging_bytes`` and the ZeRO terms are added here."""
    t = table_arrays(table)
    if not t.chunks:
        return None
    w = _walk(_Same((t, *(chunk(c) for c in t.chunks))), hidden_bytes)
    start, own, floor = w.activations
    extra = start + np.maximum(own, floor + staging_bytes)
    total = base - no_grads * w.before[full_grads] + held + in_block * w.block + extra + w.buffers
    total = np.where(w.compute, total, np.iinfo(np.int64).min)
    i = int(np.argmax(total))
    label = f"{_LABEL[int(t.code[i])]}{int(t.microbatch[i])}.{int(t.chunk[i])}"
    return int(total[i]), held + (in_block if w.block[i] else 0), int(extra[i]), int(w.buffers[i]), label

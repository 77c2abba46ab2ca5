"""Run 2 of the init replay: computing what the plan needs, drawing the rest into scratch.

See :mod:`models.init_trace` for the whole design; this module holds the two classes that
hold real values: :class:`Executor` (run 2, driven by a :class:`~models.init_trace.Plan`) and
:class:`ValuedRecorder` (run 1 for constructions that branch on drawn values).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.utils import _pytree as pytree

from models.init_trace import _CPU, OpRecord, Plan, Trace, TraceError, _tensors, covers_storage

# Draws whose values on a contiguous CPU tensor do not depend on how the tensor is cut, as
# long as every piece but the last is a multiple of 16 elements and the last has at least 16:
# ``uniform_`` draws element by element; ``normal_`` (numel >= 16) transforms uniforms in
# blocks of 16 and redraws the last 16 of a ragged tail. Checked by
# tests/test_init_replay_chunks.py against whole draws, values and generator state alike.
_CHUNKABLE_DRAWS = frozenset({torch.ops.aten.normal_.default, torch.ops.aten.uniform_.default})
DRAW_CHUNK_BYTES = 1 << 20
"""A draw over two pieces runs in pieces of about this size, so its scratch never holds the
whole tensor. 1 MiB, not 4: a 6 MiB MLP weight of benchmark model B was drawn whole with 4 MiB
pieces, and that scratch was still resident when the rank's last shard pages arrived (8-9 MiB
of its peak RSS, measured with scripts/bench_init.py); the extra calls cost nothing measurable."""


def draw_pieces(numel: int, row: int, itemsize: int, chunk_bytes: int | None = None) -> list[tuple[int, int]]:
    """Row ranges ``[(r0, r1), ...]`` covering ``numel // row`` rows; each piece but the last is
    a multiple of 16 elements, the last at least 16 (or the whole tensor)."""
    chunk_bytes = DRAW_CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    rows = numel // row
    step = 16 // math.gcd(row, 16)  # rows per 16-element multiple
    per = max(step, chunk_bytes // max(row * itemsize, 1) // step * step)
    pieces, r0 = [], 0
    while r0 < rows:
        r1 = min(rows, r0 + per)
        if (rows - r1) * row < 16:
            r1 = rows
        pieces.append((r0, r1))
        r0 = r1
    return pieces


def _chunkable(func, args, kwargs, chunk_bytes: int) -> torch.Tensor | None:
    """The tensor a draw writes, if it may be drawn in pieces and is worth it."""
    if func not in _CHUNKABLE_DRAWS or kwargs.get("generator") is not None:
        return None
    t = args[0]
    if not t.is_contiguous() or t.numel() * t.element_size() <= 2 * chunk_bytes:
        return None
    return t


@dataclass
class Stats:
    ops: int = 0
    computed_ops: int = 0
    scratch_random_ops: int = 0
    shadow_bytes: int = 0  # live shadows plus the spare buffer
    peak_bytes: int = 0  # the most shadow + scratch bytes alive at once (values handed back not counted)
    emitted_bytes: int = 0
    spare_bytes: int = 0  # the largest storage ever kept for reuse


def spare_limit() -> int:
    """The largest freed storage kept for reuse: a few draw pieces (larger ones go back to the allocator)."""
    return 4 * DRAW_CHUNK_BYTES


class Executor(Trace):
    """Run 2: compute what the plan needs on CPU shadows; emit requested storages when final.

    ``emit(sid, executor) -> bool`` is called right after the last op that touches a requested
    storage; it reads the value with :meth:`view_as` and returns whether it kept the storage
    itself (zero-copy hand-off), otherwise the storage is recycled.

    ``stream`` (optional) takes a requested tensor whose last op is a large chunkable draw
    (:data:`_CHUNKABLE_DRAWS`) piece by piece instead: ``stream.row_size(sid)`` says how many
    elements make one of its rows (``None``: not streamable), and ``stream.rows(sid, r0, r1,
    values)`` receives rows ``[r0, r1)`` as a flat tensor, the last call ending at the last
    row. The whole tensor is then never held: one piece of scratch is.

    One *spare* storage, the largest freed so far up to :func:`spare_limit`, is recycled for
    the next shadow or scratch that fits: with fresh allocations per op, glibc's heap grew by
    every layer's draws (measured: RSS +52 MB while at most 9 MB were alive, for a 54 MB model),
    and page faults on fresh buffers cost more than the draws themselves. A larger storage (a
    tensor held whole: an embedding whose ``padding_idx`` row is zeroed after its draw) is
    freed instead of kept: kept, its pages stayed resident to the end of the replay, when the
    rank's shards are all filled, and added the whole tensor to the rank's peak.
    """

    def __init__(self, records: list[OpRecord], the_plan: Plan, emit, stream=None,
                 chunk_bytes: int | None = None) -> None:
        super().__init__()
        # smaller in the self-check, so a small model's draws are cut in pieces too
        self.chunk_bytes = DRAW_CHUNK_BYTES if chunk_bytes is None else chunk_bytes
        self.records = records
        self.the_plan = the_plan
        self.emit = emit
        self.stream = stream
        self.shadows: dict[int, torch.UntypedStorage] = {}
        self.spare: torch.UntypedStorage | None = None
        self.stats = Stats()

    # ------------------------------------------------------------ memory

    def _track(self, extra: int = 0) -> None:
        self.stats.peak_bytes = max(self.stats.peak_bytes, self.stats.shadow_bytes + extra)

    def _take(self, nbytes: int) -> torch.UntypedStorage:
        spare = self.spare
        if spare is not None and nbytes <= spare.nbytes():
            self.spare = None
            self.stats.shadow_bytes -= spare.nbytes()
            return spare
        return torch.UntypedStorage(nbytes, device=_CPU)

    def _release(self, st: torch.UntypedStorage) -> None:
        if st.nbytes() > spare_limit():
            return  # dropped: back to the allocator (glibc unmaps a large block at once)
        if self.spare is None or st.nbytes() > self.spare.nbytes():
            if self.spare is not None:
                self.stats.shadow_bytes -= self.spare.nbytes()
            self.spare = st
            self.stats.shadow_bytes += st.nbytes()
            self.stats.spare_bytes = max(self.stats.spare_bytes, st.nbytes())

    def _set_shadow(self, sid: int, st: torch.UntypedStorage) -> None:
        self._free(sid)
        self.shadows[sid] = st
        self.stats.shadow_bytes += st.nbytes()
        self._track()

    def _free(self, sid: int, *, handed_off: bool = False) -> None:
        st = self.shadows.pop(sid, None)
        if st is not None:
            self.stats.shadow_bytes -= st.nbytes()
            if not handed_off:
                self._release(st)

    def view(self, sid: int, like: torch.Tensor) -> torch.Tensor:
        """The shadow of meta tensor ``like`` (whose storage is ``sid``)."""
        return self.view_as(sid, like.dtype, like.size(), like.stride(), like.storage_offset())

    def view_as(self, sid: int, dtype, size, stride, offset) -> torch.Tensor:
        return _on(self.shadows[sid], dtype, size, stride, offset)

    # ------------------------------------------------------------ ops

    def after(self, k, rec, func, args, kwargs, out, fresh):
        if k >= len(self.records) or self.records[k].name != rec.name:
            expected = self.records[k].name if k < len(self.records) else "the end of the program"
            raise TraceError(f"construction differs between two runs at op {k}: {rec.name} vs {expected}")
        p = self.the_plan
        self.stats.ops += 1
        streamed = None
        if p.needed[k]:
            self.stats.computed_ops += 1
            streamed = self._streamed_draw(k, rec, func, args, kwargs)
            if streamed is None:
                out = self._compute(k, rec, func, args, kwargs, out, fresh)
        elif p.run_random[k]:
            self.stats.scratch_random_ops += 1
            self._draw(rec, func, args, kwargs)
        for s in p.emit_after.get(k, ()):
            if s != streamed:
                self._free(s, handed_off=bool(self.emit(s, self)))
        for s in p.free_after.get(k, ()):
            self._free(s)
        return out

    def _compute(self, k, rec, func, args, kwargs, out, fresh):
        writes, reads = set(rec.writes), set(rec.reads)

        def real(x):
            if isinstance(x, torch.Tensor) and x.is_meta:
                s = self.sid(x)
                if s not in self.shadows and s not in writes and s not in reads:
                    # only its metadata matters (ones_like(x)): an untouched allocation, no pages
                    return torch.empty_strided(x.size(), x.stride(), dtype=x.dtype, device=_CPU)
                if s not in self.shadows:
                    if s not in writes:
                        raise TraceError(
                            f"op {k} ({rec.name}) reads a meta tensor that has no value here; it was made "
                            "outside the replayed construction (a cached tensor?)"
                        )
                    self._set_shadow(s, self._take(x.untyped_storage().nbytes()))
                return self.view(s, x)
            if isinstance(x, torch.device) and x.type == "meta":
                return _CPU
            return x

        real_args, real_kwargs = pytree.tree_map(real, (args, kwargs))
        res = func(*real_args, **real_kwargs)
        by_meta = {id(m): r for m, r in zip(_tensors(out), _tensors(res))}
        for m, s in fresh:
            self._adopt(s, m, by_meta[id(m)])
        return res if rec.observer else out

    def _streamed_draw(self, k, rec, func, args, kwargs) -> int | None:
        """Draw a requested tensor's final values in pieces, handing each to ``stream``.

        Only for a chunkable draw that writes a whole storage which is final right after it
        (the usual ``normal_`` of ``_init_weights``); returns its storage id, else ``None``.
        """
        t = _chunkable(func, args, kwargs, self.chunk_bytes) if self.stream is not None else None
        if t is None or not covers_storage(t) or rec.overwrites != rec.writes or len(rec.writes) != 1:
            return None
        sid = rec.writes[0]
        if self.the_plan.emit_after.get(k) != [sid] or self.the_plan.free_after.get(k):
            return None
        row = self.stream.row_size(sid, t.numel())
        if row is None:
            return None
        self._free(sid)
        self._in_pieces(func, t, row, args, kwargs, lambda r0, r1, values: self.stream.rows(sid, r0, r1, values))
        return sid

    def _in_pieces(self, func, t: torch.Tensor, row: int, args, kwargs, each=None) -> None:
        """Run draw ``func`` over ``t``'s elements piece by piece in one reused scratch buffer."""
        pieces = draw_pieces(t.numel(), row, t.element_size(), self.chunk_bytes)
        largest = max(r1 - r0 for r0, r1 in pieces) * row
        buffer = self._take(largest * t.element_size())
        self._track(buffer.nbytes())
        flat = _on(buffer, t.dtype, (largest,), (1,), 0)
        for r0, r1 in pieces:
            piece = flat[: (r1 - r0) * row]
            func(piece, *args[1:], **kwargs)
            if each is not None:
                each(r0, r1, piece)
        self._release(buffer)

    def _draw(self, rec, func, args, kwargs) -> None:
        """A random op nobody needs: draw into scratch so the generator advances as in eager."""
        t = _chunkable(func, args, kwargs, self.chunk_bytes)
        if t is not None:
            self._in_pieces(func, t, 1, args, kwargs)
            return
        mutated = set(rec.writes) - set(rec.input_reads)
        taken: list[torch.UntypedStorage] = []

        def scratch_or_shadow(x):
            if isinstance(x, torch.Tensor) and x.is_meta:
                s = self.sid(x)
                if s not in mutated and s in self.shadows:
                    return self.view(s, x)
                taken.append(self._take(x.untyped_storage().nbytes()))
                return _on(taken[-1], x.dtype, x.size(), x.stride(), x.storage_offset())
            if isinstance(x, torch.device) and x.type == "meta":
                return _CPU
            return x

        real_args, real_kwargs = pytree.tree_map(scratch_or_shadow, (args, kwargs))
        res = func(*real_args, **real_kwargs)
        made = {st.data_ptr() for st in taken}
        extra = sum(st.nbytes() for st in taken) + sum(
            t.untyped_storage().nbytes() for t in _tensors(res) if t.untyped_storage().data_ptr() not in made
        )
        self._track(extra)
        del res, real_args, real_kwargs
        for st in taken:
            self._release(st)

    def _adopt(self, sid: int, meta: torch.Tensor, real: torch.Tensor) -> None:
        nbytes = meta.untyped_storage().nbytes()
        if (
            real.device == _CPU
            and real.dtype == meta.dtype
            and real.stride() == meta.stride()
            and real.storage_offset() == meta.storage_offset()
            and real.untyped_storage().nbytes() == nbytes
        ):
            self._set_shadow(sid, real.untyped_storage())
        else:
            self._set_shadow(sid, self._take(nbytes))
            self.view(sid, meta).copy_(real)


def _on(storage: torch.UntypedStorage, dtype, size, stride, offset) -> torch.Tensor:
    return torch.empty(0, dtype=dtype, device=_CPU).set_(storage, offset, size, stride)


class ValuedRecorder(Executor):
    """Run 1 for a construction that branches on values it draws.

    torch 2.13's ``trunc_normal_`` is a rejection sampler: it draws, tests
    ``(x < lo) | (x > hi)``, and draws again while any value is out of range, so how far
    the generator advances depends on the values. This recorder draws everything for real,
    exactly as eager does (on a forked generator), and computes every op whose inputs it
    still holds, keeping the most recently used shadows within a budget of a few tensors
    (values that fell out are unknown; an op on them is skipped, a draw goes to scratch).
    Observers answer from the shadows, so the recorded program takes eager's branches; run 2
    then needs those values too, and the plan computes them.
    """

    def __init__(self) -> None:
        super().__init__([], None, None)
        self._lru: dict[int, None] = {}
        self._largest = 0

    def after(self, k, rec, func, args, kwargs, out, fresh):
        self.records.append(rec)
        self.stats.ops += 1
        known = all(s in self.shadows for s in rec.reads)
        if known:
            out = self._compute(k, rec, func, args, kwargs, out, fresh)
            for s in rec.reads + rec.writes:
                self._touch(s)
        else:
            if rec.observer:
                raise TraceError(
                    f"op {k} ({rec.name}) branches on a value the replay no longer holds; "
                    "this construction cannot be replayed within the memory budget"
                )
            if rec.random:
                self._draw(rec, func, args, kwargs)
            for s in rec.writes:
                self._free(s)
                self._lru.pop(s, None)
        self._evict()
        return out

    def _touch(self, sid: int) -> None:
        if sid in self.shadows:
            self._lru.pop(sid, None)
            self._lru[sid] = None
            self._largest = max(self._largest, self.shadows[sid].nbytes())

    def _evict(self) -> None:
        budget = 3 * self._largest + (64 << 20)
        while self.stats.shadow_bytes > budget and self._lru:
            sid = next(iter(self._lru))
            del self._lru[sid]
            self._free(sid)

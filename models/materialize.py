"""Values for a meta-device model equal, bit for bit, to those eager construction gives.

``with torch.device("meta"): model = AutoModelForCausalLM.from_config(cfg)`` builds no values;
``torch.manual_seed(s); AutoModelForCausalLM.from_config(cfg)`` builds the values every layout
must start from. :class:`InitReplay` gives the second's values, one rectangle at a time, while
holding about one tensor in flight.

How (see :mod:`models.init_trace`): the model's own construction is run again, on the meta
device, with every random op mirrored onto a real CPU tensor of the same size, strides and
dtype, so the global CPU generator advances exactly as it does in eager construction (the
construction-time ``reset_parameters`` draws of ``nn.Linear``/``nn.Embedding`` included), and
the values of the tensors asked for are computed on CPU only from their last full overwrite
to the moment they are final. Nothing is special-cased per family: whatever the model's
``__init__``, ``post_init`` and ``_init_weights`` do is what runs.

What transformers 5.23 does, for the record (``modeling_utils.py``):
``AutoModelForCausalLM.from_config`` calls ``cls._from_config(config)`` (1393), which runs
``cls(config)`` under the config's dtype. Each ``PreTrainedModel.__init__`` ends in
``post_init`` (1289) -> ``init_weights`` (3098), which calls ``initialize_weights`` (2388: a
post-order ``smart_apply`` of ``_initialize_weights``, 2361, which skips modules already
flagged ``_is_hf_initialized``) *unless* ``get_torch_context_manager_or_global_device()``
(243, which tests ``torch.tensor([]).device``) is meta, then ``tie_weights`` (2530: a
``setattr`` of the source Parameter, so tied weights are one Parameter). Modules' own
constructors (``nn.Linear.reset_parameters``) draw from the generator first, and the inner
model's ``post_init`` runs before the head is even constructed. Building under
``torch.device("meta")`` draws nothing.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from models.anatomy import tied_parameter_names
from models.init_execute import Executor, Stats, ValuedRecorder
from models.init_programs import (
    MaterializeError,
    MetaBuildDrewError,
    NoInitializerError,
    ReplayMismatchError,
    TensorEntry,
    UninitializedTensorError,
    _entries,
    _hf_program,
    _is_hf,
    _plain_program,
    _structure,
)
from models.init_self_check import verify_replay
from models.init_trace import MetaConstructors, NeedsValues, Recorder, TraceError, missing_torch_details, plan
from models.tensor_source import Rect, Requests, normalize_rect, rect_shape, whole


def _check_cpu_default() -> None:
    # Eager construction on the CPU is what is reproduced; under ``torch.device("meta")``
    # transformers would skip its init, and under a CUDA default it would draw from another
    # generator.
    device = torch.get_default_device()
    if device.type != "cpu":
        raise MaterializeError(
            f"InitReplay reproduces construction on the CPU, but the default device is {device} "
            '(inside `with torch.device("meta")`?); build on meta first, then create and read the '
            "InitReplay outside that block"
        )


def _owns_storage(full: torch.Tensor, rects: list, storage: torch.UntypedStorage) -> bool:
    """Whether handing back ``full`` itself answers ``rects`` (one whole, contiguous rectangle)."""
    return (
        len(rects) == 1
        and all(s.start == 0 and s.stop == n for s, n in zip(rects[0], full.shape))
        and full.is_contiguous()
        and full.storage_offset() == 0
        and full.nbytes == storage.nbytes()
    )


class _RowStream:
    """Takes a requested tensor drawn in row pieces (see ``Executor``'s ``stream``): copies each
    piece's part of every rectangle asked for, and delivers the tensor after its last row."""

    def __init__(self, jobs: dict, dests, deliver) -> None:
        self.jobs, self.dests, self.deliver = jobs, dests, deliver
        self.partial: dict[str, list[torch.Tensor]] = {}
        self.stats: Stats | None = None

    def row_size(self, sid: int, numel: int) -> int | None:
        mine = self.jobs.get(sid, ())
        if not mine or any(not _contiguous_whole(e, numel) for _, e, _ in mine):
            return None
        return math.prod(mine[0][1].shape[1:])

    def rows(self, sid: int, r0: int, r1: int, values: torch.Tensor) -> None:
        last = r1 == self.jobs[sid][0][1].shape[0]
        for name, e, rects in self.jobs.pop(sid) if last else self.jobs[sid]:
            block = values.view(r1 - r0, *e.shape[1:])
            if self.dests is not None:
                targets = self.dests[name]
            else:
                targets = self.partial.setdefault(
                    name, [torch.empty(rect_shape(r), dtype=e.dtype) for r in rects])
            for rect, target in zip(rects, targets):
                lo, hi = max(rect[0].start, r0), min(rect[0].stop, r1)
                if lo < hi:
                    target[lo - rect[0].start : hi - rect[0].start].copy_(block[(slice(lo - r0, hi - r0), *rect[1:])])
            if last:
                values_out = self.partial.pop(name, None)
                if values_out is not None and self.stats is not None:
                    self.stats.emitted_bytes += sum(v.nbytes for v in values_out)
                self.deliver(name, values_out)


def _contiguous_whole(e: TensorEntry, numel: int) -> bool:
    return (
        e.offset == 0
        and len(e.shape) > 0
        and math.prod(e.shape) == numel
        and tuple(e.stride) == torch.empty(e.shape, device="meta").stride()
    )


@dataclass
class ReplayStats:
    seconds: float
    ops: int
    computed_ops: int
    scratch_random_ops: int
    peak_bytes: int  # shadows plus scratch alive at once
    emitted_bytes: int  # the requested rectangles handed back
    spare_bytes: int  # the largest freed storage kept for reuse (at most init_execute.spare_limit())


class InitReplay:
    """A :class:`~models.tensor_source.TensorSource` of eager-init values for a meta model.

    ``InitReplay(meta_model)`` records the model's construction (cheap: meta, no values) and
    snapshots the global CPU generator: it must be the state the eager construction would
    start from (call it right after building on meta, under the same ``torch.manual_seed``),
    or pass ``seed`` (the state right after ``torch.manual_seed(seed)``) or ``rng_state``.
    A model whose construction draws on the CPU even on meta (DiffLlama's
    ``torch.normal(..., size=...)``) needs one of them: :class:`MetaBuildDrewError` otherwise.
    Each :meth:`read`/:meth:`fill` replays the construction from that state and leaves the
    generator where eager construction leaves it, so the caller's next random draw (dropout,
    data order) is the one a single process would make.

    Before it is trusted, the replay checks itself once per process and family against an eager
    build of a tiny model of the same family (:mod:`models.init_self_check`; ``self_check=False``
    skips that, as the check itself does): :class:`~models.init_self_check.ReplaySelfCheckError`
    when a torch release changed what it relies on. A torch lacking a private detail it uses is
    refused with its name before anything runs.

    Hugging Face models are rebuilt with ``type(model)._from_config(model.config)``; other
    modules are initialized by calling ``reset_parameters()`` on every module owning tensors,
    in ``modules()`` order (a module owning parameters without one raises
    :class:`NoInitializerError`).

    Names are those of ``named_parameters()`` (tied weights once, under the first name, e.g.
    ``model.embed_tokens.weight``; :meth:`aliases` maps ``lm_head.weight`` to it and read
    accepts either) followed by ``named_buffers()``, non-persistent buffers included.
    """

    def __init__(
        self, meta_model: nn.Module, *, seed: int | None = None, rng_state: torch.Tensor | None = None,
        self_check: bool = True,
    ) -> None:
        _check_cpu_default()
        missing = missing_torch_details()
        if missing:
            raise MaterializeError(
                f"this torch ({torch.__version__}) lacks what the init replay relies on: {'; '.join(missing)}. Build "
                "the model on the CPU instead of the meta device, or use a torch version the replay is tested with "
                "(docs/design.md, 'Widening the tested versions')"
            )
        self._hf = _is_hf(meta_model)
        if self_check:  # once per process and family: a torch that changed the random stream is refused here
            verify_replay(meta_model, self._hf, InitReplay)
        self.chunk_bytes: int | None = None  # draws are cut in pieces of init_execute.DRAW_CHUNK_BYTES
        self._program = _hf_program(meta_model) if self._hf else _plain_program(meta_model)
        if seed is not None and rng_state is not None:
            raise ValueError("give seed or rng_state, not both")
        if seed is not None:
            rng_state = torch.Generator().manual_seed(seed).get_state()
        self._rng_state = (torch.get_rng_state() if rng_state is None else rng_state).clone()
        rec, built = self._record(Recorder())
        if rec is None:  # the construction branches on values it draws (torch's trunc_normal_)
            rec, built = self._record(ValuedRecorder())
        if rec.real_draws and seed is None and rng_state is None:
            raise MetaBuildDrewError(
                f"{type(meta_model).__name__}'s construction draws from the CPU generator even on the meta "
                f"device ({len(rec.real_draws)} draw(s), first {rec.real_draws[0]}: e.g. torch.normal(..., size=...) "
                "takes no device), so building it on meta advanced the generator and the state now is not "
                "where eager construction starts. Pass the seed you built under: InitReplay(model, seed=s) "
                "(or rng_state=the state before building)."
            )
        self._records = rec.records
        self._entries = _entries(built, rec.sid)
        self._aliases = tied_parameter_names(built)
        self.last_stats: ReplayStats | None = None
        if _structure(meta_model) != _structure(built) or tied_parameter_names(meta_model) != self._aliases:
            got, want = _structure(meta_model), _structure(built)
            diff = [w for w in want if w not in got][:3] + [g for g in got if g not in want][:3]
            raise ReplayMismatchError(
                f"the meta model is not what {type(meta_model).__name__} builds from its config "
                f"(first differences: {diff}); InitReplay reproduces a model as constructed, not one "
                "modified afterwards (resized embeddings, replaced modules, changed tying)"
            )
        bad = [e.name for e in self._entries.values() if e.sid is not None and not rec.initialized[e.sid]]
        if bad:
            how = (
                "its _init_weights never writes them (eager construction leaves whatever memory held); "
                "initialize them in the model's _init_weights, or build the model eagerly"
                if self._hf
                else "no reset_parameters() writes them and values made at construction are lost on the "
                "meta device; write them in a reset_parameters(), or build the model eagerly"
            )
            raise UninitializedTensorError(f"tensors without an initial value: {', '.join(bad)}: {how}")

    def _record(self, rec):
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(self._rng_state)
            try:
                with MetaConstructors(), rec:
                    return rec, self._program()
            except NeedsValues:
                return None, None

    # ----------------------------------------------------------------- the protocol

    def names(self) -> list[str]:
        return list(self._entries)

    def parameter_names(self) -> list[str]:
        return [n for n, e in self._entries.items() if e.kind == "parameter"]

    def buffer_names(self, *, persistent: bool | None = None) -> list[str]:
        return [
            n
            for n, e in self._entries.items()
            if e.kind == "buffer" and (persistent is None or e.persistent == persistent)
        ]

    def aliases(self) -> dict[str, str]:
        """Tied names: ``{alias: canonical}``, e.g. ``{"lm_head.weight": "model.embed_tokens.weight"}``."""
        return dict(self._aliases)

    def entry(self, name: str) -> TensorEntry:
        canonical = self._aliases.get(name, name)
        try:
            return self._entries[canonical]
        except KeyError:
            raise KeyError(f"{name!r} is not a parameter or buffer of this model") from None

    def shape(self, name: str) -> torch.Size:
        return self.entry(name).shape

    def dtype(self, name: str) -> torch.dtype:
        return self.entry(name).dtype

    def read(self, requests: Requests, *, advance_rng: bool = True) -> Iterator[tuple[str, list[torch.Tensor]]]:
        """Yield ``(name, [tensor per rect])``, in the order the values become final.

        The replay runs to its end before the first yield (a dispatch mode cannot be suspended),
        so the rectangles asked for are all held at once, plus one tensor in flight; use
        :meth:`fill` to copy them into your own buffers instead. Ask for everything (buffers
        too) in one call: each call is a full replay. ``advance_rng=False`` leaves the generator
        as it was and skips the random draws no requested value depends on (buffers only: fast).
        """
        done: list[tuple[str, list[torch.Tensor]]] = []
        self._replay(requests, advance_rng, lambda name, ts: done.append((name, ts)))
        done.reverse()
        while done:
            yield done.pop()

    def fill(
        self, destinations: Mapping[str, Sequence[tuple[Rect, torch.Tensor]]], *, advance_rng: bool = True
    ) -> None:
        """Copy each requested rectangle into its destination tensor the moment it is final.

        ``{name: [(rect, dest), ...]}``; ``dest`` has the rectangle's shape (any strides or
        device, e.g. a view into a flat ZeRO buffer). Peak memory: the destinations plus one
        tensor in flight.
        """
        requests = {n: [r for r, _ in items] for n, items in destinations.items()}
        dests = {n: [d for _, d in items] for n, items in destinations.items()}
        self._replay(requests, advance_rng, None, dests)

    def buffers(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every buffer, whole (non-persistent ones included); draws nothing from the generator."""
        for name, (t,) in self.read(whole(self.buffer_names()), advance_rng=False):
            yield name, t

    # ----------------------------------------------------------------- the replay

    def _replay(self, requests, advance_rng, sink, dests=None) -> None:
        jobs: dict[int, list[tuple[str, TensorEntry, list]]] = {}
        late: list[tuple[str, TensorEntry, list]] = []
        for name, rects in requests.items():
            e = self.entry(name)
            norm = [normalize_rect(name, e.shape, r) for r in rects]
            job = (name, e, norm)
            (jobs.setdefault(e.sid, []) if e.sid is not None else late).append(job)

        def deliver(name, values):
            if dests is None:
                sink(name, values)

        def emit(sid: int, ex: Executor) -> bool:
            mine = jobs.pop(sid)
            for name, e, rects in mine:
                full = ex.view_as(sid, e.dtype, e.shape, e.stride, e.offset)
                if dests is None and len(mine) == 1 and _owns_storage(full, rects, ex.shadows[sid]):
                    ex.stats.emitted_bytes += full.nbytes
                    deliver(name, [full])
                    return True  # the shadow itself, no copy
                vals = []
                for i, r in enumerate(rects):
                    if dests is not None:
                        dests[name][i].copy_(full[r])
                    else:
                        vals.append(full[r].clone(memory_format=torch.contiguous_format))
                        ex.stats.emitted_bytes += vals[-1].nbytes
                deliver(name, vals)
            return False

        _check_cpu_default()
        the_plan = plan(self._records, set(jobs), advance_rng=advance_rng)
        stream = _RowStream(jobs, dests, deliver)
        ex = Executor(self._records, the_plan, emit, stream, self.chunk_bytes)
        stream.stats = ex.stats
        start = time.perf_counter()
        saved = None if advance_rng else torch.get_rng_state()
        torch.set_rng_state(self._rng_state)
        try:
            with MetaConstructors(), ex:
                built = self._program()
        finally:
            if saved is not None:
                torch.set_rng_state(saved)
        if ex.k != len(self._records):
            raise TraceError(f"construction ran {ex.k} ops, the recorded one {len(self._records)}")
        if jobs:
            raise TraceError(f"internal: values never became final: {[j[0] for js in jobs.values() for j in js]}")
        for name, e, rects in late:  # tensors construction made on the CPU: real already
            full = built.get_parameter(e.name) if e.kind == "parameter" else built.get_buffer(e.name)
            vals = []
            for i, r in enumerate(rects):
                if dests is not None:
                    dests[name][i].copy_(full.detach()[r])
                else:
                    vals.append(full.detach()[r].clone(memory_format=torch.contiguous_format))
            deliver(name, vals)
        s: Stats = ex.stats
        self.last_stats = ReplayStats(
            time.perf_counter() - start, s.ops, s.computed_ops, s.scratch_random_ops, s.peak_bytes, s.emitted_bytes,
            s.spare_bytes,
        )


__all__ = [
    "InitReplay",
    "MaterializeError",
    "MetaBuildDrewError",
    "NoInitializerError",
    "ReplayMismatchError",
    "ReplayStats",
    "TensorEntry",
    "UninitializedTensorError",
]

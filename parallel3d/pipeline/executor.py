"""One executor for every pipeline schedule table.

``PipelineExecutor(pipe, pp_group, schedule).run(micro_batches)`` walks this rank's list of
``schedule_table(schedule, P, m, V)`` and does what each action says:

* ``F``: run the chunk on its input -- the micro-batch's ``input_ids`` on global stage 0, else
  the received (or, with P = 1, locally handed over) hidden states, made a leaf that requires
  grad -- and keep the output and its graph. On the last stage the output is the micro-batch
  loss (HF's causal-LM loss, mean over its valid tokens); it is divided by ``m`` and then
  multiplied by ``loss_scale`` before backward (DeepSpeed's order, which decides where an fp16
  gradient overflows), so the accumulated gradients equal the gradient of the mean
  of the micro-batch losses -- the full-batch gradient when micro-batches have equal numbers
  of valid tokens. With ``scale_by_microbatches=False`` each loss is taken as already divided
  for the whole step (the token mean: the micro-batch carries ``num_items_in_batch``, which the
  last stage hands to its loss): no ``1 / m``, and the step's loss returned is their sum.
* ``B``: backward of the chunk with the received output gradient; the input gradient is
  what ``SEND_B`` sends. In ``zb_h1`` (tables with ``W`` actions) ``B`` computes only the input
  gradient and ``W`` the weight gradients later, the split of torch.distributed.pipelining's
  ``stage_backward_input``/``stage_backward_weight``: during ``B``, the autograd nodes where the
  weight-only subgraphs hang off the path to the stage input ("intermediates") record the
  gradients flowing into them; ``W`` restarts backward from those nodes towards the
  parameters only (``torch.autograd.backward(..., inputs=params)``), so the input path is not
  recomputed and the weight gradients are accumulated by autograd into ``param.grad`` as in a
  plain backward (``register_post_accumulate_grad_hook`` hooks fire). Under activation
  checkpointing a chunk's blocks each get one ``W`` call (a call recomputes the block). Stage 0
  has no input gradient; its whole backward runs at ``W``.
* ``SEND_*``/``RECV_*``: a run of them is posted as one ``batch_isend_irecv`` batch
  (:mod:`parallel3d.pipeline.p2p`); a pass waits only for the receives it consumes.

After the last action: outstanding sends are waited for, tied embedding/head gradients are
summed across pp ranks 0 and P-1 (:func:`~parallel3d.pipeline.stage.sum_tied_grads`, unless
``sum_tied_grads=False``), and the mean loss over the micro-batches is broadcast from the
last pp rank, so every pp rank returns it. Gradients accumulate into ``param.grad``; zeroing
them is the caller's business.

Engine hooks: ``before_backward(pass_)`` / ``after_backward(pass_)`` are called around every
``B`` and ``W`` with a :class:`BackwardPass` ``(microbatch, chunk, kind, accumulates_weights,
is_last, is_last_of_step)``; ``is_last`` marks the last pass of the step that accumulates weight
gradients into that chunk's parameters (the last ``B``, or the last ``W`` in ``zb_h1``), the
moment to reduce the chunk's gradients. ``before_weight_group(params)`` is called in a ``W``
before each group of parameters whose gradients it computes together. ``around_compute(action)``
gives a context each ``F``, ``B`` and ``W`` runs in (context parallelism's per-micro-batch state,
parallel3d/context_parallel/stages.py). With ``record=True`` every compute action is timed and
``timeline`` holds :class:`~parallel3d.pipeline.simulate.Interval` s (seconds from a pp barrier
at the start of the step); :meth:`gather_timeline` collects all ranks' and
:meth:`write_chrome_trace` writes them for ``draw.py``.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Callable, NamedTuple

import torch
import torch.distributed as dist
from torch.autograd.graph import GradientEdge

from parallel3d.errors import ConfigError
from parallel3d.pipeline.actions import Action, Kind
from parallel3d.pipeline.model_checkpointing import hf_checkpointed
from parallel3d.pipeline.p2p import P2P, PendingRecv
from parallel3d.pipeline.schedules import schedule_table, validate_schedule_args
from parallel3d.pipeline.simulate import Interval
from parallel3d.pipeline.stage import PipelineModel, sum_tied_grads, tied_grad_snapshot

__all__ = ["BackwardPass", "PipelineExecutor", "backward_input", "backward_weight"]

BATCH_KEYS = ("input_ids", "labels", "shift_labels", "attention_mask", "position_ids", "num_items_in_batch")


class BackwardPass(NamedTuple):
    """What a backward hook is told."""

    microbatch: int
    chunk: int
    kind: str  # "B" or "W"
    accumulates_weights: bool  # False only for the input-gradient B of zb_h1
    is_last: bool  # the chunk's last weight-accumulating pass of the step
    is_last_of_step: bool  # the rank's last weight-accumulating pass of the step


# --------------------------------------------------------------------------------------------
# split backward (zero bubble): input gradient now, weight gradients later


def _grad_node(t: torch.Tensor) -> Any:
    """The autograd node of ``t``: its grad_fn, or the AccumulateGrad of a leaf."""
    if t.grad_fn is not None:
        return t.grad_fn
    if t.requires_grad:
        return t.view_as(t).grad_fn.next_functions[0][0]
    return None


class _WeightWork:
    """What ``W`` needs: either a deferred full backward, or parameter groups with the
    intermediates' recorded gradients."""

    def __init__(self, full: tuple[torch.Tensor, torch.Tensor | None] | None = None,
                 groups: list[tuple[list[torch.Tensor], list[Any]]] | None = None,
                 captured: dict[Any, tuple] | None = None) -> None:
        self.full = full
        self.groups = groups or []
        self.captured = captured or {}


def backward_input(output: torch.Tensor, grad_output: torch.Tensor | None, inp: torch.Tensor | None,
                   params: Sequence[torch.Tensor], together: Sequence[Sequence[torch.Tensor]] = ()
                   ) -> tuple[torch.Tensor | None, _WeightWork]:
    """Gradient of ``output`` w.r.t. ``inp`` only; returns it and the state for
    :func:`backward_weight`. Without an input that requires grad, everything is deferred.

    ``together``: sets of parameters whose weight gradients :func:`backward_weight` computes in
    one autograd call -- the blocks under activation checkpointing. Each autograd call that
    needs a checkpointed block's activations re-runs the block's forward (non-reentrant
    ``torch.utils.checkpoint`` recomputes once per backward call), so the weight pass takes one
    call per block rather than one per parameter group (a Llama block has nine). The one call
    also runs the part of the block's input-gradient path between its groups again, which costs
    less than the eight recomputations it saves."""
    root = output.grad_fn
    if inp is None or not inp.requires_grad or root is None:
        return None, _WeightWork(full=(output, grad_output))
    inp_node = _grad_node(inp)
    parents: dict[Any, list[Any]] = defaultdict(list)
    seen, stack = {root}, [root]
    while stack:
        node = stack.pop()
        for child, _ in node.next_functions:
            if child is None:
                continue
            parents[child].append(node)
            if child not in seen:
                seen.add(child)
                stack.append(child)
    if inp_node not in seen:  # the output does not depend on the input
        return torch.zeros_like(inp), _WeightWork(full=(output, grad_output))
    closure, stack = {inp_node}, [inp_node]  # nodes on a path from the output to the input
    while stack:
        for par in parents[stack.pop()]:
            if par not in closure:
                closure.add(par)
                stack.append(par)
    block_of = {id(p): ("block", i) for i, block in enumerate(together) for p in block}
    group_of: dict[Any, dict] = {}  # an intermediate node, or a ("block", i) of ``together``: its group
    groups: list[dict] = []
    for p in params:
        if not p.requires_grad:
            continue
        pnode = _grad_node(p)
        if pnode not in seen:
            continue
        inter, visited, stack = set(), {pnode}, [pnode]
        while stack:
            for par in parents[stack.pop()]:
                if par in closure:
                    inter.add(par)
                elif par not in visited:
                    visited.add(par)
                    stack.append(par)
        keys = inter | ({block_of[id(p)]} if id(p) in block_of else set())
        group = {"params": [p], "inter": set(inter), "keys": keys}
        for other in {id(group_of[k]): group_of[k] for k in keys if k in group_of}.values():
            group["params"] = other["params"] + group["params"]
            group["inter"] |= other["inter"]
            group["keys"] |= other["keys"]
            other["merged"] = True
        for k in group["keys"]:
            group_of[k] = group
        groups.append(group)
    groups = [g for g in groups if not g.get("merged")]
    captured: dict[Any, tuple] = {}
    handles = []
    for node in {n for g in groups for n in g["inter"]}:
        def hook(grad_outputs: tuple, node: Any = node) -> None:
            captured[node] = grad_outputs
        handles.append(node.register_prehook(hook))
    try:
        (dinp,) = torch.autograd.grad(output, inp, grad_outputs=grad_output, retain_graph=True)
    finally:
        for h in handles:
            h.remove()
    return dinp, _WeightWork(groups=[(g["params"], list(g["inter"])) for g in groups], captured=captured)


def backward_weight(work: _WeightWork, before_group: Callable[[list], None] | None = None) -> None:
    """Accumulate the weight gradients into ``param.grad`` (through autograd).

    ``before_group(params)`` is called before each group of parameters whose gradients are
    computed together (ZeRO-3 gathers their block there)."""
    if work.full is not None:
        output, grad = work.full
        torch.autograd.backward(output, grad_tensors=grad)
        return
    for params, inter in reversed(work.groups):  # last layers first, as a backward reaches them
        if before_group is not None:
            before_group(params)
        edges, grads = [], []
        for node in inter:
            for i, g in enumerate(work.captured.get(node, ())):
                if g is not None:
                    edges.append(GradientEdge(node, i))
                    grads.append(g)
        if not edges:
            continue
        handles = []
        if len(inter) > 1:  # a path between two intermediates must not count twice
            for node in inter:
                saved = work.captured.get(node)
                if saved is not None:
                    handles.append(node.register_prehook(lambda _go, saved=saved: saved))
        try:
            torch.autograd.backward(edges, grad_tensors=grads, inputs=params, retain_graph=True)
        finally:
            for h in handles:
                h.remove()
    work.groups, work.captured = [], {}


# --------------------------------------------------------------------------------------------


class PipelineExecutor:
    """Runs schedule ``schedule`` for this rank's :class:`PipelineModel` over pp ``group``.

    ``device``/``activation_dtype`` default to those of the rank's first floating parameter
    (every pp rank must agree on the dtype: it is the p2p dtype).
    """

    def __init__(self, pipe: PipelineModel, group: dist.ProcessGroup, schedule: str, *,
                 device: torch.device | str | None = None, activation_dtype: torch.dtype | None = None,
                 before_backward: Callable[[BackwardPass], None] | None = None,
                 after_backward: Callable[[BackwardPass], None] | None = None,
                 before_weight_group: Callable[[list], None] | None = None,
                 around_compute: Callable[[Action], contextlib.AbstractContextManager] | None = None,
                 sum_tied_grads: bool = True, scale_by_microbatches: bool = True, record: bool = False) -> None:
        p = dist.get_world_size(group)
        if p != pipe.num_stages:
            raise ConfigError(f"pipeline: the model was split into {pipe.num_stages} stages but the pp group "
                              f"has {p} ranks")
        if dist.get_rank(group) != pipe.rank:
            raise ConfigError(f"pipeline: this rank holds stage rank {pipe.rank}'s chunks but is rank "
                              f"{dist.get_rank(group)} of the pp group")
        # m = P is allowed by every schedule: this checks the name and virtual_stages only
        self.schedule = validate_schedule_args(schedule, p, p, pipe.virtual_stages)
        self.pipe = pipe
        self.group = group
        self.rank = pipe.rank
        self.num_stages = p
        floating = [t for t in pipe.parameters() if t.is_floating_point()]
        self.device = torch.device(device) if device is not None else (
            floating[0].device if floating else torch.device("cpu"))
        self.activation_dtype = activation_dtype or (floating[0].dtype if floating else torch.get_default_dtype())
        self.before_backward = before_backward
        self.after_backward = after_backward
        self.before_weight_group = before_weight_group
        self.around_compute = around_compute
        self.sum_tied_grads = sum_tied_grads
        self.scale_by_microbatches = scale_by_microbatches
        self.record = record
        self.timeline: list[Interval] = []
        self.p2p = P2P(group, self.device)
        self._tables: dict[int, list[Action]] = {}

    # ---- tables ----------------------------------------------------------------------------

    def table(self, num_microbatches: int) -> list[Action]:
        """This rank's action list for ``num_microbatches`` (ConfigError if the schedule
        cannot run that many)."""
        if num_microbatches not in self._tables:
            full = schedule_table(self.schedule, self.num_stages, num_microbatches, self.pipe.virtual_stages)
            self._tables[num_microbatches] = full[self.rank]
        return self._tables[num_microbatches]

    # ---- running ---------------------------------------------------------------------------

    def _check_batches(self, micro_batches: Sequence[dict]) -> list[dict]:
        if not isinstance(micro_batches, Sequence) or isinstance(micro_batches, (str, bytes)) or not micro_batches:
            raise ConfigError("pipeline: run() needs a non-empty list of micro-batches (dicts with input_ids and "
                              "labels)")
        out = []
        for i, mb in enumerate(micro_batches):
            if not isinstance(mb, dict) or "input_ids" not in mb or "labels" not in mb:
                raise ConfigError(f"pipeline: micro-batch {i} must be a dict with 'input_ids' and 'labels' "
                                  f"(optional: attention_mask, position_ids), got {type(mb).__name__}"
                                  + (f" with keys {sorted(mb)}" if isinstance(mb, dict) else ""))
            if mb.get("use_cache"):
                raise ConfigError(f"pipeline: micro-batch {i} asks for use_cache=True; pipeline stages train "
                                  "without a key/value cache (give use_cache=False or leave it out)")
            mb = {k: v for k, v in mb.items() if k != "use_cache"}  # False or None: what training does anyway
            extra = sorted(set(mb) - set(BATCH_KEYS))
            if extra:
                raise ConfigError(f"pipeline: micro-batch {i} has unsupported keys {extra}; a pipeline stage takes "
                                  f"{', '.join(BATCH_KEYS)}")
            ids = mb["input_ids"]
            if not isinstance(ids, torch.Tensor) or ids.ndim != 2:
                raise ConfigError(f"pipeline: micro-batch {i} input_ids must be a [batch, seq] tensor, got "
                                  f"{getattr(ids, 'shape', type(ids).__name__)}")
            out.append({k: (v.to(self.device) if isinstance(v, torch.Tensor) else v) for k, v in mb.items()})
        return out

    def _shape(self, mb: dict) -> tuple[int, ...]:
        return (*mb["input_ids"].shape, self.pipe.chunks[0].hidden_size)

    def run(self, micro_batches: Sequence[dict], *, loss_scale: float = 1.0) -> torch.Tensor:
        """Run one training step's forwards and backwards; returns the mean micro-batch loss
        (unscaled, detached, fp32) on every pp rank. ``loss_scale`` multiplies every loss before
        backward (fp16 loss scaling), on top of the ``1 / m``."""
        batches = self._check_batches(micro_batches)
        m = len(batches)
        program = self.table(m)
        p, rank, chunks = self.num_stages, self.rank, self.pipe.chunks
        split = any(a.kind == Kind.W for a in program)
        weight_kind = Kind.W if split else Kind.B
        last_pass: dict[int, int] = {}
        for i, a in enumerate(program):
            if a.kind == weight_kind:
                last_pass[a.chunk] = i
        last_of_step = max(last_pass.values(), default=-1)
        divisor = m if self.scale_by_microbatches else 1
        chunk_params = [list(c.parameters()) for c in chunks]  # per run: the engine may swap parameters
        # checkpointed blocks (the pipeline's or transformers' own): one weight-gradient call each, so W
        # recomputes a block once (backward_input)
        chunk_blocks = [[list(b.parameters()) for b in c.layers if c.activation_checkpointing or hf_checkpointed(b)]
                        for c in chunks]

        inputs: dict[tuple[int, int], torch.Tensor] = {}
        outputs: dict[tuple[int, int], torch.Tensor] = {}
        produced_f: dict[tuple[int, int], torch.Tensor] = {}  # outputs to send / hand over
        produced_b: dict[tuple[int, int], torch.Tensor] = {}  # input grads to send / hand over
        recv_f: dict[tuple[int, int], PendingRecv] = {}
        recv_b: dict[tuple[int, int], PendingRecv] = {}
        weight_work: dict[tuple[int, int], Any] = {}
        losses: list[torch.Tensor] = []
        self.timeline = []
        tied_base = tied_grad_snapshot(self.pipe) if self.sum_tied_grads else None
        t0 = 0.0
        if self.record:
            dist.barrier(group=self.group)
            t0 = time.perf_counter()

        def timed(a: Action, fn: Callable[[], None]) -> None:
            if not self.record:
                fn()
                return
            start = time.perf_counter()
            fn()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.timeline.append(Interval(rank, a.kind.value, a.microbatch, a.chunk, start - t0,
                                          time.perf_counter() - t0))

        def hook(which: Callable | None, a: Action) -> None:
            if which is None:
                return
            accumulates = a.kind == weight_kind
            i = index
            which(BackwardPass(a.microbatch, a.chunk, a.kind.value, accumulates,
                               accumulates and last_pass.get(a.chunk) == i, accumulates and i == last_of_step))

        def forward(a: Action) -> None:
            key, chunk, mb = (a.microbatch, a.chunk), chunks[a.chunk], batches[a.microbatch]
            if chunk.is_first:
                x = mb["input_ids"]
            else:
                x = recv_f.pop(key).wait() if key in recv_f else produced_f.pop((a.microbatch, a.chunk - 1))
                x = x.detach().requires_grad_(x.is_floating_point())

            def run() -> None:
                out = _run_chunk(chunk, x, mb)
                if chunk.is_last:
                    losses.append(out.detach().float())
                    out = out / divisor if divisor != 1 else out  # DeepSpeed's order: divide, then scale
                    out = out * loss_scale if loss_scale != 1.0 else out
                else:
                    produced_f[key] = out.detach()
                inputs[key], outputs[key] = x, out

            with self._around(a):
                timed(a, run)

        def backward(a: Action) -> None:
            key, chunk = (a.microbatch, a.chunk), chunks[a.chunk]
            grad = None
            if not chunk.is_last:
                grad = recv_b.pop(key).wait() if key in recv_b else produced_b.pop((a.microbatch, a.chunk + 1))
            out, x = outputs.pop(key), inputs.pop(key)
            hook(self.before_backward, a)

            def run() -> None:
                if split:
                    dx, weight_work[key] = backward_input(out, grad, None if chunk.is_first else x,
                                                          chunk_params[a.chunk], chunk_blocks[a.chunk])
                else:
                    torch.autograd.backward(out, grad_tensors=grad)
                    dx = None if chunk.is_first else x.grad
                if not chunk.is_first:
                    produced_b[key] = dx if dx is not None else torch.zeros_like(x)

            with self._around(a):
                timed(a, run)
            hook(self.after_backward, a)

        def weight(a: Action) -> None:
            key = (a.microbatch, a.chunk)
            hook(self.before_backward, a)
            with self._around(a):
                timed(a, lambda: backward_weight(weight_work.pop(key), self.before_weight_group))
            hook(self.after_backward, a)

        index = 0
        while index < len(program):
            a = program[index]
            if a.kind.is_compute:
                {Kind.F: forward, Kind.B: backward, Kind.W: weight}[a.kind](a)
                index += 1
                continue
            sends, recvs, keys = [], [], []
            while index < len(program) and not program[index].kind.is_compute:
                c = program[index]
                key = (c.microbatch, c.chunk)
                if c.kind == Kind.SEND_F:
                    sends.append((produced_f.pop(key), c.peer))
                elif c.kind == Kind.SEND_B:
                    sends.append((produced_b.pop(key), c.peer))
                else:
                    recvs.append((self._shape(batches[c.microbatch]), self.activation_dtype, c.peer))
                    keys.append((recv_f if c.kind == Kind.RECV_F else recv_b, key))
                index += 1
            for (store, key), pending in zip(keys, self.p2p.post(sends, recvs)):
                store[key] = pending
        self.p2p.drain()
        leftovers = [name for name, d in (("activations", outputs), ("sends", produced_f), ("grads", produced_b),
                                          ("receives", recv_f), ("gradient receives", recv_b),
                                          ("weight passes", weight_work)) if d]
        if leftovers:
            raise RuntimeError(f"pipeline rank {rank}: schedule {self.schedule!r} left {', '.join(leftovers)} "
                               "unconsumed (a broken table)")
        if self.sum_tied_grads:
            sum_tied_grads(self.pipe, self.group, base=tied_base)
        return self._broadcast_loss(losses, m)

    def _around(self, a: Action) -> contextlib.AbstractContextManager:
        """The context a compute action runs in (``around_compute``, e.g. context parallelism's
        per-micro-batch state), or none."""
        return self.around_compute(a) if self.around_compute is not None else contextlib.nullcontext()

    def _broadcast_loss(self, losses: list[torch.Tensor], m: int) -> torch.Tensor:
        if self.pipe.is_last:
            stacked = torch.stack(losses)
            loss = (stacked.mean() if self.scale_by_microbatches else stacked.sum()).to(self.device)
        else:
            loss = torch.zeros((), dtype=torch.float32, device=self.device)
        if self.num_stages > 1:
            dist.broadcast(loss, src=dist.get_global_rank(self.group, self.num_stages - 1), group=self.group)
        return loss

    @torch.no_grad()
    def evaluate(self, micro_batches: Sequence[dict]) -> torch.Tensor:
        """Forward only (GPipe order, no graph kept); the mean micro-batch loss on every pp rank."""
        batches = self._check_batches(micro_batches)
        program = [a for chunk in range(self.pipe.virtual_stages)
                   for a in _forward_program(self.num_stages, self.pipe.virtual_stages, len(batches), self.rank, chunk)]
        chunks, losses = self.pipe.chunks, []
        recv: dict[tuple[int, int], PendingRecv] = {}
        local: dict[tuple[int, int], torch.Tensor] = {}
        for a in program:
            key, mb = (a.microbatch, a.chunk), batches[a.microbatch]
            if a.kind == Kind.RECV_F:
                recv[key] = self.p2p.post([], [(self._shape(mb), self.activation_dtype, a.peer)])[0]
            elif a.kind == Kind.SEND_F:
                self.p2p.post([(local.pop(key), a.peer)], [])
            else:
                chunk = chunks[a.chunk]
                x = mb["input_ids"] if chunk.is_first else (
                    recv.pop(key).wait() if key in recv else local.pop((a.microbatch, a.chunk - 1)))
                with self._around(a):
                    out = _run_chunk(chunk, x, mb)
                if chunk.is_last:
                    losses.append(out.float())
                else:
                    local[key] = out
        self.p2p.drain()
        return self._broadcast_loss(losses, len(batches))

    # ---- timelines -------------------------------------------------------------------------

    def gather_timeline(self) -> list[Interval]:
        """Every pp rank's timeline of the last ``run`` (collective over the pp group)."""
        out: list[Any] = [None] * self.num_stages
        dist.all_gather_object(out, [tuple(iv) for iv in self.timeline], group=self.group)
        return [Interval(*iv) for rank in out for iv in rank]

    def write_chrome_trace(self, path: str | Path, metadata: dict | None = None) -> Path | None:
        """Gather the timeline and write it as a Chrome trace on pp rank 0 (collective)."""
        from parallel3d.pipeline.draw import write_chrome_trace

        intervals = self.gather_timeline()
        if self.rank != 0:
            return None
        meta = {"schedule": self.schedule, "num_stages": self.num_stages,
                "virtual_stages": self.pipe.virtual_stages, **(metadata or {})}
        return write_chrome_trace(intervals, path, metadata=meta)


def _run_chunk(chunk: Any, x: torch.Tensor, mb: dict) -> torch.Tensor:
    """A chunk's forward on its input ``x`` with the micro-batch's other arguments (the labels and
    the loss divisor only on the last stage)."""
    last = chunk.is_last
    return chunk(x, attention_mask=mb.get("attention_mask"), position_ids=mb.get("position_ids"),
                 labels=mb["labels"] if last else None, shift_labels=mb.get("shift_labels") if last else None,
                 num_items_in_batch=mb.get("num_items_in_batch"))


def _forward_program(p: int, v: int, m: int, rank: int, chunk: int) -> list[Action]:
    """Forward-only program of one chunk: receive, run and send each micro-batch in order.
    Every rank walks its chunks in increasing order and sends never wait, so each receive
    finds its send posted."""
    stage, last = chunk * p + rank, p * v - 1
    out: list[Action] = []
    for i in range(m):
        if stage > 0 and p > 1:
            out.append(Action(Kind.RECV_F, i, chunk, (stage - 1) % p))
        out.append(Action(Kind.F, i, chunk))
        if stage < last and p > 1:
            out.append(Action(Kind.SEND_F, i, chunk, (stage + 1) % p))
    return out

"""Pipeline schedules as data: one list of actions per pipeline rank.

A schedule is not code that runs a model; it is a table that says, for every rank, in which
order to run forwards (F), backwards (B) and weight-gradient passes (W) for which micro-batch
and model chunk, and where to send and receive the tensors that cross ranks. One executor
walks any table, and the same table can be simulated, checked and drawn without a model.

Stages and chunks: with P ranks and V model chunks per rank ("virtual stages", only for
``interleaved_1f1b``) the model is cut into S = V * P global stages; chunk c of rank r is global
stage ``c * P + r`` (Megatron's layout), so a micro-batch visits ranks 0..P-1 V times.

Kinds: ``F`` forward; ``B`` backward -- the full backward, except in ``zb_h1`` where it is only
the input-gradient part (what the previous stage waits for) and ``W`` computes the weight
gradients later. Communication is explicit (see :func:`add_communication`): ``SEND_F``/``RECV_F``
carry activations to the next stage, ``SEND_B``/``RECV_B`` carry their gradients back, each with
the peer rank. A hand-off between two chunks on the same rank (only when P == 1) is local and has
no communication action.
"""

from __future__ import annotations

import functools
from typing import Callable

from parallel3d.errors import ConfigError
from parallel3d.pipeline.actions import Action, Kind
from parallel3d.pipeline.simulate import Costs, simulate

__all__ = [
    "SCHEDULES", "add_communication", "compute_only", "has_weight_pass", "schedule_table",
    "validate_schedule_args",
]


SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def validate_schedule_args(name: str, num_stages: int, num_microbatches: int, virtual_stages: int = 1) -> str:
    """Check the arguments of :func:`schedule_table`; return the normalized schedule name.

    Rules (each breach is a :class:`ConfigError` naming it):

    * ``num_stages`` (P) >= 1, ``num_microbatches`` (m) >= 1, ``virtual_stages`` (V) >= 1.
    * ``gpipe``: any m >= 1.
    * ``1f1b`` and ``zb_h1``: any m >= 1. With m < P the warm-up of the first ranks holds every
      micro-batch and no steady phase exists, so the step runs in GPipe's order (as Megatron's
      and DeepSpeed's 1F1B do; torch's Schedule1F1B refuses it instead). A DeepSpeed config
      with pipeline stages and ``gradient_accumulation_steps: 1`` trains as it is.
    * ``interleaved_1f1b``: V >= 2 and m a multiple of P (m = P, 2P, ...). This is Megatron's
      rule: each rank runs its chunks in rounds of P micro-batches (P forwards of chunk 0, then P
      of chunk 1, ...), so micro-batches must come in whole rounds.
    * other schedules: V == 1.
    """
    if not isinstance(name, str) or name.strip().lower() not in SCHEDULES:
        raise ConfigError(f"unknown pipeline schedule {name!r}; allowed: {', '.join(SCHEDULES)}")
    name = name.strip().lower()
    for key, value in (("num_stages", num_stages), ("num_microbatches", num_microbatches),
                       ("virtual_stages", virtual_stages)):
        if not _is_int(value) or value < 1:
            raise ConfigError(f"pipeline {key} must be an integer >= 1, got {value!r}")
    p, m, v = num_stages, num_microbatches, virtual_stages
    if name == "interleaved_1f1b":
        if v < 2:
            raise ConfigError(
                f"schedule 'interleaved_1f1b' needs virtual_stages >= 2 model chunks per rank, got {v}; "
                "with one chunk per rank use '1f1b'")
        if m % p:
            raise ConfigError(
                f"schedule 'interleaved_1f1b' needs the number of micro-batches to be a multiple of the "
                f"number of pipeline stages (Megatron's rule: micro-batches run in rounds of {p}), got "
                f"{m} micro-batches for {p} stages; use "
                + (f"{p}" if m < p else f"{m - m % p} or {m + p - m % p}"))
    elif v != 1:
        raise ConfigError(
            f"virtual_stages={v} applies only to 'interleaved_1f1b'; schedule {name!r} runs one model "
            "chunk per rank (virtual_stages=1)")
    return name


def _gpipe(p: int, m: int, rank: int) -> list[Action]:
    """All forwards, then all backwards (in the same order; any order is valid for the
    backwards, same order frees the oldest activations first and keeps sends in FIFO order)."""
    return [Action(Kind.F, i) for i in range(m)] + [Action(Kind.B, i) for i in range(m)]


def _one_f_one_b(p: int, m: int, rank: int, split: bool = False) -> list[Action]:
    """PipeDream-Flush: min(P - rank - 1, m) warm-up forwards, then alternate F and B, then
    the cool-down backwards. Rank r never holds more than P - r activations.

    ``split=True`` gives ZB-H1 (Qi et al. 2023, Fig. 3): the same F/B order with B the
    input-gradient pass only, and each W run after its B; rank r delays its W's by r
    positions. The last rank would otherwise idle in the cool-down while gradients drain
    back to rank 0; the delayed W's fill that time. The peak of activations held until W is
    then P on every rank -- rank 0's 1F1B peak, so the memory bound is unchanged.
    """
    warmup = min(p - rank - 1, m)
    delay = rank if split else 0
    out = [Action(Kind.F, i) for i in range(warmup)]
    fwd, bwd, wgt = warmup, 0, 0

    def backward() -> None:
        nonlocal bwd, wgt
        out.append(Action(Kind.B, bwd))
        bwd += 1
        if split and bwd - wgt > delay:
            out.append(Action(Kind.W, wgt))
            wgt += 1

    while fwd < m:  # steady state: one forward, one backward
        out.append(Action(Kind.F, fwd))
        fwd += 1
        backward()
    while bwd < m:  # cool-down
        backward()
    if split:
        out += [Action(Kind.W, i) for i in range(wgt, m)]
    return out


def _interleaved(p: int, m: int, rank: int, v: int) -> list[Action]:
    """Megatron-LM's interleaved 1F1B (``forward_backward_pipelining_with_interleaving``).

    A rank's forwards run over "virtual micro-batches" k = 0..m*V-1: in groups of P*V, chunk
    0 for P micro-batches, then chunk 1 for the same P, ...; backwards walk the same sequence
    with the chunks reversed. Warm-up: 2*(P - rank - 1) + (V - 1)*P forwards (all m*V when
    m == P), then one F and one B alternately, then the remaining B's.
    """
    total = m * v
    warmup = total if m == p else min(2 * (p - rank - 1) + (v - 1) * p, total)

    def unpack(k: int, forward: bool) -> tuple[int, int]:
        group, within = divmod(k, p * v)
        chunk = within // p
        return group * p + within % p, (chunk if forward else v - 1 - chunk)

    out = [Action(Kind.F, *unpack(k, True)) for k in range(warmup)]
    for k in range(total - warmup):
        out.append(Action(Kind.F, *unpack(k + warmup, True)))
        out.append(Action(Kind.B, *unpack(k, False)))
    out += [Action(Kind.B, *unpack(k, False)) for k in range(total - warmup, total)]
    return out


_BUILDERS: dict[str, Callable[[int, int, int, int], list[Action]]] = {
    "gpipe": lambda p, m, r, v: _gpipe(p, m, r),
    "1f1b": lambda p, m, r, v: _one_f_one_b(p, m, r),
    "interleaved_1f1b": _interleaved,
    "zb_h1": lambda p, m, r, v: _one_f_one_b(p, m, r, split=True),
}


@functools.cache
def has_weight_pass(name: str) -> bool:
    """Whether the schedule splits each backward into an input-gradient pass (``B``) and a later
    weight-gradient pass (``W``), as the zero-bubble schedules do: read off its own table (first
    rank, 2 stages, 2 micro-batches, 2 chunks where it interleaves), so that callers ask the
    schedule rather than compare its name."""
    return any(a.kind == Kind.W for a in _BUILDERS[name](2, 2, 0, 2))


def add_communication(compute: list[list[Action]], costs: Costs = Costs()) -> list[list[Action]]:
    """Insert the point-to-point actions into compute-only per-rank lists.

    Every tensor that crosses ranks gets a time stamp t: the end of the pass that produced it
    in a simulation of the compute-only table with ``costs``. The sender sends it right after
    that pass; the receiver receives it at its first gap between passes at or after t, which is
    before the pass that consumes it. All sends and receives with the same t on a rank form
    one *batch*, and so does any run of consecutive communication actions: the executor posts
    a batch at once (``torch.distributed.batch_isend_irecv``) and waits for it before its next
    pass. Because every rank meets its batches in increasing t and a send and its receive share
    their t, the table cannot deadlock even if sends block until the peer receives (NCCL's
    rendezvous): the unmatched operation with the smallest t always finds its partner posted.
    For 1F1B this reproduces Megatron's fused send_forward_recv_backward pairs.
    With the same ``costs`` the async timeline is the compute-only one: nothing waits longer.
    """
    p = len(compute)
    v = 1 + max((a.chunk for prog in compute for a in prog), default=0)
    last = v * p - 1
    ends = {(iv.rank, iv.kind, iv.microbatch, iv.chunk): iv for iv in simulate(compute, costs).intervals}
    comms: list[list[tuple[float, Action]]] = [[] for _ in range(p)]
    for rank, prog in enumerate(compute):
        for a in prog:
            stage = a.chunk * p + rank
            if a.kind == Kind.F and stage < last:
                to, send, recv = stage + 1, Kind.SEND_F, Kind.RECV_F
            elif a.kind == Kind.B and stage > 0:
                to, send, recv = stage - 1, Kind.SEND_B, Kind.RECV_B
            else:
                continue
            if to % p == rank:  # chunk to chunk on one rank: a local hand-off
                continue
            t = ends[(rank, a.kind.value, a.microbatch, a.chunk)].end
            comms[rank].append((t, Action(send, a.microbatch, a.chunk, to % p)))
            comms[to % p].append((t, Action(recv, a.microbatch, to // p, rank)))
    out: list[list[Action]] = []
    for rank, prog in enumerate(compute):
        # a batch at t goes before the first pass that starts at or after t; sends before receives
        items = [((ends[(rank, a.kind.value, a.microbatch, a.chunk)].start, 1, 0, i), a) for i, a in enumerate(prog)]
        items += [((t, 0, 0 if a.kind.is_send else 1, i), a) for i, (t, a) in enumerate(comms[rank])]
        out.append([a for _, a in sorted(items, key=lambda item: item[0])])
    return out


def compute_only(table: list[list[Action]]) -> list[list[Action]]:
    """The table without its communication actions (for drawing and reading)."""
    return [[a for a in actions if a.kind.is_compute] for actions in table]


def schedule_table(name: str, num_stages: int, num_microbatches: int, virtual_stages: int = 1,
                   *, communication: bool = True, costs: Costs = Costs()) -> list[list[Action]]:
    """The per-rank action lists of schedule ``name`` for P = ``num_stages`` pipeline ranks,
    m = ``num_microbatches`` micro-batches and V = ``virtual_stages`` chunks per rank.

    ``name`` is one of :data:`SCHEDULES`; the argument rules are in
    :func:`validate_schedule_args`. With ``communication=False`` only F/B/W actions are listed;
    else the sends and receives are placed by :func:`add_communication` for ``costs`` (the order
    of the passes never depends on ``costs``; only where the p2p batches sit between them).
    """
    name = validate_schedule_args(name, num_stages, num_microbatches, virtual_stages)
    build = _BUILDERS[name]
    table = [build(num_stages, num_microbatches, rank, virtual_stages) for rank in range(num_stages)]
    return add_communication(table, costs) if communication else table

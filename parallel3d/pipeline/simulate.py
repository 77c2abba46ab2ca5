"""Run a schedule table on paper: timelines, makespan, bubble fraction, peak live activations.

The simulator is also the table's proof of correctness. It walks every rank's list in order
and raises :class:`ScheduleError` if an action runs before its data exists (a forward before
the previous stage's forward reached this rank, a backward before the next stage's gradient, a W
before its B), if an action repeats, if a send or receive has no partner, or if the ranks
deadlock, or if the sends from one rank to another are not received in the order they
were sent (p2p between a pair of ranks is matched in order, and activations and gradients
have the same shape, so a swap would be silent). Two p2p semantics:

* ``"async"`` (what the executor does): a batch of consecutive communication actions is
  posted and the rank goes on; a pass waits only for the receives it consumes, each done
  ``latency`` after both it and its send are posted.
* A table without communication actions (``communication=False``) is simulated with implicit
  async transfers: a pass waits for its remote inputs (plus ``latency``).
* ``"blocking"`` (rendezvous): every send and receive waits until its partner is posted; a
  batch is posted as a whole and finishes when every one of its operations is matched. A table
  that survives this also survives any buffering the transport may or may not do.

Costs: a chunk's F, B and W cost ``Costs.f/b/w`` divided by the number of chunks per rank V
(a chunk holds 1/V of a rank's layers). In schedules without W actions, B is the full backward
and costs ``b + w``, so every schedule does the same work per micro-batch and bubble fractions
compare directly.

Live activations of a rank: (micro-batch, chunk) pairs whose F has started and whose last
backward part has not finished -- W when the table splits the backward, else B. (In ZB-H1 a
micro-batch between its B and W holds only what W needs, the layer inputs and output
gradients; counting it as fully live is the paper's conservative M_B bound.) For interleaved
schedules a pair holds 1/V of a rank's per-micro-batch activations.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from parallel3d.errors import ConfigError
from parallel3d.pipeline.actions import Action, Kind

__all__ = ["Costs", "Interval", "ScheduleError", "SimResult", "simulate"]


class ScheduleError(RuntimeError):
    """A schedule table is wrong: a dependency, a duplicate, an unmatched p2p, a deadlock."""


@dataclass(frozen=True)
class Costs:
    """Durations of one micro-batch's passes through a whole rank, and the p2p latency."""

    f: float = 1.0
    b: float = 1.0
    w: float = 1.0
    latency: float = 0.0

    def __post_init__(self) -> None:
        # F and B must take time so that a pass and the send of its result have an order.
        if not (self.f > 0 and self.b > 0 and self.w >= 0 and self.latency >= 0):
            raise ConfigError(f"pipeline costs need f > 0, b > 0, w >= 0, latency >= 0, got {self}")


class Interval(NamedTuple):
    """One action on a timeline: simulated here, recorded by the engine in the same shape."""

    rank: int
    kind: str
    microbatch: int
    chunk: int
    start: float
    end: float


@dataclass
class SimResult:
    """What :func:`simulate` returns. ``timeline`` holds compute actions only, by rank."""

    timeline: list[list[Interval]]
    makespan: float
    bubble_fraction: float
    busy: list[float]
    peak_live: list[int]

    @property
    def intervals(self) -> list[Interval]:
        return [iv for rank in self.timeline for iv in rank]


def _batches(program: list[Action]) -> list[Action | list[Action]]:
    """Group maximal runs of communication actions into lists (one p2p batch each)."""
    out: list[Action | list[Action]] = []
    for a in program:
        if a.kind.is_compute:
            out.append(a)
        elif out and isinstance(out[-1], list):
            out[-1].append(a)
        else:
            out.append([a])
    return out


def simulate(table: list[list[Action]], costs: Costs = Costs(), *, p2p: str = "async") -> SimResult:
    """Simulate ``table`` (per-rank lists as from ``schedule_table``) with ``costs``."""
    if p2p not in ("async", "blocking"):
        raise ValueError(f"p2p must be 'async' or 'blocking', got {p2p!r}")
    p = len(table)
    v = 1 + max((a.chunk for prog in table for a in prog), default=0)
    last = p * v - 1
    split = any(a.kind == Kind.W for prog in table for a in prog)
    cost = {Kind.F: costs.f / v, Kind.B: (costs.b if split else costs.b + costs.w) / v, Kind.W: costs.w / v}
    release = Kind.W if split else Kind.B

    programs = [_batches(prog) for prog in table]
    pos = [0] * p
    clock = [0.0] * p
    posted = [False] * p  # whether the batch at pos[rank] has been posted
    done: dict[tuple[Kind, int, int], float] = {}  # (kind, microbatch, global stage) -> end time
    arrived: dict[tuple, float] = {}  # receive key -> when its blocking batch finished
    post_time: dict[tuple, float] = {}  # p2p op key -> when its side was posted
    channels: dict[tuple[int, int, bool], list[tuple]] = {}  # (from rank, to rank, is send) -> keys in post order
    timeline: list[list[Interval]] = [[] for _ in range(p)]

    def key(rank: int, a: Action) -> tuple:
        """(direction, microbatch, sending stage, receiving stage, role): equal up to role for
        a send and the receive that matches it."""
        stage = a.chunk * p + rank
        if a.kind in (Kind.SEND_F, Kind.RECV_F):
            src = stage if a.kind == Kind.SEND_F else stage - 1
            return ("F", a.microbatch, src, src + 1, a.kind.is_send)
        src = stage if a.kind == Kind.SEND_B else stage + 1
        return ("B", a.microbatch, src, src - 1, a.kind.is_send)

    def partner(k: tuple) -> tuple:
        return k[:4] + (not k[4],)

    def check_p2p(rank: int, a: Action) -> None:
        stage = a.chunk * p + rank
        to = {Kind.SEND_F: stage + 1, Kind.RECV_F: stage - 1, Kind.SEND_B: stage - 1, Kind.RECV_B: stage + 1}[a.kind]
        if not 0 <= to <= last or to % p != a.peer or a.peer == rank:
            raise ScheduleError(f"rank {rank}: {a} has no partner stage (stage {stage}, peer {a.peer})")
        if a.kind.is_send:
            produced = (Kind.F if a.kind == Kind.SEND_F else Kind.B, a.microbatch, stage)
            if produced not in done:
                raise ScheduleError(f"rank {rank}: {a} sends a tensor its {produced[0]} has not produced")

    implicit = not any(not a.kind.is_compute for prog in table for a in prog)

    def run_compute(rank: int, a: Action) -> bool:
        """Run ``a`` if its inputs are there; False if it must wait (implicit transfers only)."""
        stage = a.chunk * p + rank
        if not 0 <= a.chunk < v or (a.kind, a.microbatch, stage) in done:
            raise ScheduleError(f"rank {rank}: {a} is out of range or repeated")
        need: list[tuple] = []
        if a.kind == Kind.F and stage > 0:
            need.append((Kind.F, a.microbatch, stage - 1))
        if a.kind == Kind.B:
            need.append((Kind.F, a.microbatch, stage))
            if stage < last:
                need.append((Kind.B, a.microbatch, stage + 1))
        if a.kind == Kind.W:
            need.append((Kind.B, a.microbatch, stage))
        start = clock[rank]
        for dep in need:
            local = dep[2] % p == rank
            rk = (dep[0].value, dep[1], dep[2], stage, False)  # the receive that brings dep here
            if local or rk not in post_time:
                if local and dep in done:
                    continue
                if implicit and not local:
                    if dep not in done:
                        return False
                    start = max(start, done[dep] + costs.latency)
                    continue
                how = "before it on this rank" if local else "received before it"
                raise ScheduleError(f"rank {rank}: {a} (stage {stage}) runs before {dep[0]}{dep[1]} of stage "
                                    f"{dep[2]} is {how}")
            if rk in arrived:
                start = max(start, arrived[rk])
            elif partner(rk) in post_time:  # async: the receive completes in the background
                start = max(start, max(post_time[rk], post_time[partner(rk)]) + costs.latency)
            else:
                return False  # its send is not posted yet
        clock[rank] = end = start + cost[a.kind]
        done[(a.kind, a.microbatch, stage)] = end
        timeline[rank].append(Interval(rank, a.kind.value, a.microbatch, a.chunk, start, end))
        return True

    def try_batch(rank: int, batch: list[Action]) -> bool:
        """Post the batch (once). Async: done. Blocking: finished when every operation in it
        is matched; False while one is not."""
        keys = [key(rank, a) for a in batch]
        if not posted[rank]:
            for a, k in zip(batch, keys):
                check_p2p(rank, a)
                if k in post_time:
                    raise ScheduleError(f"rank {rank}: {a} is repeated")
                post_time[k] = clock[rank]
                channels.setdefault((rank, a.peer, True) if k[4] else (a.peer, rank, False), []).append(k[:4])
            posted[rank] = True
        if p2p == "blocking":
            if any(partner(k) not in post_time for k in keys):
                return False
            clock[rank] = max([clock[rank]] + [max(post_time[k], post_time[partner(k)]) + costs.latency for k in keys])
            arrived.update((k, clock[rank]) for k in keys if not k[4])
        posted[rank] = False
        return True

    progress = True
    while progress:
        progress = False
        for rank in range(p):
            while pos[rank] < len(programs[rank]):
                item = programs[rank][pos[rank]]
                if not (run_compute(rank, item) if isinstance(item, Action) else try_batch(rank, item)):
                    break
                pos[rank] += 1
                progress = True
    stuck = [r for r in range(p) if pos[r] < len(programs[r])]
    if stuck:
        what = "; ".join(f"rank {r} at {programs[r][pos[r]]}" for r in stuck)
        raise ScheduleError(f"deadlock under {p2p} p2p: {what}")
    unmatched = [k for k in post_time if partner(k) not in post_time]
    if unmatched:
        raise ScheduleError(f"sends or receives without a partner: {unmatched[:4]}")
    for (src, dst, is_send), sent in channels.items():
        if is_send and sent != channels.get((src, dst, False)):
            raise ScheduleError(f"rank {src} sends to rank {dst} in the order {sent} but rank {dst} receives in "
                                f"the order {channels.get((src, dst, False))}: untagged p2p would swap tensors")
    m = 1 + max((a.microbatch for prog in table for a in prog), default=-1)
    kinds = (Kind.F, Kind.B, Kind.W) if split else (Kind.F, Kind.B)
    missing = {(k, mb, s) for k in kinds for mb in range(m) for s in range(last + 1)} - set(done)
    if missing:
        raise ScheduleError(f"passes that never ran (kind, micro-batch, stage): {sorted(missing)[:6]}")

    makespan = max(clock, default=0.0)
    busy = [sum(iv.end - iv.start for iv in ivs) for ivs in timeline]
    bubble = 1.0 - sum(busy) / (p * makespan) if makespan else 0.0
    return SimResult(timeline, makespan, bubble, busy, [_peak_live(ivs, release) for ivs in timeline])


def _peak_live(intervals: list[Interval], release: Kind) -> int:
    """Most (micro-batch, chunk) pairs alive at once: +1 at F's start, -1 at the end of the
    releasing pass; at equal times the release counts first (the memory is reused)."""
    events = [(iv.start, 1) for iv in intervals if iv.kind == "F"]
    events += [(iv.end, -1) for iv in intervals if iv.kind == release.value]
    live = peak = 0
    for _, delta in sorted(events, key=lambda e: (e[0], e[1])):
        live += delta
        peak = max(peak, live)
    return peak

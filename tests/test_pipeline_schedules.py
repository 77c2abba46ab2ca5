"""Pipeline schedule tables: structure, dependencies, p2p matching, memory, bubbles, bad input,
drawing. Pure Python, no processes: the tables are data and the simulator runs them on paper."""

from __future__ import annotations

import json
import sys
from collections import Counter

import pytest

from parallel3d.errors import ConfigError
from parallel3d.pipeline import Action, Costs, Kind, ScheduleError, compute_only, schedule_table, simulate
from parallel3d.pipeline.draw import ascii_grid, draw_png, read_chrome_trace, to_chrome_trace, write_chrome_trace
from parallel3d.pipeline.schedules import SCHEDULES, has_weight_pass


def _cases() -> list[tuple[str, int, int, int]]:
    cases = []
    for p in (1, 2, 3, 4, 8):
        for m in sorted({p, p + 1, 2 * p, 3 * p, 13}):
            cases += [("gpipe", p, m, 1), ("1f1b", p, m, 1), ("zb_h1", p, m, 1)]
        for m in (p, 2 * p, 3 * p):
            cases += [("interleaved_1f1b", p, m, 2), ("interleaved_1f1b", p, m, 3)]
    cases += [("gpipe", 4, 1, 1), ("gpipe", 4, 3, 1)]  # gpipe takes fewer micro-batches than stages
    return cases


CASES = _cases()
IDS = [f"{n}-P{p}-m{m}-V{v}" for n, p, m, v in CASES]


def _release(name: str) -> str:
    return "W" if name == "zb_h1" else "B"


@pytest.mark.parametrize("name,p,m,v", CASES, ids=IDS)
def test_every_pass_once_and_in_order_per_rank(name: str, p: int, m: int, v: int) -> None:
    kinds = ("F", "B", "W") if name == "zb_h1" else ("F", "B")
    for rank, prog in enumerate(schedule_table(name, p, m, v)):
        compute = [a for a in prog if a.kind.is_compute]
        counts = Counter((a.kind.value, a.microbatch, a.chunk) for a in compute)
        assert set(counts) == {(k, mb, c) for k in kinds for mb in range(m) for c in range(v)}
        assert set(counts.values()) == {1}
        comm = Counter((a.kind.value, a.microbatch, a.chunk) for a in prog if not a.kind.is_compute)
        assert set(comm.values()) <= {1}
        index = {(a.kind.value, a.microbatch, a.chunk): i for i, a in enumerate(compute)}
        for mb in range(m):
            for c in range(v):
                assert index[("F", mb, c)] < index[("B", mb, c)]
                if name == "zb_h1":
                    assert index[("B", mb, c)] < index[("W", mb, c)]


@pytest.mark.parametrize("name,p,m,v", CASES, ids=IDS)
def test_every_send_has_its_receive_in_order(name: str, p: int, m: int, v: int) -> None:
    table = schedule_table(name, p, m, v)
    sent: dict[tuple[int, int], list[tuple]] = {}
    received: dict[tuple[int, int], list[tuple]] = {}
    for rank, prog in enumerate(table):
        for a in prog:
            stage = a.chunk * p + rank
            if a.kind == Kind.SEND_F:
                sent.setdefault((rank, a.peer), []).append(("F", a.microbatch, stage, stage + 1))
            elif a.kind == Kind.SEND_B:
                sent.setdefault((rank, a.peer), []).append(("B", a.microbatch, stage, stage - 1))
            elif a.kind == Kind.RECV_F:
                received.setdefault((a.peer, rank), []).append(("F", a.microbatch, stage - 1, stage))
            elif a.kind == Kind.RECV_B:
                received.setdefault((a.peer, rank), []).append(("B", a.microbatch, stage + 1, stage))
    assert sent == received  # same messages, same order on every (sender, receiver) channel
    for (src, dst), msgs in sent.items():
        assert src != dst and all(s % p == src and d % p == dst and abs(s - d) == 1 for _, _, s, d in msgs)
    # a micro-batch crosses all V*P - 1 stage boundaries both ways, each between two ranks if P > 1
    assert sum(map(len, sent.values())) == (2 * m * (v * p - 1) if p > 1 else 0)


@pytest.mark.parametrize("name,p,m,v", CASES, ids=IDS)
def test_simulation_respects_dependencies_and_cannot_deadlock(name: str, p: int, m: int, v: int) -> None:
    table = schedule_table(name, p, m, v)
    for mode in ("async", "blocking"):  # blocking: every send waits for its receive (NCCL-like)
        res = simulate(table, p2p=mode)
        at = {(iv.kind, iv.microbatch, iv.chunk * p + iv.rank): iv for iv in res.intervals}
        for (kind, mb, stage), iv in at.items():
            if kind == "F" and stage > 0:
                assert iv.start >= at[("F", mb, stage - 1)].end
            if kind == "B":
                assert iv.start >= at[("F", mb, stage)].end
                if stage < v * p - 1:
                    assert iv.start >= at[("B", mb, stage + 1)].end
            if kind == "W":
                assert iv.start >= at[("B", mb, stage)].end
        for rank in res.timeline:  # one pass at a time per rank
            assert all(a.end <= b.start for a, b in zip(rank, rank[1:]))


def _static_in_flight(prog: list[Action], release: str) -> int:
    live = peak = 0
    for a in prog:
        live += (a.kind == "F") - (a.kind == release)
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("extra", [0, 1, 5])
def test_in_flight_micro_batches(p: int, extra: int) -> None:
    m = p + extra
    gpipe, one_f_one_b, zb = (schedule_table(n, p, m, communication=False) for n in ("gpipe", "1f1b", "zb_h1"))
    for rank in range(p):
        assert _static_in_flight(gpipe[rank], "B") == m
        assert _static_in_flight(one_f_one_b[rank], "B") == min(p - rank, m) <= p
        assert _static_in_flight(zb[rank], "W") <= p  # counted until W: the conservative bound
    peak_1f1b = simulate(one_f_one_b).peak_live
    peak_zb = simulate(zb).peak_live
    assert peak_1f1b == [min(p - r, m) for r in range(p)]
    assert simulate(gpipe).peak_live == [m] * p
    assert max(peak_zb) == max(peak_1f1b) == p and all(x <= p for x in peak_zb)


@pytest.mark.parametrize("p,m,v", [(2, 4, 2), (4, 4, 2), (4, 8, 2), (4, 8, 3), (8, 16, 2)])
def test_interleaved_in_flight_follows_megatron_warmup(p: int, m: int, v: int) -> None:
    table = schedule_table("interleaved_1f1b", p, m, v, communication=False)
    for rank, prog in enumerate(table):
        warmup = m * v if m == p else min(2 * (p - rank - 1) + (v - 1) * p, m * v)
        assert _static_in_flight(prog, "B") == min(warmup + 1, m * v)


COSTS = [Costs(), Costs(1, 2, 0), Costs(1, 1, 0), Costs(2, 1, 1), Costs(1, 1.5, 0.5), Costs(1, 3, 0)]


@pytest.mark.parametrize("costs", COSTS, ids=str)
@pytest.mark.parametrize("p,m", [(1, 4), (2, 2), (2, 7), (4, 4), (4, 8), (4, 16), (8, 8), (8, 20)])
def test_bubble_fraction_matches_theory(costs: Costs, p: int, m: int) -> None:
    classic = (p - 1) / (m + p - 1)  # GPipe and 1F1B, for any F and B costs
    for name in ("gpipe", "1f1b"):
        for table in (schedule_table(name, p, m), schedule_table(name, p, m, costs=costs)):
            assert simulate(table, costs).bubble_fraction == pytest.approx(classic, abs=1e-12)
    # ZB-H1 (Qi et al. 2023): each rank idles (P-1)(F+B-W) while busy m(F+B+W), for W <= F, B
    f, b, w = costs.f, costs.b, costs.w
    zb = (p - 1) * (f + b - w) / (m * (f + b + w) + (p - 1) * (f + b - w))
    assert simulate(schedule_table("zb_h1", p, m), costs).bubble_fraction == pytest.approx(zb, abs=1e-12)
    if m % p == 0:
        for v in (2, 3):  # Megatron: the bubble shrinks by V, (P-1)/V against m
            inter = simulate(schedule_table("interleaved_1f1b", p, m, v), costs).bubble_fraction
            assert inter == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 4), (4, 8), (4, 16), (8, 8), (8, 24)])
def test_bubble_ordering_gpipe_interleaved_zero_bubble(p: int, m: int) -> None:
    unit = Costs(1, 1, 1)  # F = B = W as in the paper; the full backward of other schedules costs B + W
    bubble = {n: simulate(schedule_table(n, p, m, 2 if n == "interleaved_1f1b" else 1), unit).bubble_fraction
              for n in ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1")}
    assert bubble["gpipe"] == pytest.approx(bubble["1f1b"])
    assert bubble["1f1b"] > bubble["interleaved_1f1b"] > bubble["zb_h1"] > 0


def test_single_stage_has_no_bubble_and_no_communication() -> None:
    for name, v in (("gpipe", 1), ("1f1b", 1), ("zb_h1", 1), ("interleaved_1f1b", 2)):
        table = schedule_table(name, 1, 4, v)
        assert table == compute_only(table)
        assert simulate(table).bubble_fraction == 0.0


@pytest.mark.parametrize("args,message", [
    (("gpipe", 0, 4), "pipeline num_stages must be an integer >= 1, got 0"),
    (("gpipe", 2, 0), "pipeline num_microbatches must be an integer >= 1, got 0"),
    (("gpipe", True, 4), "pipeline num_stages must be an integer >= 1, got True"),
    (("pipedream", 2, 4), "unknown pipeline schedule 'pipedream'; allowed: gpipe, 1f1b, interleaved_1f1b, zb_h1"),
    (("interleaved_1f1b", 4, 6, 2), "schedule 'interleaved_1f1b' needs the number of micro-batches to be a multiple "
                                    "of the number of pipeline stages (Megatron's rule: micro-batches run in rounds "
                                    "of 4), got 6 micro-batches for 4 stages; use 4 or 8"),
    (("interleaved_1f1b", 4, 2, 2), "got 2 micro-batches for 4 stages; use 4"),
    (("interleaved_1f1b", 4, 8, 1), "schedule 'interleaved_1f1b' needs virtual_stages >= 2 model chunks per rank, "
                                    "got 1; with one chunk per rank use '1f1b'"),
    (("interleaved_1f1b", 4, 8, 0), "pipeline virtual_stages must be an integer >= 1, got 0"),
    (("1f1b", 4, 8, 2), "virtual_stages=2 applies only to 'interleaved_1f1b'; schedule '1f1b' runs one model chunk"),
])
def test_bad_input(args: tuple, message: str) -> None:
    with pytest.raises(ConfigError) as exc:
        schedule_table(*args)
    assert message in str(exc.value)


@pytest.mark.parametrize("name", ["1f1b", "zb_h1"])
@pytest.mark.parametrize("p,m", [(2, 1), (4, 1), (4, 3), (8, 5)])
def test_fewer_micro_batches_than_stages(name: str, p: int, m: int) -> None:
    """m < P runs (Megatron's and DeepSpeed's 1F1B allow it): rank 0's warm-up holds all m (GPipe's
    order), and no rank holds more than m activations."""
    table = schedule_table(name, p, m)
    result = simulate(table, Costs(1, 1, 1))
    assert [a.kind for a in compute_only(table)[0]][:m] == ["F"] * m
    assert max(result.peak_live) <= m
    gpipe = simulate(schedule_table("gpipe", p, m), Costs(1, 1, 1))
    if name == "1f1b":
        assert result.bubble_fraction == pytest.approx(gpipe.bubble_fraction)


def test_schedule_name_is_case_insensitive() -> None:
    assert schedule_table("1F1B", 2, 2) == schedule_table("1f1b", 2, 2)


def test_bad_costs() -> None:
    with pytest.raises(ConfigError, match="pipeline costs need f > 0"):
        Costs(f=0)


def test_simulator_rejects_broken_tables() -> None:
    table = schedule_table("1f1b", 2, 2)
    swapped = [list(prog) for prog in table]
    i, j = (swapped[1].index(Action(k, 0)) for k in ("F", "B"))
    swapped[1][i], swapped[1][j] = swapped[1][j], swapped[1][i]
    with pytest.raises(ScheduleError, match="runs before"):
        simulate(swapped)
    no_recv = [[a for a in prog if a != Action("RECV_F", 1, 0, 0)] for prog in table]
    with pytest.raises(ScheduleError, match="received before it"):
        simulate(no_recv)
    no_send = [[a for a in prog if a != Action("SEND_B", 1, 0, 0)] for prog in table]
    with pytest.raises(ScheduleError):
        simulate(no_send)
    # GPipe's sends on rank 0 reordered: each has its receive, but in the other order
    gpipe = [list(prog) for prog in schedule_table("gpipe", 2, 2)]
    gpipe[1] = [Action("RECV_F", 1, 0, 0), Action("RECV_F", 0, 0, 0)] + [a for a in gpipe[1] if a.kind != "RECV_F"]
    with pytest.raises(ScheduleError, match="untagged p2p would swap tensors"):
        simulate(gpipe)


def _program(text: str) -> list[Action]:
    """'F0 >F0@1 <B0@1 B0' -> actions: '>' sends, '<' receives (F or B), '@' the peer."""
    out = []
    for tok in text.split():
        if tok[0] in "<>":
            kind = ("SEND_" if tok[0] == ">" else "RECV_") + tok[1]
            mb, peer = tok[2:].split("@")
            out.append(Action(kind, int(mb), 0, int(peer)))
        else:
            out.append(Action(tok[0], int(tok[1:])))
    return out


def test_blocking_semantics_catch_a_rendezvous_deadlock() -> None:
    # Rank 0 sends F1 in a batch of its own before it will receive B0; rank 1 sends B0 in a
    # batch of its own before it will receive F1. Buffered sends make this fine; sends that wait
    # for their receive (NCCL) hang both ranks.
    table = [
        _program("F0 >F0@1 F1 >F1@1 F2 >F2@1 <B0@1 B0 W0 <B1@1 B1 W1 <B2@1 B2 W2"),
        _program("<F0@0 F0 B0 >B0@0 W0 <F1@0 F1 B1 >B1@0 W1 <F2@0 F2 B2 >B2@0 W2"),
    ]
    simulate(table, p2p="async")
    with pytest.raises(ScheduleError, match="deadlock under blocking p2p"):
        simulate(table, p2p="blocking")


def test_draw_png_chrome_trace_and_ascii(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    table = schedule_table("zb_h1", 4, 8)
    png = draw_png(table, tmp_path / "zb.png", title="zb_h1 P=4 m=8")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    inter = draw_png(schedule_table("interleaved_1f1b", 4, 8, 2), tmp_path / "il.png")
    assert inter.stat().st_size > 5000

    path = write_chrome_trace(table, tmp_path / "trace.json", scale=1000.0, metadata={"schedule": "zb_h1"})
    trace = json.loads(path.read_text())
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(events) == 4 * 8 * 3 and {e["tid"] for e in events} == {0, 1, 2, 3}
    assert all({"name", "cat", "ts", "dur", "pid", "tid", "args"} <= set(e) for e in events)
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert names == {"rank 0", "rank 1", "rank 2", "rank 3"}
    assert trace["otherData"] == {"schedule": "zb_h1"}
    back = read_chrome_trace(path, scale=1000.0)
    assert sorted(back) == sorted(simulate(table).intervals)
    assert to_chrome_trace(back, scale=1000.0)["traceEvents"] == trace["traceEvents"]

    grid = ascii_grid(table).splitlines()
    assert len(grid) == 4 and grid[3].startswith("rank 3 | .  .  .  F0 B0 F1")
    with pytest.raises(ConfigError, match="cannot read a pipeline Chrome trace"):
        read_chrome_trace(tmp_path / "missing.json")


def test_draw_png_without_matplotlib(tmp_path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ConfigError, match="needs matplotlib: pip install 'zero3d\\[plot\\]'"):
        draw_png(schedule_table("gpipe", 2, 2), tmp_path / "x.png")


@pytest.mark.parametrize("name", SCHEDULES)
def test_a_schedule_says_whether_it_has_a_weight_pass(name):
    """Callers ask the schedule, not its name (issue 28): the answer read off a small table is
    that of a full one, and only the zero-bubble schedule has W passes."""
    virtual = 2 if name == "interleaved_1f1b" else 1
    full = schedule_table(name, 4, 8, virtual, communication=False)
    assert has_weight_pass(name) == any(a.kind == Kind.W for prog in full for a in prog) == (name == "zb_h1")

"""The planner's memory walk as array arithmetic (planner/walk.py) gives the Python walk's result
exactly, on every schedule, chunk kind, gradient mode and with ties (small random byte counts)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from parallel3d.pipeline.actions import Action, Kind
from parallel3d.pipeline.schedules import SCHEDULES, schedule_table
from parallel3d.planner import memory
from parallel3d.planner.memory import RankTable, pipeline_table, rank_peak


def _profiles(rng: random.Random, pp: int, virtual: int, rank: int) -> list[SimpleNamespace]:
    out = []
    for c in range(virtual):
        stage, last = c * pp + rank, pp * virtual - 1
        kind = "only" if last == 0 else "first" if stage == 0 else "last" if stage == last else "middle"
        out.append(SimpleNamespace(kind=kind, **{name: rng.randint(0, 6) for name in (
            "at_rest", "forward_peak", "backward_peak", "after_first_grad", "input_grad_peak", "held_for_weights",
            "weight_grad_peak")}, forward_peak_in_block=rng.random() < 0.5, backward_peak_in_block=rng.random() < 0.5))
    return out


def _both(table, profiles, rng, monkeypatch) -> tuple:
    args = ({"params": rng.randint(0, 9), "gradients": rng.randint(0, 9)}, (rng.randint(0, 3), rng.randint(0, 3)),
            rng.randint(0, 4), rng.randint(0, 30), table, profiles.__getitem__, rng.randint(0, 3))
    kwargs = {"pipelined": rng.random() < 0.5, "full_grads": rng.random() < 0.5}
    monkeypatch.setattr(memory, "FAST_WALK_MIN", 10**9)
    slow = rank_peak(*args, **kwargs)
    monkeypatch.setattr(memory, "FAST_WALK_MIN", 0)
    return slow, rank_peak(*args, **kwargs)


CASES = [(s, pp, m, v, comm) for s in SCHEDULES for pp in (2, 3, 4) for m in (pp, 2 * pp, 2 * pp + 1)
         for v in ((2, 3) if s == "interleaved_1f1b" else (1,)) for comm in (False, True)
         if not (s == "interleaved_1f1b" and m % pp)]


@pytest.mark.parametrize("schedule,pp,m,virtual,communication", CASES)
def test_array_walk_equals_the_python_walk(schedule, pp, m, virtual, communication, monkeypatch):
    rng = random.Random(f"{schedule}{pp}{m}{virtual}{communication}")
    tables = schedule_table(schedule, pp, m, virtual, communication=communication)
    for rank, actions in enumerate(tables):
        for table in (list(actions), RankTable(actions)):
            for _ in range(8):
                slow, fast = _both(table, _profiles(rng, pp, virtual, rank), rng, monkeypatch)
                assert fast == slow, (rank, slow, fast)


@pytest.mark.parametrize("m", [1, 2, 3, 7])
def test_single_stage_tables(m, monkeypatch):
    rng = random.Random(m)
    full = [a for i in range(m) for a in (Action(Kind.F, i), Action(Kind.B, i))]
    for _ in range(20):
        profiles = _profiles(rng, 1, 1, 0)
        slow, fast = _both(full, profiles, rng, monkeypatch)
        assert fast == slow
        # two micro-batches stand for any number of them without pipeline stages
        short = pipeline_table("1f1b", 1, m, 1, 0)
        assert len(short) == 2 * min(m, 2)
        monkeypatch.setattr(memory, "FAST_WALK_MIN", 10**9)
        kwargs = {"pipelined": False, "full_grads": rng.random() < 0.5}
        args = ({"params": 3, "gradients": 4}, (1, 2), 1, 5)
        assert rank_peak(*args, short, profiles.__getitem__, 2, **kwargs) == rank_peak(
            *args, full, profiles.__getitem__, 2, **kwargs)

"""The planner's profiles computed ahead on worker processes and kept on disk (planner/profile_store.py)
give the predictions the one-at-a-time profiles give, and a second run reads them back. A search
forks its workers once, whatever the number of batches it profiles, and stops them at its end;
profiles started ahead never delay one read now."""

from __future__ import annotations

from dataclasses import fields

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from parallel3d.planner.hardware import a100
from parallel3d.planner.predict import Planner, Workload
from parallel3d.planner.profile_store import ProfileStore
from parallel3d.planner.search import Choice, search

CONFIG = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2)
WORKLOAD = Workload(seq=64, global_batch=16, dtype=torch.bfloat16)
CHOICE = Choice(tp=2, zero_stage=3, micro_batch=2, checkpointing=False)  # pp 1, 2, 4; every schedule; sp both ways


def _model():
    with torch.device("meta"):
        return LlamaForCausalLM(CONFIG)


def _ranked(planner: Planner) -> list[tuple]:
    result = search(planner, a100(8, 8), CHOICE, top=10)
    return [(p.layout, p.step_seconds, [r.peak for r in p.ranks]) for p in result.best]


def test_prefetched_and_stored_profiles_give_the_same_plan(tmp_path, monkeypatch):
    import multiprocessing

    from parallel3d.planner import profile_store

    want = _ranked(Planner(_model(), WORKLOAD))
    store = ProfileStore(tmp_path, CONFIG, WORKLOAD.seq, WORKLOAD.dtype)
    pools, batches = [], []
    real_context, real_call = multiprocessing.get_context, profile_store.Profiler.__call__

    def context(method):
        made = real_context(method)
        return type("Counted", (), {"Pool": lambda self, *a, **k: pools.append(made.Pool(*a, **k)) or pools[-1]})()

    def call(self, keys, parallel=True):
        batches.append(parallel)
        return real_call(self, keys, parallel)

    monkeypatch.setattr(profile_store.multiprocessing, "get_context", context)
    monkeypatch.setattr(profile_store.Profiler, "__call__", call)
    planner = Planner(_model(), WORKLOAD, store=store, workers=2)
    assert _ranked(planner) == want
    assert batches.count(True) > 1 and len(pools) == 1  # several batches, one pool
    assert planner._profiler._pool is None  # stopped when the search ended
    stored = list(tmp_path.glob("*.pkl"))
    assert stored

    def no_profiling(*args, **kwargs):
        raise AssertionError("a stored profile was computed again")

    monkeypatch.setattr("parallel3d.planner.profile.profile_passes", no_profiling)
    monkeypatch.setattr(profile_store.Profiler, "__call__", no_profiling)
    assert _ranked(Planner(_model(), WORKLOAD, store=store, workers=2)) == want
    # another sequence length is another profile
    other = ProfileStore(tmp_path, CONFIG, 32, WORKLOAD.dtype)
    assert all(other.get(key) is None for key in _keys(store, tmp_path))


def _keys(store: ProfileStore, directory) -> list[tuple]:
    planner = Planner(_model(), WORKLOAD, store=store)
    hw = a100(8, 8)
    from parallel3d.planner.search import candidates

    return sorted({k for layout in candidates(planner, hw, CHOICE) for k in planner.profile_keys(layout, hw, False)},
                  key=repr)


def test_an_unreadable_stored_profile_is_computed_again(tmp_path):
    store = ProfileStore(tmp_path, CONFIG, WORKLOAD.seq, WORKLOAD.dtype)
    key = ("only", 1, 1, 2, False, False, "flash", False, False, 1, "ulysses")
    planner = Planner(_model(), WORKLOAD, store=store)
    profile = planner._profile(*key)
    store._path(key).write_bytes(b"not a pickle")
    assert _values(Planner(_model(), WORKLOAD, store=store)._profile(*key)) == _values(profile)
    assert _values(store.get(key)) == _values(profile)


def _values(profile) -> tuple:
    """A profile's fields (PassProfile compares by identity)."""
    return tuple(getattr(profile, f.name) for f in fields(profile))


def _key(blocks: int, tp: int, kind: str = "only") -> tuple:
    return (kind, blocks, 1, tp, False, False, "flash", False, False, 1, "ulysses")


def test_profiles_started_ahead_never_delay_one_read_now(tmp_path, monkeypatch):
    """``Profiler.ahead`` queues profiles for the workers and returns; a call's keys go to the next
    free worker before what is queued; what was made ahead and never read comes back from
    ``close``; a failing worker is an error, not a wait. (The workers, forked, run a stand-in
    profile that holds its group until the test lets it go; the groups are counted as they are sent.)"""
    import multiprocessing.pool
    import threading
    import time

    from parallel3d.planner import profile, profile_store

    go, sent = tmp_path / "go", []
    send = multiprocessing.pool.Pool.apply_async

    def counted(pool, func, args=(), *rest, **kwargs):
        sent.append(args[0][0][1:4:2])  # (blocks, tp) of the group's first key
        return send(pool, func, args, *rest, **kwargs)

    def stand_in(config, keys, *, seq, dtype):
        if any(key[3] == 7 for key in keys):
            raise ValueError("the stand-in fails at tp 7")
        deadline = time.monotonic() + 60
        while not go.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        return {key: f"profile of {key[:4]}" for key in keys}

    monkeypatch.setattr(multiprocessing.pool.Pool, "apply_async", counted)
    monkeypatch.setattr(profile, "profile_passes", stand_in)
    profiler = profile_store.Profiler(CONFIG, WORKLOAD.seq, WORKLOAD.dtype, workers=2)
    try:
        ahead = [_key(blocks, tp, kind) for blocks in (1, 2) for tp in (1, 2, 4) for kind in ("only", "first")]
        profiler.ahead(ahead)  # six groups of two keys (one per blocks, tp), the larger first; two sent at once
        assert sent == [(2, 1), (2, 2)]
        now, read = [_key(3, 8)], {}
        reader = threading.Thread(target=lambda: read.update(profiler(now)))
        reader.start()
        while now[0] not in profiler._pending:  # queued by the reader
            time.sleep(0.01)
        go.touch()
        reader.join(60)
        assert read == {now[0]: f"profile of {now[0][:4]}"}
        assert sent[2] == (3, 8)  # before the four groups queued ahead of it
        assert profiler(ahead[:2]) == {key: f"profile of {key[:4]}" for key in ahead[:2]}
        left = profiler.close()
    finally:
        profiler.close()
    assert len(set(sent)) == len(sent)  # no group sent twice
    # the two sent first were done before the third was sent, and never read
    assert len(left) >= 4 and set(left) <= set(ahead[2:])
    assert all(value == f"profile of {key[:4]}" for key, value in left.items())
    profiler = profile_store.Profiler(CONFIG, WORKLOAD.seq, WORKLOAD.dtype, workers=2)
    try:
        with pytest.raises(RuntimeError, match="profiling worker failed"):
            profiler([_key(1, 7)])
    finally:
        profiler.close()

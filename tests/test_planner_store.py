"""The planner's profiles computed ahead on worker processes and kept on disk (planner/profile_store.py)
give the predictions the one-at-a-time profiles give, and a second run reads them back. A search
forks its workers once, whatever the number of batches it profiles, and stops them at its end."""

from __future__ import annotations

from dataclasses import fields

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

"""Tensor parallelism composed with ZeRO on the dp x tp mesh, against the single-process oracle."""

from __future__ import annotations

import functools

import pytest
import torch

from tests.tiny import ds_config, make_model, max_rel_param_error, oracle_run, rank_micro_batches, token_batches

STEPS, GAS, TP, DP = 5, 2, 2, 2
RTOL = 1e-5


def train_tp(kind: str, stage: int, sequence_parallel: bool, zero: dict | None = None) -> tuple[list[float], dict, dict]:
    """``zero``: more of the config's ``zero_optimization``."""
    import parallel3d

    config = ds_config(stage, GAS, DP, stage3_param_persistence_threshold=0, reduce_bucket_size=3000, **(zero or {}))
    config["tensor_parallel"] = {"size": TP, "sequence_parallel": sequence_parallel}
    engine, _, _, _ = parallel3d.initialize(model=make_model(kind), config=config)
    dp_rank = engine.mesh.local_rank("dp")  # ranks of one tp group see the same data
    data_iter = iter(rank_micro_batches(token_batches(STEPS, GAS, DP), dp_rank))
    losses = [engine.train_batch(data_iter) for _ in range(STEPS)]
    return losses, engine.full_parameters(), engine.memory_report()


@functools.cache
def oracle(kind: str):
    return oracle_run(kind, token_batches(STEPS, GAS, DP))


@pytest.mark.parametrize(
    "kind,stage,sp",
    [("llama", 1, False), ("llama", 2, False), ("llama", 3, False), ("llama", 3, True), ("gpt2", 2, False), ("gpt2", 3, True)],
)
def test_tp_x_dp_matches_single_process(dist, kind, stage, sp):
    results = dist.run(TP * DP, train_tp, kind, stage, sp)
    want_losses, want_params = oracle(kind)
    for losses, params, _ in results:
        assert losses == pytest.approx(want_losses, rel=RTOL)
        err, name = max_rel_param_error(params, want_params)
        assert err < RTOL, f"{name} differs by {err:.2e}"


def _memory(kind: str, tp: int, stage: int):
    import parallel3d

    config = ds_config(stage, 1, 4 // tp, reduce_bucket_size=3000)
    config["tensor_parallel"] = {"size": tp}
    engine, _, _, _ = parallel3d.initialize(model=make_model(kind), config=config)
    sharded = sum(p.numel() for p in engine.tp_info.sharded_params) if engine.tp_info else 0
    return engine.memory_report()["params"], sharded


def test_tp_sharded_weights_are_one_over_t(dist):
    """Stage 0 at tp=2 holds the replicated params whole and 1/2 of every split weight."""
    (full_bytes, _), *_ = dist.run(4, _memory, "llama", 1, 0)
    (tp_bytes, sharded_local), *_ = dist.run(4, _memory, "llama", 2, 0)
    # fp32, 4 bytes each; stage 0 pads nothing. Full = replicated + 2 x (local split part).
    replicated = tp_bytes // 4 - sharded_local
    assert full_bytes // 4 == replicated + TP * sharded_local
    assert sharded_local > replicated  # the projections and the vocabulary dominate

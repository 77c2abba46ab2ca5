"""Replicated kv heads and parameters inside split regions, trained under ZeRO x tp.

Each run trains a few steps with plain SGD and gradient clipping on the dp x tp mesh and
compares every parameter's *update* (``engine.full_parameters()`` minus the start, so the
replicated kv shards are reassembled into the original k/v weights) with the single-process
run, and the gradient norm of every step with the single process's. SGD because its update is
the gradient itself: a gradient that misses the other ranks' share, or a norm that counts a
replicated shard twice (which clipping turns into a wrong step size), shows in the update;
Adam would normalize much of it away. Clipping is active in every step (checked).
"""

from __future__ import annotations

import functools

import pytest
import torch

from tests.tiny import VOCAB, ds_config, oracle_run, rank_micro_batches, token_batches, update_mismatch
from tests.tiny_tp import make_tp_model

STEPS, GAS, LR, CLIP = 3, 2, 1.0, 0.05
RTOL = 1e-5


def _config(tp: int, dp: int, stage: int) -> dict:
    config = ds_config(stage, GAS, dp, clip=CLIP, stage3_param_persistence_threshold=0, reduce_bucket_size=3000)
    config["optimizer"] = {"type": "SGD", "params": {"lr": LR}}
    config["tensor_parallel"] = {"size": tp}
    return config


def train(kind: str, overrides: dict, tp: int, stage: int, meta: bool) -> tuple[list[float], list[float], dict]:
    """On every rank: SGD steps on the dp x tp mesh; a ``meta`` model starts from a replay of its init."""
    import torch.distributed as dist

    import parallel3d

    dp = dist.get_world_size() // tp
    with torch.device("meta" if meta else "cpu"):
        model = make_tp_model(kind, vocab_size=VOCAB, **overrides)
    engine, optimizer, _, _ = parallel3d.initialize(model=model, config=_config(tp, dp, stage))
    data_iter = iter(rank_micro_batches(token_batches(STEPS, GAS, dp), engine.mesh.local_rank("dp")))
    losses, norms = [], []
    for _ in range(STEPS):
        losses.append(engine.train_batch(data_iter))
        norms.append(optimizer.last_grad_norm)
    return losses, norms, engine.full_parameters()


@functools.cache
def oracle(kind: str, overrides: tuple, dp: int) -> tuple[list[float], list[float], dict, dict]:
    model = make_tp_model(kind, vocab_size=VOCAB, **dict(overrides))
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    norms: list[float] = []
    losses, params = oracle_run(kind, token_batches(STEPS, GAS, dp), clip=CLIP, model=model, grad_norms=norms,
                                optimizer=lambda ps: torch.optim.SGD(ps, lr=LR))
    return losses, norms, params, start


@pytest.mark.parametrize("kind,overrides,tp,stage,meta", [
    ("llama", dict(num_key_value_heads=2), 4, 1, False),  # tp 4 over 2 kv heads
    ("llama", dict(num_key_value_heads=2), 4, 3, False),
    ("llama", dict(num_key_value_heads=1), 2, 1, False),  # multi-query attention, dp 2
    ("llama", dict(num_key_value_heads=1), 2, 3, True),  # ... started on the meta device
    ("apertus", {}, 2, 2, False),  # xIELU alpha_p / alpha_n between up_proj and down_proj
    ("cohere", dict(num_key_value_heads=2), 4, 3, True),  # [heads, head_dim] q/k norms split, k_norm replicated
    ("mixtral", {}, 2, 3, True),  # every expert split in two; the router's gradient summed at the experts' entry
], ids=lambda v: str(v))
def test_updates_match_single_process(dist, kind, overrides, tp, stage, meta):
    results = dist.run(4, train, kind, overrides, tp, stage, meta)
    want_losses, want_norms, want_params, start = oracle(kind, tuple(sorted(overrides.items())), 4 // tp)
    assert min(want_norms) > CLIP, "clipping must be active for the norm to matter"
    for rank, (losses, norms, params) in enumerate(results):
        assert losses == pytest.approx(want_losses, rel=RTOL), f"rank {rank}"
        assert norms == pytest.approx(want_norms, rel=RTOL), f"rank {rank}: grad norms"
        ratio, name, rel = update_mismatch(params, want_params, start, STEPS, RTOL)
        assert ratio <= 1, f"rank {rank}: update of {name} differs by {rel:.2e} of itself"
